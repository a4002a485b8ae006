"""The ``fp4lab study`` commands: list the studies, run one, rebuild a report.

`add_study_commands(subparsers)` adds ``study`` to the ``fp4lab`` parser (fp4lab.cli calls
it); each subcommand sets ``run`` to a function of the parsed arguments returning the exit
status, as the other fp4lab commands do.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from fp4lab.backends import BACKENDS
from fp4lab.studies.config import config_types, describe_type
from fp4lab.studies.discovery import list_studies
from fp4lab.studies.runner import rebuild_report, run_study
from fp4lab.studies.text import SUMMARY_HEADING, summary

__all__ = ["add_study_commands"]


def add_study_commands(subparsers) -> argparse.ArgumentParser:
    """Add ``study list``, ``study run`` and ``study report`` to an argparse subparsers
    object; returns the ``study`` parser."""
    study = subparsers.add_parser(
        "study",
        help="List, run and report the reproducible studies of quantized attention.",
        description="Each study answers one question and writes a results folder: config, "
        "environment, metrics (Parquet, CSV), figures and report.md.",
    )
    sub = study.add_subparsers(dest="study_command", required=True)

    p = sub.add_parser("list", help="the studies and their questions")
    p.add_argument(
        "--config", action="store_true",
        help="also list each study's config fields with their types and preset values",
    )
    p.set_defaults(run=cmd_list)

    p = sub.add_parser(
        "run",
        help="run a study and write its results folder",
        description="Run every cell of a study's sweep (resumable, spread over torchrun's "
        "ranks when launched under torchrun), write its results folder and print the "
        "report's summary (its 'What the numbers show' section).",
    )
    p.add_argument("name", help="the study (see `fp4lab study list`)")
    p.add_argument(
        "--preset", default="smoke",
        help="smoke: seconds on a CPU, for CI; full: the published sizes; a study may define "
        "others (`fp4lab study list --config` shows them; default smoke)",
    )
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="set a field of the study's config (repeatable; lists are comma-separated, "
        "'none' is None); `fp4lab study list --config` shows the fields",
    )
    p.add_argument(
        "--out", help="results folder (default results/<study>-<preset>-<time>)"
    )
    p.add_argument(
        "--device", default="cpu",
        help="torch device: cpu, cuda or cuda:N (default cpu; under torchrun, cuda is each "
        "rank's local GPU)",
    )
    p.add_argument(
        "--backend", choices=BACKENDS, default="reference",
        help="attention backend passed to fp4lab.attention, never replaced by another "
        "(default reference; triton runs the fused kernels on CUDA and refuses, by name, what "
        "they do not cover)",
    )
    p.add_argument(
        "--seed", type=int, default=0,
        help="the run's seed; every cell's seed derives from it and the cell (default 0)",
    )
    p.add_argument(
        "--resume", action="store_true",
        help="finish the run stored in --out, skipping the cells it finished",
    )
    p.add_argument(
        "--quiet", action="store_true",
        help="no progress bar (under several ranks, a rank whose cell or wait for the others "
        "lasts a minute still says so on stderr)",
    )
    p.add_argument(
        "--nproc", type=int, default=1,
        help="start N processes with torchrun (torch.distributed.run --standalone "
        "--nproc_per_node N) running this command: the cells spread over them, or a "
        "data-parallel study's ranks train each cell together (gloo on the CPU, NCCL on "
        "GPUs; default 1, this process alone)",
    )
    p.set_defaults(run=cmd_run)

    p = sub.add_parser(
        "report",
        help="rebuild a results folder's report and figures from its stored metrics",
        description="Rewrite report.md and figures/ from config.json and metrics.parquet, "
        "computing nothing else.",
    )
    p.add_argument("dir", help="a study's results folder")
    p.set_defaults(run=cmd_report)
    return study


def cmd_list(args: argparse.Namespace) -> int:
    for study in list_studies():
        print(f"{study.name}: {study.question}")
        if args.config:
            presets = study.module.PRESETS
            for field, kind in config_types(study.config_type).items():
                values = ", ".join(f"{p} {getattr(presets[p], field)!r}" for p in study.presets)
                print(f"    {field} ({describe_type(kind)}): {values}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    world = int(os.environ.get("WORLD_SIZE", "0"))  # set by torchrun
    if args.nproc > 1 and not world:
        return _torchrun(args)
    if world and args.nproc not in (1, world):
        raise ValueError(f"--nproc {args.nproc}: this command already runs under torchrun with "
                         f"{world} ranks; drop --nproc or make it {world}")
    out = run_study(
        args.name, args.preset, args.overrides, out=args.out, device=args.device,
        backend=args.backend, seed=args.seed, resume=args.resume, quiet=args.quiet,
    )
    rank0 = int(os.environ.get("RANK", "0")) == 0  # under torchrun rank 0 writes the report
    found = summary((out / "report.md").read_text()) if rank0 else None
    if found:
        print(f"{SUMMARY_HEADING.lstrip('# ')}:\n\n{found}\n")
    print(f"Wrote {out} (report: {out / 'report.md'})")
    return 0


def _run_words(args: argparse.Namespace) -> list[str]:
    """The ``study run`` arguments of `args`, --nproc left out."""
    words = [args.name, "--preset", args.preset]
    for override in args.overrides:
        words += ["--set", override]
    if args.out is not None:
        words += ["--out", args.out]
    words += ["--device", args.device, "--backend", args.backend, "--seed", str(args.seed)]
    return words + ["--resume"] * args.resume + ["--quiet"] * args.quiet


def _torchrun(args: argparse.Namespace) -> int:
    """Run this ``study run`` command on `args.nproc` ranks under torchrun; its exit status."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(args.nproc), "-m", "fp4lab", "study", "run",
               *_run_words(args)]
    return subprocess.run(command, check=False).returncode


def cmd_report(args: argparse.Namespace) -> int:
    print(f"Wrote {rebuild_report(args.dir)}")
    return 0

