"""The ``fp4lab`` command line: thin wrappers that parse strings into library objects, call
the library and print its DataFrames.

Vocabulary, as in DESIGN.md: a number format is a `FloatFormat`, a block format a
`QuantSpec`, an attention recipe an `AttentionRecipe`. Every name is resolved and every
argument checked before anything is computed; an unknown name lists the registered names of
its kind, closest first. ``--import MODULE_OR_FILE`` (on every command) imports a module or
a ``.py`` file first, so that the formats and recipes it registers are found by name.

`fp4lab attention` writes a results folder whose ``config.json`` holds every setting of the
run (`AttentionRun`) with each recipe and each of its formats by their full fields
(`fp4lab.config`); ``fp4lab attention --config PATH`` reruns it from that file alone, in a
process that imported nothing, to the same bits. The library prints nothing: what is printed
is printed here, tables on stdout, warnings and the progress bar on stderr; output to a
closed pipe ends quietly.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

import fp4lab
from fp4lab.analysis.checks import check_tiling
from fp4lab.analysis.compare import (
    TENSORS,
    error_metrics,
    exact_reference,
    forward_backward,
    saturation,
)
from fp4lab.analysis.inputs import AttentionInputs, SyntheticConfig, load_inputs, synthetic_inputs
from fp4lab.analysis.quant_error import INPUT_KINDS, error_report
from fp4lab.config import ConfigError, from_fields, suggestions, to_fields
from fp4lab.formats import FloatFormat, QuantSpec, get, names
from fp4lab.formats.tables import formats_frame, to_markdown
from fp4lab.formats.tables import recipes_frame as block_formats_frame
from fp4lab.recipes import (
    STATISTICS,
    AttentionRecipe,
    BackwardMode,
    Product,
    Trace,
    column,
    resolve_recipe,
)
from fp4lab.recipes.tables import recipes_frame, summary

DEFAULT_ERROR_FORMATS = [
    "mxfp4",
    "mxfp4_rceil",
    "nvfp4",
    "nvfp4_ue5m3",
    "mxfp8_e4m3",
    "fp8_e4m3_tensor",
]
DEFAULT_ATTENTION_RECIPES = ["fa4fp4_causal", "fa4fp4_causal_mxfp4pv"]
# the synthetic input's size options: option dest -> (SyntheticConfig field, what it is)
_SIZE_OPTIONS = {
    "seq": ("seq", "sequence length"),
    "heads": ("heads", "query and key/value heads"),
    "head_dim": ("head_dim", "head dimension"),
    "batch_size": ("batch", "batch size"),
}
KINDS = {
    FloatFormat: "number format",
    QuantSpec: "block format",
    AttentionRecipe: "attention recipe",
}
# the statistics a heatmap over (query tile, key tile) can show
HEATMAP_COLUMNS = tuple(c for c in STATISTICS if column(c).kind in ("operand", "product"))
REDUCTIONS = ("mean", "max")  # fp4lab.analysis.plots.REDUCTIONS, without loading seaborn


# -- names, output, --import --------------------------------------------------------------------
def lookup(option: str, name: str, kinds: tuple[type, ...]):
    """The registered object `name` of one of `kinds`; otherwise a ValueError naming
    `option` that lists the registered names of those kinds, closest first."""
    candidates = names(kinds)
    if name in candidates:
        return get(name)
    what = [KINDS[k] for k in kinds]
    what = ", ".join(what[:-1]) + " or " + what[-1] if len(what) > 1 else what[0]
    other = f" (it names {_a(_kind_of(get(name)))})" if name in names() else ""
    raise ValueError(
        f"{option}: unknown {what} {name!r}{other}; registered, closest first: "
        f"{suggestions(name, candidates)} (names your own code registers need --import)"
    )


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _kind_of(obj) -> str:
    return next((text for kind, text in KINDS.items() if isinstance(obj, kind)), "object")


def _recipe(name: str, option: str) -> AttentionRecipe:
    """An attention recipe by name; a number or block format's name means it everywhere."""
    return resolve_recipe(lookup(option, name, (AttentionRecipe, QuantSpec, FloatFormat)).name)


