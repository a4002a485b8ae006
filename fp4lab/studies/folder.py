"""A study's results folder, and the atomic writes that keep it whole.

    <out>/
      config.json       study, preset, overrides, seed, device, backend and the resolved config
      environment.json  fp4lab version and git commit, torch, Python, the device, the seeds
      cells/00000.json  one file per finished cell: its parameters, its seed, its tables' rows
      metrics.parquet   every cell's rows in the sweep's order (and metrics.csv)
      <table>.parquet   any other table the study's cells return (e.g. per-tile traces)
      <name>.parquet    tables the report derives from the metrics (e.g. a ranking), also
                        <name>.csv
      figures/<name>.png
      report.md
      <folder>/...      files a study's cells write themselves (`CellContext.folder`), e.g.
                        pv-divergence's activations/

Every file is written to a hidden temporary file in its own folder and moved into place
with `os.replace`, so a run killed at any moment leaves each file absent or complete, never
half written; `read_cells` ignores the temporary files such a kill leaves behind.

Rows are stored as JSON (Python writes every float64 so that it reads back the same bits,
NaN and infinities included), and the metrics table is always assembled from the stored
cells, so an interrupted and resumed run gives the same table as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

import fp4lab

__all__ = [
    "atomic_write",
    "write_json",
    "read_json",
    "write_cell",
    "read_cells",
    "read_tables",
    "write_tables",
    "read_metrics",
    "save_figure",
    "plain_value",
    "environment",
    "Results",
    "open_results",
]

CELLS = "cells"
FIGURES = "figures"


def atomic_write(path: Path, write, suffix: str = ".tmp") -> None:
    """Call ``write(temporary_path)`` and move the finished file onto `path`. The temporary
    file is hidden (``.<name>.<random><suffix>``); a writer that goes by the extension takes
    a `suffix` ending in it (``.tmp.safetensors`` for `fp4lab.analysis.save_inputs`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    """`data` as indented JSON, atomically."""
    text = json.dumps(data, indent=2) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text))


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def plain_value(value: Any, where: str):
    """A row value as a JSON scalar (numpy and 0-dim torch scalars unwrapped); TypeError
    naming `where` for anything else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()  # numpy scalars
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{where}: a metrics value must be a number, a string, a bool or None, "
                    f"got {type(value).__name__}")


def write_cell(folder: Path, index: int, cell: dict, cell_seed: int, tables: dict) -> None:
    """Store one finished cell (atomically): cells/<index>.json with its tables' rows."""
    record = {"index": index, "cell": cell, "cell_seed": cell_seed, "tables": tables}
    text = json.dumps(record, indent=1, allow_nan=True) + "\n"
    atomic_write(Path(folder) / CELLS / f"{index:05d}.json", lambda tmp: tmp.write_text(text))


def read_cells(folder: Path) -> dict[int, dict]:
    """The finished cells stored in `folder`, by index (temporary files are skipped)."""
    found = {}
    for path in sorted((Path(folder) / CELLS).glob("[0-9]*.json")):
        record = json.loads(path.read_text())
        found[record["index"]] = record
    return found


def write_tables(folder: Path, tables: dict[str, pd.DataFrame]) -> None:
    """metrics.parquet and metrics.csv, and <name>.parquet for every other table, atomically."""
    folder = Path(folder)
    for name, frame in tables.items():
        atomic_write(folder / f"{name}.parquet", lambda tmp, f=frame: f.to_parquet(tmp))
    atomic_write(folder / "metrics.csv", lambda tmp: tables["metrics"].to_csv(tmp, index=False))


def read_tables(folder: Path) -> dict[str, pd.DataFrame]:
    """Every <table>.parquet of the folder by name, metrics first."""
    tables = {"metrics": read_metrics(folder)}
    tables.update({p.stem: pd.read_parquet(p) for p in sorted(Path(folder).glob("*.parquet"))
                   if p.stem != "metrics"})
    return tables


def read_metrics(folder: Path) -> pd.DataFrame:
    path = Path(folder) / "metrics.parquet"
    if not path.exists():
        raise FileNotFoundError(f"folder: {folder} holds no metrics.parquet (did the run finish?)")
    return pd.read_parquet(path)


def save_figure(figure, path: Path, dpi: int = 110) -> None:
    """A matplotlib Figure as a PNG, atomically."""
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=dpi))


def environment(device: str, seed: int, world_size: int) -> dict:
    """What the numbers depend on besides the config: versions, commit, device, seeds."""
    import numpy

    root = Path(fp4lab.__file__).resolve().parents[1]
    return {
        "fp4lab": fp4lab.__version__,
        "git_commit": _git(root, "rev-parse", "HEAD"),
        "git_dirty": _git(root, "status", "--porcelain", "--untracked-files=no") not in ("", None),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "pandas": pd.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "device_name": _device_name(device),
        "seed": seed,
        "cell_seeds": "sha256 of the run seed and the cell's parameters (stored in each cell)",
        "world_size": world_size,
    }


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()



@dataclass(frozen=True)
class Results:
    """A results folder as read back (`open_results`), for notebooks.

    Attributes:
        path: the folder.
        record: config.json (study, preset, overrides, seed, device, backend, config fields).
        sessions: environment.json's sessions (versions, commit, device, seeds, ranks).
        metrics: metrics.parquet.
        tables: every other <table>.parquet by name (e.g. "trace").
        figures: the figures' PNG files, by name.
        report: report.md's text.
    """

    path: Path
    record: dict
    sessions: list
    metrics: pd.DataFrame
    tables: dict
    figures: dict
    report: str

    @property
    def study(self) -> str:
        return self.record["study"]

    @property
    def config(self) -> dict:
        """The resolved config's fields."""
        return {k: v for k, v in self.record["config"].items() if k != "kind"}


def open_results(folder: str | Path) -> Results:
    """Read a finished results folder (FileNotFoundError naming what is missing)."""
    path = Path(folder)
    for name in ("config.json", "metrics.parquet", "report.md"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"folder: {path} holds no {name}; not a finished study run")
    env = path / "environment.json"
    tables = read_tables(path)
    return Results(
        path=path,
        record=read_json(path / "config.json"),
        sessions=read_json(env)["sessions"] if env.exists() else [],
        metrics=tables.pop("metrics"),
        tables=tables,
        figures={p.stem: p for p in sorted((path / FIGURES).glob("*.png"))},
        report=(path / "report.md").read_text(),
    )
