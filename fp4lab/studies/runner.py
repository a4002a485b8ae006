"""Running a study: its cells spread over ranks, stored one by one, resumable; its report.

`run_study` does, in order:

1. load the study, resolve its config (a preset plus ``key=value`` overrides, checked),
   list its cells, and check the device and the backend: every mistake in the arguments is
   an error here, before anything is written;
2. (rank 0) check the results folder: new, or, resuming, holding the same study, config,
   seed, device and backend; find the cells still to run;
3. run them. Under ``torchrun`` (RANK and WORLD_SIZE set) the pending cells go round-robin
   to the ranks, one round at a time; after each round every rank's rows are gathered
   (gloo, on the CPU) and rank 0 stores each finished cell, so a killed sweep loses at
   most the round in flight. A data-parallel study (its ``data_parallel(config)`` True)
   runs each cell on all ranks together instead (its own DDP inside the cell) and rank 0's
   rows are stored. A rank whose cell, or wait in the gather, lasts a minute says so on
   stderr (`_watch`), again at 2, 4, 8, ... minutes, naming its cell, even with ``quiet``.
   A cell's seed is a hash of the run's seed and the cell's parameters, so neither the
   rank that runs it nor the session changes its numbers. A cell may keep
   checkpoints in its scratch folder (``CellContext.scratch``): a resumed run finds them
   there, and the folder is deleted once the cell is stored;
4. (rank 0) assemble the metrics table from the stored cells in the sweep's order and write
   it, the figures, the report and the tables the report derives from the metrics
   (`rebuild_report` repeats only this step).

The backend is passed to the study's `fp4lab.attention` calls as given, so what a backend
does not run raises the library's own error at the first cell, and a study that calls no
attention backend (its BACKENDS names only "reference") refuses the others up front. Nothing
falls back to another backend, and the folder is written only once a first cell has
finished: a run that fails at once leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import re
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from fp4lab.backends import BACKENDS
from fp4lab.config import from_fields, to_fields
from fp4lab.studies.discovery import (
    SCRATCH,
    CellContext,
    Study,
    cell_key,
    cell_label,
    load_study,
)
from fp4lab.studies.folder import (
    FIGURES,
    atomic_write,
    environment,
    read_cells,
    read_json,
    read_tables,
    save_figure,
    write_cell,
    write_json,
    write_tables,
)

__all__ = ["run_study", "rebuild_report", "cell_seed"]

_RESERVED = ("cell", "cell_seed")
_SAME_RUN = ("study", "seed", "device", "backend", "config")
_FIRST_REPORT_S = 60.0  # seconds of a rank's phase before `_watch` first reports it


def cell_seed(seed: int, cell: dict) -> int:
    """A cell's seed: the first 60 bits of sha256 of the run's seed and the cell's parameters."""
    digest = hashlib.sha256(f"{seed}|{cell_key(cell)}".encode()).hexdigest()
    return int(digest[:15], 16)


def run_study(
    name: str,
    preset: str = "smoke",
    overrides: list[str] | tuple[str, ...] = (),
    *,
    out: str | Path | None = None,
    device: str = "cpu",
    backend: str = "reference",
    seed: int = 0,
    resume: bool = False,
    quiet: bool = False,
    folder: str | Path | None = None,
) -> Path:
    """Run study `name` and write its results folder; returns the folder.

    Args:
        name: a study of `list_studies` (``quantizer-error``, ``p-operand``, ...).
        preset: "smoke" (seconds, for CI) or "full" (the published sizes).
        overrides: ``key=value`` strings setting fields of the study's config.
        out: the results folder (default ``results/<study>-<preset>-<time>``).
        device: "cpu", "cuda" or "cuda:N" (under torchrun, "cuda" is each rank's local GPU).
        backend: "reference" or "triton", passed to `fp4lab.attention`; never replaced.
        seed: the run's seed; every cell's seed derives from it.
        resume: finish the run stored in `out`, skipping its finished cells.
        quiet: no progress bar.
        folder: where the study modules are (default: the repository's ``studies/``).
    """
    study = load_study(name, folder)
    config = study.resolve(preset, overrides)
    cells = study.cells(config)
    _check_seed(seed)
    ranks = _Ranks()
    try:
        device = _rank_device(device, ranks)
        _check_backend(study, backend)
        record = {
            "study": study.name,
            "preset": preset,
            "overrides": list(overrides),
            "seed": seed,
            "device": _device_kind(device),
            "backend": backend,
            "config": to_fields(config),
            "cells": len(cells),
        }
        setup = _on_rank0(ranks, lambda: _prepare(out, record, cells, resume))
        path, pending = Path(setup[0]), setup[1]
        opener = _Opener(path, record, len(cells) - len(pending), ranks.world)
        _sweep(study, config, cells, pending, opener, ranks, (device, backend, seed), quiet)
        if ranks.rank == 0:
            opener.ensure()
            _finish(path, study, config, record, cells)
        return path
    finally:
        ranks.close()


