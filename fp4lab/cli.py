"""The ``fp4lab`` command line: thin wrappers that parse strings into library objects,
call the library and print its DataFrames. Nothing here computes anything itself."""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from fp4lab.analysis.quant_error import INPUT_KINDS, error_report
from fp4lab.formats.tables import formats_frame, recipes_frame, to_markdown

DEFAULT_ERROR_SPECS = ["mxfp4", "mxfp4_rceil", "nvfp4", "nvfp4_ue5m3", "mxfp8_e4m3", "fp8_e4m3_tensor"]


def _print_frame(frame: pd.DataFrame, markdown: bool) -> None:
    if markdown:
        print(to_markdown(frame))
    else:
        with pd.option_context("display.width", 200, "display.max_columns", None):
            print(frame.to_string(index=False))


def cmd_formats(args: argparse.Namespace) -> int:
    print("Element and scale formats")
    _print_frame(formats_frame(), args.markdown)
    print("\nBlock-scaling recipes")
    _print_frame(recipes_frame(), args.markdown)
    return 0


def cmd_error(args: argparse.Namespace) -> int:
    frame = error_report(
        args.spec or DEFAULT_ERROR_SPECS, rows=args.rows, cols=args.cols, seed=args.seed, axis=args.axis
    )
    print(f"Quantization error on standard inputs (seed {args.seed}, {args.rows}x{args.cols}):")
    for name, text in INPUT_KINDS.items():
        print(f"  {name}: {text}")
    _print_frame(frame, args.markdown)
    if args.csv:
        frame.to_csv(args.csv, index=False)
    return 0


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError) as err:
        print(f"fp4lab {args.command}: error: {err}", file=sys.stderr)
        return 2
