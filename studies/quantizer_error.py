"""quantizer-error: how much each block format loses, by input, rounding and block shape.

What. For every block format of `fp4lab.formats.BLOCK_FORMATS` and three inputs (standard
Gaussian, Gaussian rows times magnitudes log-spaced over 2^-16 .. 2^16, Student t with 3
degrees of freedom; `fp4lab.analysis.quant_error.INPUT_KINDS`), the quantize-dequantize
q(x) of a rows x cols matrix, blocked along its rows, is measured with Quartet II's
diagnostics (arXiv 2601.22813): relative MSE ||x - q(x)||^2 / ||x||^2, effective bits
-log2(relative MSE) / 2 and magnitude misalignment 1 - <x, q(x)> / <x, x> (positive when q
shrinks x, a proxy for the bias of a product using q(x)).

Rounding. Each format is measured with round-to-nearest-even elements and with stochastic
rounding (unbiased element by element), the latter over `draws` independent draws; a format
that corrects its scales (MS-EDEN, `nvfp4_ms_eden`: random Hadamard, nearest elements, a
scale correction <x,x>/<x,q> with stochastic scale rounding) rounds its own way ("ms_eden"),
with the Hadamard transform's signs redrawn for every draw, as its release does each step
(its unbiasedness is over the rotation). For
the random ones the rows also hold the error of the mean of the first n draws: Quartet II's
unbiasedness test, whose error falls as 1/n when q is unbiased and flattens at the squared
bias when it is not.

Blocks. Every 1-D format (blocks of n along a row) is also measured with square n x n tiles
(the layout whose scales a tensor and its transpose share), unless a named format already is
that tile (``nvfp4_2d`` is NVFP4's 16 x 16).

Anchors (Quartet II, Sec. 3): NVFP4 with round-to-nearest on an 8192 x 8192 standard
Gaussian has relative MSE 9.0e-3, and 12.4e-3 with 16 x 16 tiles. The relative MSE is a
ratio of sums over elements, so a smaller matrix estimates the same number with a larger
standard error, computed here from the spread over independent row bands (one band per row
of blocks: a scale never spans two bands) by the delta method. The tolerance is z standard
errors of the difference (ours and the anchor's, the latter scaled to 8192 x 8192) plus half
a unit in the anchor's last printed digit (0.05e-3); nothing is tuned to pass.

Caveats. The tensor-scale formats take their scale from the whole matrix, which couples the
bands slightly (the band standard error ignores it). Inputs are drawn once per (kind, seed)
and shared by every format, so format differences are paired; the report's comparisons
between formats use the unpaired standard error, which overstates their uncertainty.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure

from fp4lab.analysis.quant_error import INPUT_KINDS
from fp4lab.formats import BLOCK_FORMATS, Correction, QuantSpec, Rounding, fake_quantize, get
from fp4lab.studies import cell_seed, markdown_table

QUESTION = (
    "How much does each block format lose (relative MSE, effective bits, magnitude "
    "misalignment) on Gaussian, log-spaced and heavy-tailed inputs, with nearest, stochastic "
    "and MS-EDEN rounding and with 1-D blocks versus square tiles; does NVFP4 reproduce "
    "Quartet II's 9.0e-3 and 12.4e-3?"
)
BACKENDS = ("reference",)  # quantizes with fp4lab.formats; no attention backend is involved

# block formats whose own rounding is nearest: the stochastic ones are the rounding axis
DEFAULT_FORMATS = tuple(s.name for s in BLOCK_FORMATS if s.rounding is Rounding.NEAREST_EVEN)
ROUNDINGS = ("nearest", "stochastic")
ANCHOR_SIZE = 8192 * 8192  # elements of Quartet II's matrix
ANCHORS = (  # (format, block, relative MSE, half a unit in its last printed digit)
    ("nvfp4", "1x16", 9.0e-3, 0.05e-3),
    ("nvfp4", "16x16", 12.4e-3, 0.05e-3),
)


@dataclass(frozen=True)
class QuantizerErrorConfig:
    rows: int = 8192  # rows of each input matrix (Quartet II's 8192)
    cols: int = 8192  # columns; 1-D blocks run along the rows
    inputs: tuple[str, ...] = ("gaussian", "gaussian_logspaced", "heavy_tailed")  # INPUT_KINDS
    formats: tuple[str, ...] = DEFAULT_FORMATS  # registered block formats
    roundings: tuple[str, ...] = ROUNDINGS  # element rounding (MS-EDEN rounds its own way)
    draws: int = 4  # independent draws of each random rounding
    square_tiles: bool = True  # also each 1-D format as n x n tiles
    z: float = 3.0  # the anchors' tolerance, in standard errors

    def __post_init__(self) -> None:
        for name in ("rows", "cols", "draws"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for kind in self.inputs:
            if kind not in INPUT_KINDS:
                raise ValueError(f"inputs: {kind!r} is not one of {', '.join(INPUT_KINDS)}")
        for name in self.formats:
            get(name, QuantSpec)  # ValueError naming the registered block formats
        for mode in self.roundings:
            if mode not in ROUNDINGS:
                raise ValueError(f"roundings: {mode!r} is not one of {', '.join(ROUNDINGS)}")
        if not self.z > 0:
            raise ValueError(f"z must be positive, got {self.z}")


PRESETS = {
    "smoke": QuantizerErrorConfig(rows=1024, cols=1024, draws=2),
    "full": QuantizerErrorConfig(),
}


# -- the sweep -----------------------------------------------------------------------------


def block_label(spec: QuantSpec) -> str:
    """A block shape in words: 1x16, 16x16, tensor."""
    if spec.block is None:
        return "tensor"
    return "x".join(map(str, (1, *spec.block) if len(spec.block) == 1 else spec.block))


def square(spec: QuantSpec) -> QuantSpec | None:
    """The n x n-tile variant of a 1-D format (None where tiles do not apply)."""
    if spec.block is None or len(spec.block) != 1 or spec.hadamard is not None:
        return None
    if spec.correction is not Correction.NONE:
        return None
    n = spec.block[0]
    return dataclasses.replace(spec, name=f"{spec.name}_{n}x{n}", block=(n, n))


def _same(a: QuantSpec, b: QuantSpec) -> bool:
    return dataclasses.replace(a, name=b.name) == b


def _layouts(config: QuantizerErrorConfig) -> list[tuple[QuantSpec, str]]:
    """(spec, base): every format, and the square variants no named format already is; base
    is the 1-D format a tile belongs to (itself otherwise)."""
    named = [get(n, QuantSpec) for n in config.formats]
    found = [(s, s.name) for s in named]
    for spec in named:
        tile = square(spec) if config.square_tiles else None
        if tile is None:
            continue
        twin = [i for i, (s, _) in enumerate(found) if _same(tile, s)]
        if twin:
            found[twin[0]] = (found[twin[0]][0], spec.name)  # nvfp4_2d is nvfp4's tile
        else:
            found.append((tile, spec.name))
    return found


def _modes(spec: QuantSpec, config: QuantizerErrorConfig) -> tuple[str, ...]:
    return ("ms_eden",) if spec.correction is Correction.EDEN else config.roundings


def cells(config: QuantizerErrorConfig) -> list[dict]:
    return [
        {"input": kind, "format": spec.name, "base": base, "block": block_label(spec),
         "rounding": mode}
        for kind in config.inputs
        for spec, base in _layouts(config)
        for mode in _modes(spec, config)
    ]


def _spec(cell: dict) -> QuantSpec:
    """The cell's format: registered, or the square variant of its base."""
    base = get(cell["base"], QuantSpec)
    if cell["format"] == base.name:
        return base
    tile = square(base)
    if tile is not None and tile.name == cell["format"]:
        return tile
    return get(cell["format"], QuantSpec)