def _say(text: str = "") -> None:
    """Print a line on stdout; once its reader has closed the pipe, print nothing more."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere
        os.close(devnull)


def _warn(command: str, text: str) -> None:
    print(f"fp4lab {command}: warning: {text}", file=sys.stderr, flush=True)


def _print_frame(frame: pd.DataFrame, markdown: bool, digits: int | None = None) -> None:
    if markdown:
        _say(to_markdown(frame))
        return
    floats = (lambda x: f"{x:.{digits}g}") if digits else None
    with pd.option_context("display.width", 200, "display.max_columns", None):
        _say(frame.to_string(index=False, float_format=floats))


def import_all(values: list[str]) -> None:
    """Import each ``--import`` value: a ``.py`` file by its path, else a module by its
    dotted name (found from the current directory too, as ``python -m`` finds it)."""
    for value in values:
        try:
            _import_one(value)
        except Exception as err:  # the user's code: whatever it raises is reported by name
            frames = traceback.extract_tb(err.__traceback__)
            at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
            raise ValueError(f"--import {value}: {type(err).__name__}: {err}{at}") from err


def _import_one(value: str) -> None:
    path = Path(value)
    if value.endswith(".py") or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"no such file {value!r}")
        name = "fp4lab_import_" + re.sub(r"\W", "_", path.stem)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up by name
        with _on_path(str(path.resolve().parent)):
            spec.loader.exec_module(module)
        return
    with _on_path(os.getcwd()):
        importlib.import_module(value)


class _on_path:
    """Put a folder first on sys.path for the duration of an import."""

    def __init__(self, folder: str) -> None:
        self.folder, self.added = folder, folder not in sys.path

    def __enter__(self) -> None:
        if self.added:
            sys.path.insert(0, self.folder)

    def __exit__(self, *exc) -> None:
        if self.added and self.folder in sys.path:
            sys.path.remove(self.folder)


# -- fp4lab formats, fp4lab recipes, fp4lab error -----------------------------------------------
def cmd_formats(args: argparse.Namespace) -> int:
    _say("Number formats (FloatFormat)")
    _print_frame(formats_frame(), args.markdown)
    _say("\nBlock formats (QuantSpec); rounding: how the elements are rounded")
    _print_frame(block_formats_frame(), args.markdown)
    _say(
        "\nAttention recipes (AttentionRecipe): `fp4lab recipes` lists them, "
        "`fp4lab recipes NAME` prints one in full."
    )
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    if args.name is None:
        if args.json:
            raise ValueError("--json: prints one recipe; give its NAME")
        _say(
            "Attention recipes (AttentionRecipe); per product, the formats of its operands "
            "a / b ('-': unquantized). `fp4lab recipes NAME` prints one in full."
        )
        _print_frame(recipes_frame(), args.markdown)
        return 0
    recipe = _recipe(args.name, "NAME")
    if args.json:
        _say(json.dumps(to_fields(recipe), indent=2))
        return 0
    mask = {True: "causal", False: "non-causal", None: "either"}[recipe.causal]
    _say(f"{recipe.name} (attention recipe), made for {mask} attention")
    _say(f"source: {recipe.source or '-'}\n")
    _say(f"{recipe.doc.strip() or summary(recipe) or 'no description'}\n")
    _say("Fields (operands: number or block format, '-' unquantized; --json gives every field)")
    _print_frame(_fields_frame(recipe), args.markdown)
    return 0


def _fields_frame(recipe: AttentionRecipe) -> pd.DataFrame:
    rows = []
    for f in dataclasses.fields(recipe):
        value = getattr(recipe, f.name)
        if f.name in ("name", "doc", "source"):
            continue
        if isinstance(value, (QuantSpec, FloatFormat)):
            text = f"{value.name} ({_kind_of(value)})"
        else:
            text = "-" if value is None else getattr(value, "value", value)
        rows.append({"field": f.name, "value": str(text)})
    return pd.DataFrame(rows)


def cmd_error(args: argparse.Namespace) -> int:
    specs = [lookup("--format", n, (QuantSpec,)) for n in args.formats or DEFAULT_ERROR_FORMATS]
    if args.axis not in (-2, -1, 0, 1):
        raise ValueError(f"--axis: the standard inputs are 2-D; -2, -1, 0 or 1, got {args.axis}")
    if args.csv and not Path(args.csv).resolve().parent.is_dir():
        raise FileNotFoundError(f"--csv: the folder of {args.csv!r} does not exist")
    frame = error_report(specs, rows=args.rows, cols=args.cols, seed=args.seed, axis=args.axis)
    frame = frame.rename(columns={"recipe": "format"})
    _say(
        f"Quantization error of block formats on standard inputs "
        f"(seed {args.seed}, {args.rows}x{args.cols}):"
    )
    for name, text in INPUT_KINDS.items():
        _say(f"  {name}: {text}")
    _print_frame(frame, args.markdown)
    if args.csv:
        frame.to_csv(args.csv, index=False)
    return 0


# -- fp4lab attention: the run ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class AttentionRun:
    """Every setting of one `fp4lab attention` run that decides its numbers and figures.

    ``config.json`` records it by its fields (`fp4lab.config`), each recipe and each of its
    formats by their full fields, so that ``--config`` reruns the run from that file alone.
    """

    recipes: tuple[AttentionRecipe, ...]
    causal: bool = False
    seed: int = 0  # of the synthetic input, of dO for a file without one, of rounding
    synthetic: SyntheticConfig | None = None  # the synthetic input's model; None: a file
    inputs: str | None = None  # the .npz or .safetensors file, as an absolute path
    inputs_sha256: str | None = None  # its hash, checked on a rerun
    block_m: int | None = None  # query tile; None: each recipe's own (else 128)
    block_n: int | None = None  # key tile; likewise
    heatmap: str = "prod_err"  # the trace column the heatmaps show
    head: int = 0  # the query head drawn
    batch: int = 0  # the batch element drawn
    reduce: str | None = None  # "mean" or "max" over heads and batch instead of one

    def __post_init__(self) -> None:
        given = [r.name for r in self.recipes]
        if not given:
            raise ValueError("recipes: a run needs at least one attention recipe")
        twice = next((n for n in given if given.count(n) > 1), None)
        if twice is not None:
            raise ValueError(f"--recipe: {twice!r} is given twice; each recipe runs once")
        for name in given:
            if not re.fullmatch(r"[\w.+-]+", name):
                raise ValueError(
                    f"--recipe: {name!r} cannot name a file (heatmap-<name>.png); a recipe "
                    "name for the command line holds letters, digits and _ . + - only"
                )
        if (self.synthetic is None) == (self.inputs is None):
            raise ValueError("inputs: a run has a synthetic input or an --inputs file, one")
        if self.heatmap not in HEATMAP_COLUMNS:
            raise ValueError(
                f"--heatmap: {self.heatmap!r} is not a per-tile statistic of the trace; "
                f"closest first: {suggestions(self.heatmap, HEATMAP_COLUMNS)}"
            )
        if self.reduce not in (None, *REDUCTIONS):
            raise ValueError(f"--reduce: mean or max, got {self.reduce!r}")
        for name in ("seed", "head", "batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name}: must be >= 0, got {getattr(self, name)}")


# options that decide a run's numbers (dest -> flag): a rerun from --config takes them from it
_NUMBERS_OPTIONS = {
    "recipe": "--recipe",
    "causal": "--causal",
    "seed": "--seed",
    "inputs": "--inputs",
    "block_m": "--block-m",
    "block_n": "--block-n",
    **{dest: "--" + dest.replace("_", "-") for dest in _SIZE_OPTIONS},
}
_FIGURE_OPTIONS = ("heatmap", "head", "batch", "reduce")  # may be given with --config too
CONFIG_KEYS = ("command", "imports", "run", "inputs", "environment", "created")


def _run_from_args(args: argparse.Namespace) -> AttentionRun:
    recipes = tuple(_recipe(n, "--recipe") for n in args.recipe or DEFAULT_ATTENTION_RECIPES)
    sizes = {d: getattr(args, d) for d in _SIZE_OPTIONS if getattr(args, d) is not None}
    seed = 0 if args.seed is None else args.seed
    if args.inputs is not None and sizes:
        flag = _NUMBERS_OPTIONS[next(iter(sizes))]
        raise ValueError(f"{flag}: sizes come from the --inputs file; drop {flag} or --inputs")
    synthetic = None
    if args.inputs is None:
        fields = {_SIZE_OPTIONS[dest][0]: value for dest, value in sizes.items()}
        synthetic = SyntheticConfig(seed=seed, **fields)
    return AttentionRun(
        recipes=recipes,
        causal=bool(args.causal),
        seed=seed,
        synthetic=synthetic,
        inputs=None if args.inputs is None else str(Path(args.inputs).resolve()),
        block_m=args.block_m,
        block_n=args.block_n,
        **_figure_options(args),
    )


def _figure_options(args: argparse.Namespace) -> dict:
    """The figure options given; --head or --batch alone ends a recorded --reduce."""
    given = {k: getattr(args, k) for k in _FIGURE_OPTIONS if getattr(args, k) is not None}
    picked = [k for k in ("head", "batch") if k in given]
    if picked and "reduce" in given:
        raise ValueError(
            f"--{picked[0]}: --reduce summarises every head and batch element; drop one of them"
        )
    return {"reduce": None, **given} if picked else given


def _run_from_config(args: argparse.Namespace) -> AttentionRun:
    given = [flag for dest, flag in _NUMBERS_OPTIONS.items() if getattr(args, dest) is not None]
    if given:
        raise ValueError(
            f"{given[0]}: a rerun takes its settings from --config; drop {given[0]} (with "
            "--config only --out, --quiet, --markdown, --import and the figure options "
            "--heatmap, --head, --batch, --reduce are read)"
        )
    run = read_config(args.config)
    return dataclasses.replace(run, **_figure_options(args))


def read_config(path: str | Path) -> AttentionRun:
    """The `AttentionRun` of a results folder's config.json, parsed field by field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config: no such file {str(path)!r}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"--config: {str(path)!r} is not a JSON file: {err}") from None
    if not isinstance(data, dict) or "run" not in data:
        raise ValueError(f"--config: {str(path)!r} holds no 'run' (fp4lab attention writes one)")
    for key in data:
        if key not in CONFIG_KEYS:
            raise ValueError(
                f"--config: {str(path)!r} has an unknown entry {key!r}; its entries, closest "
                f"first: {suggestions(key, CONFIG_KEYS)}"
            )
    try:
        return from_fields(AttentionRun, data["run"], where="run")
    except ConfigError as err:
        raise ValueError(f"--config {path}: {err}") from None


