"""The ``fp4lab`` command line: thin wrappers that parse strings into library objects,
call the library and print its DataFrames. Nothing here computes anything itself."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import json
import platform
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch

import fp4lab
from fp4lab.analysis.compare import compare, saturation
from fp4lab.analysis.inputs import SyntheticConfig, load_inputs, synthetic_inputs
from fp4lab.analysis.quant_error import INPUT_KINDS, error_report
from fp4lab.formats.tables import formats_frame, recipes_frame, to_markdown
from fp4lab.recipes import STATISTICS, AttentionRecipe, resolve_recipe

DEFAULT_ERROR_SPECS = [
    "mxfp4",
    "mxfp4_rceil",
    "nvfp4",
    "nvfp4_ue5m3",
    "mxfp8_e4m3",
    "fp8_e4m3_tensor",
]
DEFAULT_ATTENTION_RECIPES = ["fa4fp4_causal", "fa4fp4_causal_mxfp4pv"]
_SIZE_OPTIONS = {
    "seq": 512,
    "heads": 2,
    "head_dim": 64,
    "batch": 1,
}  # defaults of the synthetic input


def _print_frame(frame: pd.DataFrame, markdown: bool, digits: int | None = None) -> None:
    if markdown:
        print(to_markdown(frame))
    else:
        floats = (lambda x: f"{x:.{digits}g}") if digits else None
        with pd.option_context("display.width", 200, "display.max_columns", None):
            print(frame.to_string(index=False, float_format=floats))


def cmd_formats(args: argparse.Namespace) -> int:
    print("Element and scale formats")
    _print_frame(formats_frame(), args.markdown)
    print("\nBlock-scaling recipes")
    _print_frame(recipes_frame(), args.markdown)
    return 0


def cmd_error(args: argparse.Namespace) -> int:
    frame = error_report(
        args.spec or DEFAULT_ERROR_SPECS,
        rows=args.rows,
        cols=args.cols,
        seed=args.seed,
        axis=args.axis,
    )
    print(f"Quantization error on standard inputs (seed {args.seed}, {args.rows}x{args.cols}):")
    for name, text in INPUT_KINDS.items():
        print(f"  {name}: {text}")
    _print_frame(frame, args.markdown)
    if args.csv:
        frame.to_csv(args.csv, index=False)
    return 0


def cmd_attention(args: argparse.Namespace) -> int:
    recipes = [resolve_recipe(name) for name in args.recipe or DEFAULT_ATTENTION_RECIPES]
    inputs = _attention_inputs(args)
    print(
        "Attention errors against exact float64 attention "
        f"({'causal' if args.causal else 'non-causal'}, "
        f"seed {args.seed}, tiles {_tiles(args)})"
    )
    print(f"  inputs: {_describe_inputs(inputs)}")
    runs = [
        compare(
            inputs.q,
            inputs.k,
            inputs.v,
            inputs.do,
            recipe,
            causal=args.causal,
            generator=args.seed,
            block_m=args.block_m,
            block_n=args.block_n,
        )
        for recipe in recipes
    ]
    errors = pd.concat([run.errors for run in runs], ignore_index=True)
    traces = pd.concat([run.trace.to_frame() for run in runs], ignore_index=True)
    if args.heatmap not in STATISTICS:
        raise ValueError(
            f"--heatmap: {args.heatmap!r} is not a trace statistic; one of {', '.join(STATISTICS)}"
        )
    figures = saturation(traces)
    _print_frame(errors, args.markdown, digits=4)
    print(
        "\nSaturation per operand (means over tiles; p_mass_lost: probability mass flushed per "
        "query row)"
    )
    _print_frame(figures, args.markdown, digits=3)
    out = _results_dir(args.out)
    _write_results(out, args, inputs, recipes, runs, errors, figures, traces)
    print(
        "\nWrote errors.csv, saturation.csv, trace.parquet, heatmap-<recipe>.png and config.json "
        f"to {out}"
    )
    return 0


def _tiles(args: argparse.Namespace) -> str:
    if args.block_m is None and args.block_n is None:
        return "each recipe's own"
    return f"{args.block_m or 'recipe'}x{args.block_n or 'recipe'}"


def _attention_inputs(args: argparse.Namespace):
    """The synthetic default input, or the file's tensors (dO drawn from the seed if absent)."""
    given = [name for name in _SIZE_OPTIONS if getattr(args, name) is not None]
    if args.inputs is None:
        sizes = {
            name: default if getattr(args, name) is None else getattr(args, name)
            for name, default in _SIZE_OPTIONS.items()
        }
        return synthetic_inputs(SyntheticConfig(seed=args.seed, **sizes))
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag}: sizes come from the --inputs file; drop {flag} or --inputs")
    return load_inputs(args.inputs).with_do(args.seed)