def _check_seed(seed) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2^63), got {seed!r}")


def _device_kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else device


def _rank_device(device: str, ranks: _Ranks) -> str:
    """The device string checked; "cuda" under several ranks is each rank's local GPU."""
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: torch sees no CUDA device on this machine")
        if device == "cuda" and ranks.world > 1:
            local = int(os.environ.get("LOCAL_RANK", ranks.rank))
            device = f"cuda:{local % torch.cuda.device_count()}"
    return device


def _check_backend(study: Study, backend: str) -> None:
    """A known backend the study can measure with (`fp4lab.attention` raises its own error
    for what a backend does not run, at the first cell, before anything is stored)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend not in study.backends:
        raise NotImplementedError(
            f"backend={backend!r}: study {study.name} calls no attention backend (it measures "
            f"with {' or '.join(map(repr, study.backends))} only); no silent fallback"
        )


def _prepare(out, record: dict, cells: list[dict], resume: bool) -> tuple[str, list[int]]:
    """(rank 0) The folder, checked, and the indices of the cells still to run; nothing is
    written until a cell has finished (`_Opener`), except a running cell's scratch folder and
    the files it writes itself (a run killed in its first cell leaves only those, which
    --resume continues)."""
    path = _default_out(record) if out is None else Path(out)
    config_path = path / "config.json"
    if config_path.exists():
        if not resume:
            raise ValueError(f"out: {path} holds a run already; pass --resume to finish it, or "
                             "choose another --out")
        _check_same_run(read_json(config_path), record, path)
    elif (path.exists() and not (path / SCRATCH).exists()
          and any(True for _ in path.iterdir())):
        raise ValueError(f"out: {path} exists and is not a study's results folder")
    elif (path / SCRATCH).exists() and not resume:
        raise ValueError(f"out: {path} holds the scratch files of a run killed in its first "
                         "cell; pass --resume to continue it, or choose another --out")
    done = read_cells(path)
    for index, stored in done.items():
        if index >= len(cells) or stored["cell"] != cells[index]:
            raise ValueError(f"--resume: {path}/cells holds cell {index} = {stored['cell']}, "
                             "which this study's sweep does not have there")
    return str(path), [i for i in range(len(cells)) if i not in done]


class _Opener:
    """(rank 0) Writes config.json (if new) and this session's environment once, when the
    first result is to be stored: a run whose first cell fails leaves nothing behind."""

    def __init__(self, path: Path, record: dict, done: int, world: int) -> None:
        self.path, self.record, self.done, self.world = path, record, done, world
        self.opened = False

    def ensure(self) -> None:
        if self.opened:
            return
        if not (self.path / "config.json").exists():
            write_json(self.path / "config.json", self.record)
        env_path = self.path / "environment.json"
        sessions = read_json(env_path)["sessions"] if env_path.exists() else []
        session = environment(self.record["device"], self.record["seed"], self.world)
        session["started"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        session["cells_done_before"] = self.done
        write_json(env_path, {"sessions": [*sessions, session]})
        self.opened = True


def _default_out(record: dict) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = base = Path("results") / f"{record['study']}-{record['preset']}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _check_same_run(stored: dict, record: dict, path: Path) -> None:
    for key in _SAME_RUN:
        if stored.get(key) != record[key]:
            if key == "config":
                diff = [k for k in record[key] if stored[key].get(k) != record[key][k]]
                raise ValueError(f"--resume: {path} was run with a different config ("
                                 f"{', '.join(f'{k}={stored[key].get(k)!r}' for k in diff)})")
            raise ValueError(f"--resume: {path} was run with {key}={stored.get(key)!r}, not "
                             f"{record[key]!r}")


def _sweep(study, config, cells, pending, opener: _Opener, ranks, run, quiet) -> None:
    """Run the pending cells, a round of one cell per rank at a time (or, data-parallel, one
    cell on all ranks); rank 0 stores them and deletes their scratch folders."""
    device, backend, seed = run
    shared = study.data_parallel(config) and ranks.world > 1
    per_round = 1 if shared else ranks.world
    bar = tqdm(
        total=len(cells), initial=len(cells) - len(pending), desc=study.name, unit="cell",
        disable=quiet or ranks.rank != 0, dynamic_ncols=True,
    )
    with bar:
        for start in range(0, len(pending), per_round):
            round_ = pending[start : start + per_round]
            mine = round_[0] if shared else (
                round_[ranks.rank] if ranks.rank < len(round_) else None)
            others = f" (+{len(round_) - 1} on other ranks)" if len(round_) > 1 else ""
            bar.set_postfix_str(f"{cell_label(cells[round_[0]])}{others}", refresh=True)
            result = None
            if mine is not None:
                ctx = CellContext(device, backend, seed, cell_seed(seed, cells[mine]), mine,
                                  scratch=opener.path / SCRATCH / f"{mine:05d}",
                                  rank=ranks.rank if shared else 0,
                                  world_size=ranks.world if shared else 1,
                                  folder=opener.path)
                with _watch(ranks, f"{study.name}: rank {ranks.rank} has run cell {mine} "
                            f"({cell_label(cells[mine])})"):
                    result = _run_cell(study, config, cells[mine], ctx, ranks.world > 1)
            with _watch(ranks, f"{study.name}: rank {ranks.rank} has waited in the gather for "
                        f"the round's other ranks ({_others(round_, ranks, shared)})"):
                results = ranks.gather(_portable(result))
            stored = [r for r in results if r is not None and "tables" in r]
            if ranks.rank == 0 and stored:
                _store(opener, cells, stored[:1] if shared else stored)
            _raise_failures(results, result, ranks)
            bar.update(len(round_))


def _others(round_: list[int], ranks: _Ranks, shared: bool) -> str:
    """The cells of a round's other ranks, for `_watch`'s line: "cell 2 on rank 2, ..."."""
    return ", ".join(f"cell {round_[0] if shared else round_[r]} on rank {r}"
                     for r in range(ranks.world) if r != ranks.rank and (shared or r < len(round_)))


@contextlib.contextmanager
def _watch(ranks: _Ranks, what: str):
    """Under several ranks, `what`, how long and the line this thread is at, on stderr after
    `_FIRST_REPORT_S` seconds of the block and at each doubling: a slow or stuck rank shows
    itself long before gloo's 30-minute timeout would end the gather (without naming it)."""
    if ranks.world == 1:
        yield
        return
    done, caller = threading.Event(), threading.get_ident()

    def report() -> None:
        start, after = time.monotonic(), _FIRST_REPORT_S
        while not done.wait(max(0.0, start + after - time.monotonic())):
            line = (f"{what} for {_duration(time.monotonic() - start)} (at "
                    f"{_line_of(caller)})\n")
            # one write of the whole line (below PIPE_BUF: atomic on a pipe), so that the
            # ranks' reports, sharing torchrun's stderr, never interleave within a line
            # (tqdm.write writes the text and its newline apart)
            with tqdm.external_write_mode(file=sys.stderr):
                sys.stderr.write(line)
                sys.stderr.flush()
            after *= 2

    watcher = threading.Thread(target=report, name="fp4lab-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _line_of(thread_id: int) -> str:
    """The innermost Python frame of a running thread: "file.py:123 in function"."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "an unknown line"
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"


def _store(opener: _Opener, cells: list[dict], done: list[dict]) -> None:
    """(rank 0) Write the finished cells, then delete their scratch folders."""
    opener.ensure()
    for result in done:
        index = result["index"]
        write_cell(opener.path, index, cells[index], result["seed"], result["tables"])
        shutil.rmtree(opener.path / SCRATCH / f"{index:05d}", ignore_errors=True)


def _run_cell(study: Study, config, cell: dict, ctx: CellContext, catch: bool) -> dict:
    """One cell's tables, each row led by the cell's index, parameters and seed. With several
    ranks a failure is returned (to be gathered) instead of raised."""
    try:
        tables = {
            name: [_merge(study, cell, ctx, row) for row in rows]
            for name, rows in study.run_cell(config, cell, ctx).items()
        }
    except Exception as err:
        if not catch:
            raise
        return {"index": ctx.index, "error": err, "trace": traceback.format_exc()}
    return {"index": ctx.index, "seed": ctx.cell_seed, "tables": tables}


def _merge(study: Study, cell: dict, ctx: CellContext, row: dict) -> dict:
    clash = [k for k in row if k in _RESERVED or (k in cell and row[k] != cell[k])]
    if clash:
        raise ValueError(f"study {study.name}: a row of cell {ctx.index} sets {clash[0]!r}, a "
                         "name the cell or the framework already uses")
    return {"cell": ctx.index, **cell, "cell_seed": ctx.cell_seed, **row}


def _portable(result: dict | None) -> dict | None:
    """What the other ranks get of a result: a failure's error stays on its rank (an
    exception may not pickle, or not unpickle: one whose __init__ wants other arguments than
    its args), its traceback's text travels."""
    if result is None or "error" not in result:
        return result
    return {key: value for key, value in result.items() if key != "error"}