def _load(run: AttentionRun) -> tuple[AttentionRun, AttentionInputs]:
    """The run's inputs, and the run with the file's hash (a rerun's must match it)."""
    if run.synthetic is not None:
        return run, synthetic_inputs(run.synthetic)
    inputs = load_inputs(run.inputs).with_do(run.seed)
    sha = inputs.record["sha256"]
    if run.inputs_sha256 not in (None, sha):
        raise ValueError(
            f"--config: the inputs file {run.inputs!r} changed since the run (sha256 "
            f"{sha[:12]}, recorded {run.inputs_sha256[:12]})"
        )
    return dataclasses.replace(run, inputs_sha256=sha), inputs


def _check(run: AttentionRun, inputs: AttentionInputs, out: str | None) -> None:
    """What can fail after the compute, checked before it: the slice drawn, every recipe's
    tiles on these shapes, the results folder, and that config.json will rerun the run."""
    b, h, _, d = inputs.q.shape
    for name, index, size in (("batch", run.batch, b), ("head", run.head, h)):
        if run.reduce is None and index >= size:
            raise ValueError(f"--{name}: {index} is not in the input, which has {size} (from 0)")
    for recipe in run.recipes:
        check_tiling(recipe, d, inputs.v.shape[-1], *recipe.tiles(run.block_m, run.block_n))
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out: {out!r} is a file, not a folder")
    try:
        again = from_fields(AttentionRun, json.loads(json.dumps(to_fields(run))))
    except (ConfigError, TypeError) as err:
        raise ValueError(f"--recipe: config.json cannot record this run: {err}") from None
    if again != run:
        raise ValueError("--recipe: config.json cannot record a recipe of this run exactly")