# -- one cell ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _input(kind: str, rows: int, cols: int, seed: int, device: str) -> torch.Tensor:
    """The float32 input of `kind` (INPUT_KINDS), drawn on the CPU from the run's seed and
    the kind alone (so every format sees the same matrix), then moved to `device`."""
    gen = torch.Generator().manual_seed(cell_seed(seed, {"input": kind}))

    def normal(*shape):
        return torch.randn(*shape, generator=gen)

    if kind == "gaussian":
        x = normal(rows, cols)
    elif kind == "gaussian_logspaced":
        x = normal(rows, cols) * torch.logspace(-16, 16, rows, base=2)[:, None]
    elif kind == "heavy_tailed":  # Student t, 3 degrees of freedom
        x = normal(rows, cols) / torch.sqrt(normal(3, rows, cols).pow(2).sum(0) / 3)
    else:  # outliers: FlashAttention-3's N(0, 1) + N(0, 100) * Bernoulli(0.001)
        x = normal(rows, cols) + 10 * normal(rows, cols) * (torch.rand(rows, cols, generator=gen)
                                                             < 0.001)
    return x.to(device)


def band_sums(x: torch.Tensor, q: torch.Tensor, band: int) -> dict[str, torch.Tensor]:
    """Per row band of `band` rows, in float64: sum (x - q)^2, sum x^2, sum x q; and per row
    the relative MSE (NaN for an all-zero row). Rows are taken in chunks to bound memory."""
    sums = {"err": [], "energy": [], "cross": [], "row_rel": []}
    for start in range(0, x.shape[0], 1024):
        xc, qc = x[start : start + 1024].double(), q[start : start + 1024].double()
        err, energy = (xc - qc).pow(2).sum(-1), xc.pow(2).sum(-1)
        sums["err"].append(err)
        sums["energy"].append(energy)
        sums["cross"].append((xc * qc).sum(-1))
        sums["row_rel"].append(torch.where(energy > 0, err / energy, torch.nan))
    per_row = {k: torch.cat(v).cpu() for k, v in sums.items()}
    bands = -(-x.shape[0] // band)
    out = {
        k: torch.nn.functional.pad(v, (0, bands * band - v.numel())).view(bands, band).sum(-1)
        for k, v in per_row.items() if k != "row_rel"
    }
    out["row_rel"] = per_row["row_rel"]
    return out


def _ratio_se(num: torch.Tensor, den: torch.Tensor) -> tuple[float, float]:
    """sum num / sum den over bands and its delta-method standard error."""
    n = num.numel()
    ratio = (num.sum() / den.sum()).item()
    if n < 2:
        return ratio, math.nan
    spread = (num - ratio * den).pow(2).sum() * n / (n - 1)
    return ratio, (spread.sqrt() / den.sum()).item()


def metrics(x: torch.Tensor, q: torch.Tensor, band: int) -> dict[str, float]:
    """Relative MSE, effective bits, SQNR, misalignment (`fp4lab.analysis.quant_error`'s
    definitions), their standard errors over row bands, and the mean per-row relative MSE."""
    s = band_sums(x, q, band)
    rel, rel_se = _ratio_se(s["err"], s["energy"])
    kept, kept_se = _ratio_se(s["cross"], s["energy"])
    return {
        "rel_mse": rel,
        "rel_mse_se": rel_se,
        "effective_bits": -math.log2(rel) / 2 if rel > 0 else math.inf,
        "sqnr_db": -10 * math.log10(rel) if rel > 0 else math.inf,
        "misalignment": 1 - kept,
        "misalignment_se": kept_se,
        "rel_mse_row": torch.nanmean(s["row_rel"]).item(),
    }


def run_cell(config: QuantizerErrorConfig, cell: dict, ctx) -> list[dict]:
    x = _input(cell["input"], config.rows, config.cols, ctx.seed, ctx.device)
    spec = _spec(cell)
    band = spec.block[0] if spec.block is not None and len(spec.block) == 2 else 1
    common = {"bits_per_element": spec.bits_per_element, "element_bits": spec.element.bits}
    if cell["rounding"] == "nearest":
        q = fake_quantize(x, spec, rounding=Rounding.NEAREST_EVEN)
        return [{"draw": 0, "averaged": 1, **common, **metrics(x, q, band)}]
    rounding = None if cell["rounding"] == "ms_eden" else Rounding.STOCHASTIC
    rows, total = [], torch.zeros_like(x, dtype=torch.float64)
    for draw in range(config.draws):
        seed = cell_seed(ctx.cell_seed, {"draw": draw})
        drawn = spec if spec.hadamard is None else dataclasses.replace(spec, hadamard_seed=seed)
        q = fake_quantize(x, drawn, rounding=rounding, generator=seed)
        total += q
        rows.append({"draw": draw, "averaged": 1, **common, **metrics(x, q, band)})
        if draw > 0:
            mean = (total / (draw + 1)).float()
            rows.append({"draw": draw, "averaged": draw + 1, **common, **metrics(x, mean, band)})
    return rows


# -- the report ----------------------------------------------------------------------------


def anchor_checks(config: QuantizerErrorConfig, frame: pd.DataFrame) -> pd.DataFrame:
    """One row per anchor: measured relative MSE, standard errors, tolerance, verdict."""
    rows = []
    single = frame[(frame["input"] == "gaussian") & (frame["rounding"] == "nearest")]
    for base, block, anchor, digit in ANCHORS:
        hit = single[(single["base"] == base) & (single["block"] == block)]
        row = {"format": base, "block": block, "anchor": anchor}
        if hit.empty:
            rows.append({**row, "verdict": "not measured"})
            continue
        measured, se = hit["rel_mse"].iloc[0], hit["rel_mse_se"].iloc[0]
        se_anchor = se * math.sqrt(config.rows * config.cols / ANCHOR_SIZE)
        tolerance = config.z * math.hypot(se, se_anchor) + digit
        ok = abs(measured - anchor) <= tolerance
        rows.append({**row, "measured": measured, "se": se, "se_anchor": se_anchor,
                     "tolerance": tolerance, "difference": measured - anchor,
                     "verdict": "pass" if ok else "FAIL"})
    return pd.DataFrame(rows)


def _single_draws(frame: pd.DataFrame) -> pd.DataFrame:
    """Each cell's single-draw metrics averaged over its draws (nearest has one); standard
    errors are a single draw's (the data's share of them does not shrink over draws)."""
    keys = ["input", "format", "base", "block", "rounding"]
    values = ["rel_mse", "rel_mse_se", "effective_bits", "misalignment", "misalignment_se",
              "rel_mse_row", "bits_per_element", "element_bits"]
    single = frame[frame["averaged"] == 1]
    return single.groupby(keys, sort=False)[values].mean().reset_index()


def _anchor_section(config, frame) -> tuple[str, list[str]]:
    checks = anchor_checks(config, frame)
    shown = checks.copy()
    for column in ("anchor", "measured", "se", "se_anchor", "tolerance", "difference"):
        if column in shown:
            shown[column] = shown[column] * 1e3
    text = (
        "## Anchors (Quartet II)\n\n"
        f"NVFP4, round-to-nearest, standard Gaussian, {config.rows} x {config.cols} "
        f"({config.rows * config.cols:.3g} elements; the anchors used 8192 x 8192). Tolerance "
        f"= {config.z:g} standard errors of the difference (ours, and the anchor's scaled to "
        "its size) + half a unit in the anchor's last digit. Figures in units of 1e-3.\n\n"
        + markdown_table(shown, {
            "format": "format", "block": "block", "anchor": "anchor", "measured": "measured",
            "se": "std. error", "se_anchor": "anchor's std. error", "tolerance": "tolerance",
            "difference": "difference", "verdict": "verdict"}, digits=4) + "\n"
    )
    short = []
    for _, r in checks.iterrows():
        if r["verdict"] == "not measured":
            short.append(f"NVFP4 {r['block']}: not measured (not in this run's formats).")
            continue
        short.append(
            f"NVFP4 {r['block']} on the Gaussian: relative MSE {r['measured'] * 1e3:.3f}e-3 "
            f"against Quartet II's {r['anchor'] * 1e3:.1f}e-3 (difference "
            f"{r['difference'] * 1e3:+.3f}e-3, tolerance {r['tolerance'] * 1e3:.3f}e-3): "
            f"{'reproduced' if r['verdict'] == 'pass' else 'NOT reproduced'}."
        )
    return text, short


def _formats_section(single: pd.DataFrame) -> tuple[str, list[str]]:
    own = single[(single["rounding"].isin(["nearest", "ms_eden"]))
                 & (single["format"] == single["base"])]
    if own.empty:
        return "", []
    wide = own.pivot_table(index=["format", "block", "rounding", "bits_per_element"],
                           columns="input", values="effective_bits", sort=False).reset_index()
    inputs = [c for c in wide.columns if c in INPUT_KINDS]
    wide = wide.sort_values(["bits_per_element", inputs[0]], ascending=[True, False])
    text = (
        "## Effective bits per format (nearest rounding; MS-EDEN its own)\n\n"
        "Effective bits = -log2(relative MSE) / 2, each format on its own block shape.\n\n"
        + markdown_table(wide, {"format": "format", "block": "block", "rounding": "rounding",
                                "bits_per_element": "bits/element", **{k: k for k in inputs}})
        + "\n"
    )
    short = []
    for kind in inputs:
        four = own[(own["input"] == kind) & (own["element_bits"] == 4)]
        if four.empty:
            continue
        best = four.loc[four["effective_bits"].idxmax()]
        worst = four.loc[four["effective_bits"].idxmin()]
        short.append(
            f"{kind}: of the 4-bit formats {best['format']} keeps the most "
            f"({best['effective_bits']:.2f} effective bits), {worst['format']} the least "
            f"({worst['effective_bits']:.2f})."
        )
    return text, short


def _rounding_section(config, single: pd.DataFrame, frame: pd.DataFrame):
    if not {"stochastic", "nearest"} <= set(single["rounding"]):
        return "", []
    z = config.z
    pairs = single.pivot_table(index=["input", "format", "block"], columns="rounding",
                               values="rel_mse", sort=False)
    ratio = (pairs["stochastic"] / pairs["nearest"]).dropna()
    kind = "gaussian" if "gaussian" in config.inputs else config.inputs[0]
    here = single[single["input"] == kind]
    sr = here[here["rounding"].isin(["stochastic", "ms_eden"])]
    near = here[here["rounding"] == "nearest"]
    unbiased = sr[sr["misalignment"].abs() <= z * sr["misalignment_se"]]
    shrunk = near[near["misalignment"] > z * near["misalignment_se"]]
    text = (
        "## Rounding: nearest, stochastic, MS-EDEN\n\n"
        f"Stochastic rounding multiplies the relative MSE by {ratio.median():.2f} (median over "
        f"formats and inputs; {ratio.min():.2f} to {ratio.max():.2f}). On {kind}, "
        f"{len(unbiased)} of {len(sr)} random roundings have a misalignment within {z:g} "
        f"standard errors of zero; nearest rounding shrinks x (misalignment above {z:g} "
        f"standard errors) in {len(shrunk)} of {len(near)} formats. Stochastic rounding of the "
        "elements is unbiased only where the block maximum is representable: a scale rounded "
        "down (NVFP4's nearest E4M3 scale, OCP's floor) clips it, which biased stochastic "
        "rounding keeps.\n\n"
    )
    show = here[here["format"].isin(["nvfp4", "nvfp4_ms_eden", "mxfp4", "mxfp4_rceil",
                                     "nvfp4_ue5m3", "mxfp8_e4m3"])]
    text += markdown_table(show, {
        "format": "format", "block": "block", "rounding": "rounding",
        "rel_mse": "relative MSE", "misalignment": "misalignment",
        "misalignment_se": "std. error"}) + "\n"
    averaging, short = _averaging(frame, kind)
    eden = sr[sr["rounding"] == "ms_eden"]
    if len(eden):
        e, n4 = eden.iloc[0], near[near["format"] == "nvfp4"]
        short.insert(0, f"MS-EDEN on {kind}: relative MSE {e['rel_mse']:.3g}, misalignment "
                        f"{e['misalignment']:+.2g} +- {e['misalignment_se']:.2g}"
                        + (f" (NVFP4 nearest: {n4['rel_mse'].iloc[0]:.3g}, "
                           f"{n4['misalignment'].iloc[0]:+.2g})." if len(n4) else "."))
    short.insert(0, f"Stochastic rounding costs x{ratio.median():.2f} in relative MSE; on "
                    f"{kind} {len(unbiased)} of {len(sr)} random roundings are unbiased within "
                    f"{z:g} standard errors, nearest rounding shrinks {len(shrunk)} of "
                    f"{len(near)} formats.")
    return text + averaging, short


def _averaging(frame: pd.DataFrame, kind: str) -> tuple[str, list[str]]:
    """Quartet II's test: the relative MSE of the mean of n draws times n over one draw's."""
    keys = ["input", "format", "rounding"]
    means = frame[(frame["averaged"] > 1) & (frame["input"] == kind)]
    if means.empty:
        return "", []
    last = means.loc[means.groupby(keys)["averaged"].idxmax()]
    single = frame[frame["averaged"] == 1].groupby(keys)["rel_mse"].mean()
    floor = last.apply(lambda r: r["rel_mse"] * r["averaged"] / single[tuple(r[keys])], axis=1)
    last = last.assign(floor=floor)
    n = int(last["averaged"].max())
    flat = last[last["floor"] > 1.5]
    text = (
        f"Averaging n = {n} draws on {kind}: for an unbiased rounding the relative MSE of the "
        "mean is one draw's over n (ratio n x mean / single = 1); a bias leaves a floor "
        f"(ratio above 1). The ratio is {last['floor'].median():.2f} (median; "
        f"{last['floor'].min():.2f} to {last['floor'].max():.2f}); "
    )
    if len(flat):
        text += f"{len(flat)} flatten (ratio > 1.5): {', '.join(sorted(set(flat['format'])))}."
    else:
        text += "none flattens (ratio > 1.5)."
    short = [f"Averaging {n} draws on {kind}: ratio n x mean / single "
             f"{last['floor'].median():.2f} (median; 1 when unbiased)"
             + (f", flattening for {', '.join(sorted(set(flat['format'])))}." if len(flat)
                else ", none flattens.")]
    return text + "\n\n", short


def _tiles_section(single: pd.DataFrame) -> tuple[str, list[str]]:
    near = single[single["rounding"] == "nearest"]
    one = near[near["format"] == near["base"]].set_index(["input", "base"])
    two = near[(near["format"] != near["base"])].set_index(["input", "base"])
    both = one.merge(two, left_index=True, right_index=True, suffixes=("_1d", "_2d"))
    both = both.reset_index()
    if both.empty:
        return "", []
    both["bits_lost"] = both["effective_bits_1d"] - both["effective_bits_2d"]
    both["ratio"] = both["rel_mse_2d"] / both["rel_mse_1d"]
    text, short = "## 1-D blocks versus square tiles (nearest rounding)\n\n", []
    for kind, rows in both.groupby("input", sort=False):
        line = (f"{kind}: square tiles multiply the relative MSE by {rows['ratio'].median():.2f}"
                f" (median over {len(rows)} formats; {rows['ratio'].min():.2f} to "
                f"{rows['ratio'].max():.2f}), {rows['bits_lost'].median():.2f} effective bits.")
        text += f"- {line}\n"
        short.append(line)
    kind = "gaussian" if (both["input"] == "gaussian").any() else both["input"].iloc[0]
    show = both[both["input"] == kind].sort_values("ratio")
    text += f"\nOn {kind}:\n\n" + markdown_table(show, {
        "base": "format", "block_1d": "1-D", "block_2d": "tile", "rel_mse_1d": "rel. MSE 1-D",
        "rel_mse_2d": "rel. MSE tile", "bits_lost": "bits lost"}) + "\n"
    return text, short[:1]


NULL_PAIRS = (  # formats that differ in one choice, compared on each input
    ("nvfp4", "nvfp4_ue5m3"), ("nvfp4", "nvfp4_1level"), ("nvfp4", "torchao_nvfp4"),
    ("mxfp4", "mxfp4_rceil"), ("mxfp4_even", "mxfp4_alpha_mse"),
)


def _null_section(config, single: pd.DataFrame) -> tuple[str, list[str]]:
    """Pairs of formats whose relative MSE differs, or does not, beyond z standard errors."""
    near = single[(single["rounding"] == "nearest") & (single["format"] == single["base"])]
    near = near.set_index(["format", "input"])
    lines, same = [], []
    for a, b in NULL_PAIRS:
        for kind in config.inputs:
            if (a, kind) not in near.index or (b, kind) not in near.index:
                continue
            ra, rb = near.loc[(a, kind)], near.loc[(b, kind)]
            diff = rb["rel_mse"] - ra["rel_mse"]
            se = math.hypot(ra["rel_mse_se"], rb["rel_mse_se"])
            null = abs(diff) <= config.z * se
            lines.append(f"- {b} against {a} on {kind}: {diff:+.3g} "
                         f"({'no difference beyond' if null else 'differs by more than'} "
                         f"{config.z:g} standard errors of {se:.2g})")
            if null:
                same.append(f"{b}/{a} on {kind}")
    if not lines:
        return "", []
    text = ("## Differences that are, and are not, there\n\n"
            "Unpaired standard errors (the formats quantize the same matrix, so these overstate "
            "the uncertainty of a difference).\n\n" + "\n".join(lines) + "\n\n")
    short = [f"No difference beyond {config.z:g} standard errors: {', '.join(same)}."] if same \
        else []
    return text, short


def report(config: QuantizerErrorConfig, frame: pd.DataFrame):
    single = _single_draws(frame)
    setup = (
        "## Setup\n\n"
        f"Inputs ({config.rows} x {config.cols}, float32, one draw per kind shared by every "
        f"format): {'; '.join(f'{k}: {INPUT_KINDS[k]}' for k in config.inputs)}. "
        f"{len(config.formats)} block formats, blocked along rows"
        f"{', and each 1-D format as square tiles' if config.square_tiles else ''}; roundings "
        f"{', '.join(config.roundings)} (MS-EDEN its own), {config.draws} draws of each random "
        "one. Relative MSE is ||x - q(x)||^2 / ||x||^2 over the whole matrix, effective bits "
        "-log2(relative MSE) / 2, misalignment 1 - <x, q(x)> / <x, x>; standard errors from "
        "the spread over row bands (delta method).\n\n"
    )
    sections = [
        _anchor_section(config, frame), _formats_section(single),
        _rounding_section(config, single, frame), _tiles_section(single),
        _null_section(config, single),
    ]
    short = "".join(f"- {line}\n" for _, lines in sections for line in lines)
    text = setup + "## What the numbers show\n\n" + short + "\n"
    text += "".join(body for body, _ in sections)
    return text, _figures(single, frame)


def _figures(single: pd.DataFrame, frame: pd.DataFrame) -> dict[str, Figure]:
    figures = {}
    own = single[(single["format"] == single["base"])
                 & single["rounding"].isin(["nearest", "ms_eden"])]
    if len(own):
        order = own.groupby("format", sort=False)["effective_bits"].mean().sort_values().index
        fig = Figure(figsize=(7, 0.22 * len(order) + 1.5), layout="constrained")
        ax = fig.subplots()
        sns.barplot(data=own, y="format", x="effective_bits", hue="input", order=order, ax=ax)
        ax.set_xlabel("effective bits, -log2(relative MSE) / 2")
        ax.set_title("nearest rounding (MS-EDEN its own); own blocks", fontsize=10)
        figures["effective_bits"] = fig
    tiles = single[(single["rounding"] == "nearest")]
    if (tiles["format"] != tiles["base"]).any():
        tiles = tiles.assign(layout=["tile" if f != b else "1-D" for f, b in
                                     zip(tiles["format"], tiles["base"], strict=True)])
        bases = tiles.loc[tiles["layout"] == "tile", "base"].unique()
        tiles = tiles[tiles["base"].isin(bases)]
        fig = Figure(figsize=(7, 0.25 * len(bases) * max(1, tiles["input"].nunique()) + 1.5),
                     layout="constrained")
        ax = fig.subplots()
        sns.barplot(data=tiles, y="base", x="rel_mse", hue="layout", ax=ax)
        ax.set_xscale("log")
        ax.set_xlabel("relative MSE (all inputs; bars average them)")
        ax.set_title("1-D blocks of n against n x n tiles")
        figures["square_tiles"] = fig
    curve = frame[frame["rounding"].isin(["stochastic", "ms_eden"])
                  & frame["base"].isin(["nvfp4", "nvfp4_ms_eden", "mxfp4", "mxfp8_e4m3"])
                  & (frame["format"] == frame["base"])]
    curve = curve[(curve["averaged"] > 1) | (curve["draw"] == 0)]
    if curve["averaged"].nunique() > 1:
        fig = Figure(figsize=(6, 4), layout="constrained")
        ax = fig.subplots()
        sns.lineplot(data=curve, x="averaged", y="rel_mse", hue="format", style="input",
                     marker="o", ax=ax)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("draws averaged (n)")
        ax.set_ylabel("relative MSE of the mean")
        ax.set_title("unbiased roundings fall as 1/n")
        figures["averaging"] = fig
    return figures
