"""Finding studies: one module per study in the repository's ``studies/`` folder.

A study module (``studies/<name>.py``, its name the file's with ``_`` read as ``-``) defines

    QUESTION: str                      the question it answers, in a sentence
    PRESETS: {"smoke": cfg, "full": cfg, ...}  instances of its config dataclass (see
                                       `config`); presets beyond the two (e.g. "long") allowed
    cells(config) -> list[dict]        the sweep: each cell a small dict of JSON scalars
    run_cell(config, cell, ctx) -> rows   one cell's rows (list of dicts, or a DataFrame),
                                       or {"metrics": rows, "<table>": rows, ...} to store
                                       more tables (<table>.parquet, for notebooks);
                                       ctx is a `CellContext` (device, backend, seeds)
    report(config, metrics[, tables]) -> (markdown, {name: matplotlib Figure}[, {name:
                                       DataFrame}]), from the metrics (and the other tables, if
                                       it takes them); the third item: tables it derives
    BACKENDS (optional): the backends it can measure with (default: all of fp4lab's)
    data_parallel(config) -> bool (optional): True when every rank of torchrun runs every
                                       cell together (a data-parallel training run, DDP);
                                       default False, the cells spread over the ranks

Modules are imported from their files with importlib (the folder is not a package), once
per process; a study uses only fp4lab's public API, and nothing in fp4lab imports a study
except through this loader.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pandas as pd

import fp4lab
from fp4lab.backends import BACKENDS
from fp4lab.studies.config import apply_overrides, config_types
from fp4lab.studies.folder import plain_value

__all__ = [
    "Study", "CellContext", "studies_dir", "list_studies", "load_study", "cell_key", "cell_label",
    "PRESET_NAMES", "SCRATCH",
]

PRESET_NAMES = ("smoke", "full")  # the presets every study has
SCRATCH = "scratch"  # <out>/scratch/<index>: a running cell's own files (checkpoints)
_LOADED: dict[Path, ModuleType] = {}


def studies_dir() -> Path:
    """The repository's ``studies/`` folder (next to the fp4lab package)."""
    return Path(fp4lab.__file__).resolve().parents[1] / "studies"


@dataclass(frozen=True)
class CellContext:
    """What `run_cell` is given besides the config and the cell.

    Attributes:
        device: the torch device to compute on.
        backend: the attention backend to pass to `fp4lab.attention` (never replaced).
        seed: the run's seed, shared by every cell (draw inputs meant to be the same in
            every cell from it).
        cell_seed: this cell's own seed, a hash of the run's seed and the cell's parameters
            (the same whichever rank or session runs the cell).
        index: the cell's position in the sweep.
        scratch: a folder of the results folder for the cell's own files while it runs
            (``<out>/scratch/<index>``, not created): a cell that checkpoints writes there,
            finds its checkpoint there when a killed run is resumed, and the framework
            deletes the folder once the cell is stored. None outside a results folder.
        rank, world_size: this process's rank and the number of ranks running the cell
            together (a data-parallel study under torchrun; otherwise 0 and 1).
        folder: the results folder, None outside one. A cell may write files of its own
            there, in a subfolder the framework does not use (pv-divergence's
            ``activations/``): named by the cell's parameters, written with
            `folder.atomic_write` by one rank, and the same bytes when the cell reruns, so a
            cell killed after writing them and rerun on ``--resume`` overwrites them whole,
            neither losing nor duplicating one. The framework never deletes them.
    """

    device: str
    backend: str
    seed: int
    cell_seed: int
    index: int
    scratch: Path | None = None
    rank: int = 0
    world_size: int = 1
    folder: Path | None = None


@dataclass(frozen=True)
class Study:
    """A loaded study module and what the framework reads from it."""

    name: str
    path: Path
    module: ModuleType

    @property
    def question(self) -> str:
        return self.module.QUESTION

    @property
    def config_type(self) -> type:
        return type(self.module.PRESETS["smoke"])

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(getattr(self.module, "BACKENDS", BACKENDS))

    @property
    def presets(self) -> tuple[str, ...]:
        """The names of its presets: smoke, full, then any others it defines."""
        return tuple(self.module.PRESETS)

    def resolve(self, preset: str, overrides=()) -> object:
        """The preset's config with the ``key=value`` overrides applied and checked."""
        if preset not in self.module.PRESETS:
            raise ValueError(f"preset must be one of {', '.join(self.presets)}, got {preset!r}")
        return apply_overrides(self.module.PRESETS[preset], list(overrides))

    def data_parallel(self, config) -> bool:
        """Whether the ranks run each cell together (the study's `data_parallel`)."""
        found = getattr(self.module, "data_parallel", None)
        return bool(found(config)) if found is not None else False

    def cells(self, config) -> list[dict]:
        """The sweep's cells, checked: dicts of JSON scalars, no two alike."""
        cells = [_cell_dict(c, i, self.name) for i, c in enumerate(self.module.cells(config))]
        seen = {}
        for i, cell in enumerate(cells):
            key = cell_key(cell)
            if key in seen:
                raise ValueError(
                    f"study {self.name}: cells {seen[key]} and {i} are the same, {key}"
                )
            seen[key] = i
        return cells

    def run_cell(self, config, cell: dict, ctx: CellContext) -> dict[str, list[dict]]:
        """The cell's tables ("metrics" and any others), rows as dicts of JSON scalars."""
        found = self.module.run_cell(config, dict(cell), ctx)
        tables = dict(found) if isinstance(found, dict) else {"metrics": found}
        where = f"study {self.name}, cell {ctx.index}"
        if "metrics" not in tables or not all(
            isinstance(n, str) and re.fullmatch(r"[a-z][a-z0-9_]*", n) for n in tables
        ):
            raise ValueError(f"{where}: run_cell must return rows, or a dict of tables named "
                             f"in lower case with a 'metrics' table, got {sorted(tables)}")
        return {name: _rows(rows, where) for name, rows in tables.items()}

    def report(self, config, metrics, tables: dict):
        """(markdown, {name: Figure}, {name: DataFrame}) from the study's `report`; a report
        with a third parameter ``tables`` also gets the other tables its cells returned, by
        name. A report may return a third item, tables derived from the metrics (a ranking):
        the folder stores them as <name>.parquet and <name>.csv."""
        takes_tables = "tables" in inspect.signature(self.module.report).parameters
        extra = (tables,) if takes_tables else ()
        found = self.module.report(config, metrics, *extra)
        if not isinstance(found, tuple) or len(found) not in (2, 3):
            raise TypeError(f"study {self.name}: report must return (markdown, figures) or "
                            "(markdown, figures, tables)")
        derived = dict(found[2]) if len(found) == 3 else {}
        for name, frame in derived.items():
            if not (isinstance(name, str) and re.fullmatch(r"[a-z][a-z0-9_]*", name)
                    and name != "metrics" and isinstance(frame, pd.DataFrame)):
                raise ValueError(f"study {self.name}: the report's table {name!r} must be a "
                                 "DataFrame named in lower case, not 'metrics'")
        return found[0], dict(found[1]), derived