def _mask_warnings(run: AttentionRun) -> list[str]:
    """One line per recipe made for the other mask than the run's."""
    mask = {True: "causal", False: "non-causal"}
    return [
        f"recipe {r.name!r} was made for {mask[r.causal]} attention; this run is "
        f"{mask[run.causal]} ({'add' if r.causal else 'drop'} --causal to match)"
        for r in run.recipes
        if r.causal is not None and r.causal != run.causal
    ]


# -- fp4lab attention: compute and report -------------------------------------------------------
@dataclass
class RecipeRun:
    """One recipe's outputs (O, dQ, dK, dV), exact float64 attention's, and its trace."""

    recipe: AttentionRecipe
    outputs: tuple[torch.Tensor, ...]
    reference: tuple[torch.Tensor, ...]
    trace: pd.DataFrame


def _compute(run: AttentionRun, inputs: AttentionInputs, quiet: bool) -> list[RecipeRun]:
    """Each recipe's forward and backward, and exact float64 attention once per tiling (what
    `compare` computes, its reference shared), under a progress bar of the passes."""
    x = inputs
    tilings = {r.tiles(run.block_m, run.block_n) for r in run.recipes}
    refs, runs = {}, []
    total = len(run.recipes) + len(tilings)
    with tqdm(total=total, unit="pass", disable=quiet, leave=False, file=sys.stderr) as bar:
        for recipe in run.recipes:
            tiles = recipe.tiles(run.block_m, run.block_n)
            options = dict(causal=run.causal, block_m=tiles[0], block_n=tiles[1])
            bar.set_description(f"{recipe.name}: forward and backward")
            trace = Trace()
            got = forward_backward(
                x.q, x.k, x.v, x.do, recipe, trace=trace, generator=run.seed, **options
            )
            bar.update()
            if tiles not in refs:
                bar.set_description(f"exact float64 attention, {tiles[0]}x{tiles[1]} tiles")
                refs[tiles] = exact_reference(x.q, x.k, x.v, x.do, **options)
                bar.update()
            runs.append(RecipeRun(recipe, got, refs[tiles], trace.to_frame()))
    return runs