def _describe_inputs(inputs) -> str:
    shape = "x".join(map(str, inputs.q.shape))
    if inputs.source == "synthetic":
        return (
            f"synthetic heavy-tailed activations, q {shape} (B x H x S x D); see "
            "fp4lab.analysis.inputs"
        )
    return f"{inputs.source}, q {shape}, sha256 {inputs.record['sha256'][:12]}"


def _results_dir(out: str | None) -> Path:
    """--out, or results/attention-<local time> (with a suffix if that exists already)."""
    if out is not None:
        path = Path(out)
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = base = Path("results") / f"attention-{stamp}"
        n = 1
        while path.exists():
            n += 1
            path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_results(out: Path, args, inputs, recipes, runs, errors, figures, traces) -> None:
    """Tables, the traces (Parquet), one heatmap per recipe and the config that reruns it."""
    from fp4lab.analysis.plots import product_heatmaps  # seaborn loads only when plotting

    errors.to_csv(out / "errors.csv", index=False)
    figures.to_csv(out / "saturation.csv", index=False)
    traces.to_parquet(out / "trace.parquet", index=False)
    for run in runs:
        fig = product_heatmaps(run.trace, args.heatmap)
        fig.savefig(out / f"heatmap-{run.recipe}.png", dpi=100)
    config = {
        "command": ["fp4lab", *args.argv],
        "arguments": {k: v for k, v in vars(args).items() if k not in ("run", "argv")},
        "seed": args.seed,
        "inputs": inputs.record,
        "recipes": {r.name: _recipe_record(r) for r in recipes},
        "environment": _environment(),
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")


def _recipe_record(recipe: AttentionRecipe) -> dict:
    """A recipe's fields, formats by their registry names and enums by their values."""

    def plain(value):
        if isinstance(value, enum.Enum):
            return value.value
        return getattr(value, "name", value)

    return {
        f.name: plain(getattr(recipe, f.name))
        for f in dataclasses.fields(recipe)
        if f.name != "doc"
    }


def _environment() -> dict:
    """Versions, threads and the git commit of this checkout (None outside a git checkout)."""
    import matplotlib
    import numpy
    import seaborn

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=Path(fp4lab.__file__).parent,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "fp4lab": fp4lab.__version__,
        "git_commit": commit,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": numpy.__version__,
        "pandas": pd.__version__,
        "matplotlib": matplotlib.__version__,
        "seaborn": seaborn.__version__,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp4lab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("formats", help="table of every registered format and recipe")
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.set_defaults(run=cmd_formats)

    p = sub.add_parser("error", help="quantization error of recipes on standard inputs")
    p.add_argument("--spec", action="append", help="a registered recipe (repeatable)")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--axis", type=int, default=-1, help="axis the blocks run along")
    p.add_argument("--csv", help="also write the table to this CSV file")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.set_defaults(run=cmd_error)

    p = sub.add_parser(
        "attention",
        help="errors of attention recipes against exact float64 attention, with per-tile traces",
        description="Run each recipe's forward and backward and exact float64 attention on one "
        "input; "
        "print the errors of O, dQ, dK, dV and the saturation figures; write the results folder.",
    )
    p.add_argument(
        "--recipe",
        action="append",
        help="a registered attention recipe (repeatable; default "
        f"{' and '.join(DEFAULT_ATTENTION_RECIPES)})",
    )
    p.add_argument("--causal", action="store_true", help="causal mask (aligned top-left, as SDPA)")
    p.add_argument(
        "--seq",
        type=int,
        help=f"sequence length of the synthetic input (default {_SIZE_OPTIONS['seq']})",
    )
    p.add_argument(
        "--heads", type=int, help=f"heads of the synthetic input (default {_SIZE_OPTIONS['heads']})"
    )
    p.add_argument(
        "--head-dim",
        type=int,
        help=f"head dimension of the synthetic input (default {_SIZE_OPTIONS['head_dim']})",
    )
    p.add_argument(
        "--batch", type=int, help=f"batch of the synthetic input (default {_SIZE_OPTIONS['batch']})"
    )
    p.add_argument(
        "--inputs", help="a .npz or .safetensors file with arrays q, k, v (and optionally do)"
    )
    p.add_argument("--out", help="results folder (default results/attention-<time>)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the synthetic input, of dO if the file has none, and of stochastic rounding",
    )
    p.add_argument("--block-m", type=int, help="query tile (default: the recipe's, else 128)")
    p.add_argument("--block-n", type=int, help="key tile (default: the recipe's, else 128)")
    p.add_argument(
        "--heatmap", default="prod_err", help="trace column the per-recipe heatmaps show"
    )
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.set_defaults(run=cmd_attention)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"fp4lab {args.command}: error: {err}", file=sys.stderr)
        return 2