def _rows(rows, where: str) -> list[dict]:
    if hasattr(rows, "to_dict"):
        rows = rows.to_dict("records")
    return [{str(k): plain_value(v, f"{where}, {k}") for k, v in row.items()} for row in rows]


def cell_key(cell: dict) -> str:
    """A cell's canonical text: its parameters as sorted JSON."""
    return json.dumps(cell, sort_keys=True)


def cell_label(cell: dict) -> str:
    """A cell in a few words, for the progress bar."""
    return " ".join(f"{k}={v}" for k, v in cell.items())


def _cell_dict(cell, index: int, study: str) -> dict:
    if dataclasses.is_dataclass(cell) and not isinstance(cell, type):
        cell = dataclasses.asdict(cell)
    if not isinstance(cell, dict):
        raise TypeError(f"study {study}: cell {index} must be a dict or dataclass, got "
                        f"{type(cell).__name__}")
    out = {}
    for key, value in cell.items():
        value = plain_value(value, f"study {study}, cell {index}, {key}")
        if not isinstance(key, str) or key in ("cell", "cell_seed"):
            raise ValueError(f"study {study}: cell {index} has a bad key {key!r}")
        out[key] = value
    return out


def _module_name(path: Path) -> str:
    return f"fp4lab_study_{path.stem}"


def _import(path: Path) -> ModuleType:
    path = path.resolve()
    if path not in _LOADED:
        spec = importlib.util.spec_from_file_location(_module_name(path), path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and get_type_hints look it up
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[spec.name]
            raise
        _check_module(module, path)
        _LOADED[path] = module
    return _LOADED[path]


def _check_module(module: ModuleType, path: Path) -> None:
    where = f"study {path.name}"
    for attr in ("QUESTION", "PRESETS", "cells", "run_cell", "report"):
        if not hasattr(module, attr):
            raise TypeError(f"{where} defines no {attr}")
    presets = module.PRESETS
    if not isinstance(presets, dict) or not set(PRESET_NAMES) <= set(presets):
        raise TypeError(f"{where}: PRESETS must be a dict with the keys {PRESET_NAMES} (and "
                        "any other presets)")
    for name in presets:
        if not (isinstance(name, str) and re.fullmatch(r"[a-z][a-z0-9_-]*", name)):
            raise TypeError(f"{where}: preset name {name!r} must be a lower-case word")
    kinds = {type(p) for p in presets.values()}
    if len(kinds) != 1:
        raise TypeError(f"{where}: its presets must be instances of one config dataclass")
    config_types(kinds.pop())
    unknown = set(getattr(module, "BACKENDS", BACKENDS)) - set(BACKENDS)
    if unknown:
        raise TypeError(f"{where}: BACKENDS names {sorted(unknown)}, not fp4lab backends")


def list_studies(folder: Path | None = None) -> list[Study]:
    """Every study in `folder` (default: the repository's ``studies/``), by name."""
    folder = studies_dir() if folder is None else Path(folder)
    paths = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    return [Study(p.stem.replace("_", "-"), p, _import(p)) for p in paths]


def load_study(name: str, folder: Path | None = None) -> Study:
    """The study called `name` (``quantizer-error`` is ``studies/quantizer_error.py``)."""
    folder = studies_dir() if folder is None else Path(folder)
    ok = isinstance(name, str) and name and not name.startswith(("_", "."))
    path = folder / f"{name.replace('-', '_')}.py" if ok else None
    if path is None or "/" in name or not path.is_file():
        known = ", ".join(p.stem.replace("_", "-") for p in sorted(folder.glob("[!_]*.py")))
        raise ValueError(f"study: unknown study {name!r}; known: {known or 'none'}")
    return Study(name, path, _import(path))