def _errors(runs: list[RecipeRun]) -> pd.DataFrame:
    """`compare`'s error table of every recipe, with a note where a result is degenerate."""
    rows = []
    for r in runs:
        notes = _notes(r)
        for name, got, ref in zip(TENSORS, r.outputs, r.reference, strict=True):
            rows.append(
                {
                    "recipe": r.recipe.name,
                    "tensor": name,
                    **error_metrics(got, ref),
                    "note": notes.get(name, ""),
                }
            )
    return pd.DataFrame(rows)


_FORWARD_FIELDS = tuple(f for p in Product if not p.backward for f in p.fields)
_BACKWARD_FIELDS = tuple(f for p in Product if p.backward for f in p.fields)
# the operands (product, side) each gradient is built from
_FEEDS = {
    "dv": ((Product.DV, 0), (Product.DV, 1)),
    "dq": ((Product.DP, 0), (Product.DQ, 0), (Product.DQ, 1)),
    "dk": ((Product.DP, 0), (Product.DK, 0), (Product.DK, 1)),
}


def _notes(r: RecipeRun) -> dict[str, str]:
    """Why a gradient is what it is, where that is not the recipe's rounding: a backward
    that quantizes nothing after a quantized forward, gradients that are all zero."""
    recipe, kind = r.recipe, ""
    if recipe.backward is BackwardMode.FORWARD_EXACT:
        kind = "exact gradient of the quantized forward"
    elif (
        recipe.backward is BackwardMode.FLASH
        and all(getattr(recipe, f) is None for f in _BACKWARD_FIELDS)
        and any(getattr(recipe, f) is not None for f in _FORWARD_FIELDS)
    ):
        kind = "high-precision backward against a quantized forward"
    notes = {}
    for name, grad in zip(TENSORS[1:], r.outputs[1:], strict=True):
        zero = grad.numel() > 0 and not torch.count_nonzero(grad)
        notes[name] = "; ".join(t for t in (kind, _zero_reason(r, name) if zero else "") if t)
    return notes


def _zero_reason(r: RecipeRun, tensor: str) -> str:
    """ "all zero", with the operands feeding `tensor` that quantization flushed entirely."""
    flushed = []
    for product, side in _FEEDS[tensor]:
        rows = r.trace[r.trace["product"] == product.value]
        fractions = rows[f"{'ab'[side]}_flushed"].dropna()
        if len(fractions) and (fractions == 1).all():
            field = product.fields[side]
            operand = product.operand_names[side]
            flushed.append(f"{operand} in {product.value} ({field}: {getattr(r.recipe, field)})")
    return "all zero" + (f": flushed entirely, {', '.join(flushed)}" if flushed else "")