def _raise_failures(results: list, mine, ranks: _Ranks) -> None:
    failed = [r for r in results if r is not None and "trace" in r]
    if not failed:
        return
    if mine is not None and "error" in mine:
        raise mine["error"]
    first = failed[0]
    raise RuntimeError(f"cell {first['index']} failed on another rank:\n{first['trace']}")


def _finish(path: Path, study: Study, config, record: dict, cells: list[dict]) -> None:
    """(rank 0) The metrics table from the stored cells, then the report and figures."""
    stored = read_cells(path)
    missing = [i for i in range(len(cells)) if i not in stored]
    if missing:
        raise RuntimeError(f"cells {missing[:5]} of {path} were not stored")
    names = list(dict.fromkeys(n for i in range(len(cells)) for n in stored[i]["tables"]))
    tables = {
        name: pd.DataFrame.from_records(
            [row for i in range(len(cells)) for row in stored[i]["tables"].get(name, [])]
        )
        for name in names
    }
    write_tables(path, tables)
    shutil.rmtree(path / SCRATCH, ignore_errors=True)  # every cell is stored
    _write_report(path, study, config, record)


def rebuild_report(out: str | Path, *, folder: str | Path | None = None) -> Path:
    """Rewrite the report and figures of results folder `out` from its stored config and
    metrics, computing nothing else; returns the report's path."""
    out = Path(out)
    if not (out / "config.json").exists():
        raise FileNotFoundError(f"out: {out} holds no config.json; not a study's results folder")
    record = read_json(out / "config.json")
    study = load_study(record["study"], folder)
    config = from_fields(study.config_type, record["config"])
    return _write_report(out, study, config, record)


def _write_report(path: Path, study: Study, config, record: dict) -> Path:
    """report.md, figures/ and the report's own tables from the stored tables (read back, as
    rebuild_report reads)."""
    results = read_tables(path)
    text, figures, derived = study.report(config, results.pop("metrics"), results)
    _write_derived(path, study, derived)
    for name, figure in figures.items():
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"study {study.name}: figure name {name!r} is not a file name")
        save_figure(figure, path / FIGURES / f"{name}.png")
    pictures = "".join(f"![{n}]({FIGURES}/{n}.png)\n\n" for n in figures)
    body = (
        f"# Study {study.name}\n\n**Question.** {study.question}\n\n{text.strip()}\n\n"
        + (f"## Figures\n\n{pictures}" if figures else "")
        + _reproduce(path, record)
    )
    report = path / "report.md"
    atomic_write(report, lambda tmp: tmp.write_text(body))
    return report


def _write_derived(path: Path, study: Study, derived: dict) -> None:
    """The tables a report derives from the metrics, as <name>.parquet and <name>.csv; a
    name that a cell's table already has is refused (it would overwrite stored results)."""
    stored = {name for cell in read_cells(path).values() for name in cell["tables"]}
    for name, frame in derived.items():
        if name in stored:
            raise ValueError(f"study {study.name}: the report's table {name!r} has the name of "
                             "a table its cells return")
        atomic_write(path / f"{name}.parquet", lambda tmp, f=frame: f.to_parquet(tmp))
        atomic_write(path / f"{name}.csv", lambda tmp, f=frame: f.to_csv(tmp, index=False))