def cmd_attention(args: argparse.Namespace) -> int:
    run = _run_from_config(args) if args.config else _run_from_args(args)
    run, inputs = _load(run)
    _check(run, inputs, args.out)
    for text in _mask_warnings(run):
        _warn("attention", text)
    runs = _compute(run, inputs, args.quiet)
    errors = _errors(runs)
    traces = pd.concat([r.trace for r in runs], ignore_index=True)
    figures = saturation(traces)
    _print_attention(run, inputs, errors, figures, args.markdown)
    out = _results_dir(args.out)
    _write_results(out, args, run, inputs, runs, errors, figures, traces)
    _say(
        "\nWrote errors.csv, saturation.csv, trace.parquet, heatmap-<recipe>.png, heatmaps.png "
        f"and config.json to {out}"
    )
    return 0


def _print_attention(run, inputs, errors, figures, markdown: bool) -> None:
    mask = "causal" if run.causal else "non-causal"
    tiles = "each recipe's own"
    if run.block_m is not None or run.block_n is not None:
        tiles = f"{run.block_m or 'recipe'}x{run.block_n or 'recipe'}"
    _say(
        f"Attention errors against exact float64 attention ({mask}, seed {run.seed}, tiles {tiles})"
    )
    _say(f"  inputs: {_describe_inputs(inputs)}")
    shown = errors if errors["note"].any() else errors.drop(columns="note")
    _print_frame(shown, markdown, digits=4)
    _say(
        "\nSaturation per operand (means over tiles; p_mass_lost: probability mass flushed per "
        "query row)"
    )
    _print_frame(figures, markdown, digits=3)


def _describe_inputs(inputs: AttentionInputs) -> str:
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