def _reproduce(path: Path, record: dict) -> str:
    """The command that reruns the study, and the environment it ran in."""
    words = ["fp4lab study run", record["study"], "--preset", record["preset"]]
    words += [f"--set {o}" for o in record["overrides"]]
    words += ["--seed", str(record["seed"]), "--device", record["device"]]
    words += ["--backend", record["backend"]]
    env_path = path / "environment.json"
    sessions = read_json(env_path)["sessions"] if env_path.exists() else []
    lines = [f"- session {i + 1}: fp4lab {s['fp4lab']}, commit {s['git_commit']}"
             f"{' (with local changes)' if s['git_dirty'] else ''}, torch {s['torch']}, "
             f"{s['device']} ({s['device_name']}), {s['world_size']} rank(s), started "
             f"{s['started']}" for i, s in enumerate(sessions)]
    return (
        "## Reproduce\n\n```\n" + " ".join(words) + "\n```\n\n"
        + f"{record['cells']} cells; {_determinism(record['device'])}\n\n"
        + "\n".join(lines) + "\n"
    )


def _determinism(device: str) -> str:
    """What a rerun of the same command and commit is known to repeat, on `device`."""
    if device.startswith("cpu"):
        return "on the CPU the same seed gives the same numbers (tested)."
    return ("on a GPU the same seed and commit need not repeat the numbers bit for bit: CUDA "
            "kernels outside fp4lab (an embedding's backward, cuBLAS's split reductions) are "
            "nondeterministic unless the study asks torch for deterministic algorithms.")


class _Ranks:
    """The ranks of torch.distributed (gloo), or one process when there are none."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.created = False
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group("gloo")
            self.created = True
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world = 0, 1

    def gather(self, obj) -> list:
        """Every rank's `obj`, on every rank."""
        if self.world == 1:
            return [obj]
        found = [None] * self.world
        self.dist.all_gather_object(found, obj)
        return found

    def broadcast(self, obj):
        """Rank 0's `obj`, on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.created:
            self.dist.destroy_process_group()


def _on_rank0(ranks: _Ranks, work):
    """`work()` on rank 0, its result (or its error) on every rank."""
    result = error = None
    if ranks.rank == 0:
        try:
            result = work()
        except Exception as err:
            if ranks.world == 1:
                raise
            error = err
    result, error = ranks.broadcast((result, error))
    if error is not None:
        raise error
    return result