def _write_results(out: Path, args, run, inputs, runs, errors, figures, traces) -> None:
    """Tables, the traces (Parquet), the heatmaps and the config that reruns the run."""
    errors.to_csv(out / "errors.csv", index=False)
    figures.to_csv(out / "saturation.csv", index=False)
    traces.to_parquet(out / "trace.parquet", index=False)
    _heatmaps(out, run, {r.recipe.name: r.trace for r in runs})
    config = {
        "command": ["fp4lab", *args.argv],
        "imports": getattr(args, "imports", []),
        "run": to_fields(run),
        "inputs": inputs.record,
        "environment": _environment(),
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _heatmaps(out: Path, run: AttentionRun, traces: dict[str, pd.DataFrame]) -> None:
    """heatmap-<recipe>.png per recipe and heatmaps.png (the recipes side by side per
    product), all on one colour scale; only the products where the column has values."""
    from fp4lab.analysis import plots  # seaborn loads only when plotting

    products = [
        p
        for p in plots.PRODUCTS
        if any(
            frame.loc[frame["product"] == p, run.heatmap].notna().any() for frame in traces.values()
        )
    ]
    if not products:
        return
    short = column(run.heatmap).short
    log = not short.startswith(("fraction", "NaN"))  # errors span decades, fractions do not
    options = dict(products=products, batch=run.batch, head=run.head, reduce=run.reduce, log=log)
    norm = plots.shared_norm(traces, run.heatmap, **options)
    for name, frame in traces.items():
        fig = plots.product_heatmaps(frame, run.heatmap, norm=norm, **options)
        fig.savefig(out / f"heatmap-{name}.png", dpi=100)
    fig = plots.comparison_heatmaps(traces, run.heatmap, norm=norm, **options)
    fig.savefig(out / "heatmaps.png", dpi=100)


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


# -- the parser ---------------------------------------------------------------------------------
def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _natural(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


class CommandParser(argparse.ArgumentParser):
    """A parser whose every command takes ``--import`` (argparse builds subcommands' parsers
    with the class of their parent, so the studies' commands take it too)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--import",
            dest="imports",
            action="append",
            default=argparse.SUPPRESS,
            metavar="MODULE_OR_FILE",
            help="import this module or .py file first, so that the number formats, block "
            "formats and attention recipes it registers are found by name (repeatable)",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="fp4lab",
        description="fp4lab, a numerics lab for low-precision attention. Each command is "
        "described below; `fp4lab COMMAND --help` lists its options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_formats(sub)
    _add_recipes(sub)
    _add_error(sub)
    _add_attention(sub)
    from fp4lab.studies.cli import add_study_commands  # here: `fp4lab formats` loads no study

    add_study_commands(sub)
    return parser


def _add_formats(sub) -> None:
    text = "Print every registered number format and block format as tables."
    p = sub.add_parser("formats", help=text, description=text)
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.set_defaults(run=cmd_formats)


def _add_recipes(sub) -> None:
    text = (
        "List every registered attention recipe with its summary, source, mask and the formats "
        "of each product's operands, or print one recipe in full."
    )
    p = sub.add_parser("recipes", help=text, description=text)
    p.add_argument("name", nargs="?", metavar="NAME", help="the attention recipe to print in full")
    p.add_argument(
        "--json",
        action="store_true",
        help="print NAME's every field as JSON, formats by their fields, as config.json records it",
    )
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.set_defaults(run=cmd_recipes)


def _add_error(sub) -> None:
    text = "Measure the quantization error of block formats on standard random inputs."
    p = sub.add_parser("error", help=text, description=text)
    p.add_argument(
        "--format",
        "--spec",
        dest="formats",
        action="append",
        metavar="NAME",
        help=f"a registered block format (repeatable; default {', '.join(DEFAULT_ERROR_FORMATS)})",
    )
    p.add_argument("--rows", type=_positive, default=256, help="rows of each input (default 256)")
    p.add_argument(
        "--cols", type=_positive, default=4096, help="columns of each input (default 4096)"
    )
    p.add_argument("--seed", type=_natural, default=0, help="seed of the inputs (default 0)")
    p.add_argument("--axis", type=int, default=-1, help="axis the blocks run along (default -1)")
    p.add_argument("--csv", help="also write the table to this CSV file")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.set_defaults(run=cmd_error)


def _add_attention(sub) -> None:
    text = (
        "Run attention recipes forward and backward next to exact float64 attention, print "
        "their errors and saturation figures, and write a results folder that reruns them."
    )
    p = sub.add_parser("attention", help=text, description=text)
    p.add_argument(
        "--recipe",
        action="append",
        metavar="NAME",
        help="a registered attention recipe, or a number or block format on every operand "
        f"(repeatable; default {' and '.join(DEFAULT_ATTENTION_RECIPES)})",
    )
    p.add_argument(
        "--config",
        metavar="PATH",
        help="rerun the run a results folder's config.json records, from that file alone",
    )
    p.add_argument(
        "--causal",
        action="store_true",
        default=None,
        help="causal mask (aligned top-left, as SDPA's is_causal)",
    )
    defaults = SyntheticConfig()
    for dest, (field, what) in _SIZE_OPTIONS.items():
        p.add_argument(
            "--" + dest.replace("_", "-"),
            type=_positive,
            help=f"{what} of the synthetic input (default {getattr(defaults, field)})",
        )
    p.add_argument(
        "--inputs",
        metavar="FILE",
        help="a .npz or .safetensors file with arrays q, k, v (and optionally do)",
    )
    p.add_argument(
        "--seed",
        type=_natural,
        help="seed of the synthetic input, of dO if the "
        "file has none, and of stochastic rounding (default 0)",
    )
    p.add_argument("--block-m", type=_positive, help="query tile (default: the recipe's, else 128)")
    p.add_argument("--block-n", type=_positive, help="key tile (default: the recipe's, else 128)")
    _add_attention_output(p)
    p.set_defaults(run=cmd_attention)


def _add_attention_output(p) -> None:
    """What `fp4lab attention` writes and draws (also read with --config)."""
    p.add_argument(
        "--out", metavar="FOLDER", help="results folder (default results/attention-<time>)"
    )
    p.add_argument(
        "--heatmap",
        metavar="COLUMN",
        help="the trace statistic the heatmaps show (default prod_err)",
    )
    p.add_argument("--head", type=_natural, help="the query head the heatmaps show (default 0)")
    p.add_argument("--batch", type=_natural, help="the batch element the heatmaps show (default 0)")
    p.add_argument(
        "--reduce",
        choices=REDUCTIONS,
        help="show the mean or max over every head and batch element instead of one",
    )
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        import_all(getattr(args, "imports", []))
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError) as err:
        print(f"fp4lab {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fp4lab {args.command}: interrupted", file=sys.stderr)
        return 130
