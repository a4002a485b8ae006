"""Per-tile statistics of what quantization did inside attention: the `Trace` and its schema.

Give `attention(..., trace=Trace())` and every call records, for each of the six products
(`qk`, `pv` in the forward; `dv`, `dp`, `dq`, `dk` once `backward()` has run) and each
(batch, head, query tile, key tile), how much its two operands lost to quantization and how
far the product tile landed from the same product on unquantized operands, plus per query
tile how far the softmax denominator, log-sum-exp and output moved. Several calls (the layers
of a model under `patch_sdpa`) are kept apart by a `call` index. Statistics are tensors while
attention runs and a pandas DataFrame at the end (`Trace.to_frame`), never prints; a heatmap
over (q_tile, k_tile) of any column is one pivot away. Both execution paths (the simulation
and the kernels) write this one schema: `COLUMNS` lists every column with its definition.

In the definitions x is an operand tile before quantization and x^ after, both as the
product consumes them: P is exp(S - m) with the forward's row reference m in ``pv`` and the
rebuilt exp(S - lse) in ``dv``; "nonzero" counts the elements with x != 0; a column is NaN
where its ratio has nothing to count, and in tiles that hold NaN. Tiles a causal mask skips
entirely are absent. Rows with ``product == "out"`` (``k_tile == -1``) hold the forward's
per-query-tile statistics, over the tile's query rows that are not fully masked.

Reference precision. `reference_dtype` defaults to the computation's working precision:
float64 for float64 inputs, float32 otherwise. A float32 reference product on the same
operands differs from the float64 one by a relative ~1e-7 (at most K u ||A|| ||B|| for an
inner dimension K, u = 2^-24), so ``prod_err``, ``out_err`` and ``lse_err`` carry an
absolute uncertainty of ~1e-7 to 1e-6, far below any FP8 or FP4 error (1e-3 to 1e-1); with
unquantized operands the reference is the very same float32 arithmetic and the error is 0.
Ask for ``Trace(reference_dtype=torch.float64)`` to resolve float32-level errors in a
float32 run (on a CPU float64 matrix products run at a third of float32's speed).

The trace only reads: attention's outputs and gradients are the same bits with and without
it. Metadata of each call (shapes, tiles, causal, the generator's seed) is in
`Trace.calls[i].meta`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch

from fp4lab.recipes.operands import Product

__all__ = [
    "Trace",
    "TraceCall",
    "Column",
    "COLUMNS",
    "ID_COLUMNS",
    "OPERAND_COLUMNS",
    "PRODUCT_COLUMNS",
    "OUT_COLUMNS",
    "STATISTICS",
    "column",
]


@dataclass(frozen=True)
class Column:
    """One column of the trace's frame.

    Attributes:
        name: the column's name (operand statistics: without their ``a_`` / ``b_`` prefix).
        kind: "id" (identifies a row), "operand" (one per operand, prefixed ``a_`` and
            ``b_``), "product" (of the product tile) or "out" (of a query tile's output).
        short: the definition in a few words, for a figure's colour bar.
        definition: the definition in full.
    """

    name: str
    kind: str
    short: str
    definition: str


COLUMNS = (
    Column(
        "call", "id", "call", "index of the attention call (one per SDPA call under patch_sdpa)"
    ),
    Column("recipe", "id", "recipe", "the attention recipe's name"),
    Column("product", "id", "product", "qk, pv, dv, dp, dq, dk, or out for per-query-tile rows"),
    Column(
        "a_name", "id", "operand a", "short name of the product's left operand (q, k, v, p, do, ds)"
    ),
    Column("b_name", "id", "operand b", "short name of the product's right operand"),
    Column("batch", "id", "batch", "batch index"),
    Column("head", "id", "head", "query head"),
    Column("kv_head", "id", "key/value head", "key/value head (query head // (H / Hkv))"),
    Column("q_tile", "id", "query tile", "query tile index (block_m rows)"),
    Column("k_tile", "id", "key tile", "key tile index (block_n rows); -1 on out rows"),
    Column(
        "err",
        "operand",
        "relative error of the operand tile",
        "||x^ - x||_F / ||x||_F (0 when both are zero)",
    ),
    Column(
        "flushed",
        "operand",
        "fraction of nonzeros flushed to zero",
        "fraction of nonzero elements with x^ = 0",
    ),
    Column(
        "clipped",
        "operand",
        "fraction of nonzeros clipped",
        "fraction of nonzero elements whose magnitude exceeds the largest value representable "
        "in their block (element max x block scale x tensor scale), so that saturation, not "
        "rounding, set x^; a block whose stored scale is zero stores zeros, which count as "
        "flushed, not clipped",
    ),
    Column(
        "scale_underflow",
        "operand",
        "fraction of blocks whose scale underflowed",
        "fraction of the tile's blocks holding a nonzero element whose ideal scale, block amax "
        "/ (element max x tensor scale), lies below the scale format's smallest positive value "
        "(the block flushes or its scale is raised), beyond float32 rounding; a block of a "
        "whole-tensor operand counts in the tile holding its first element; NaN for operands "
        "without block scales",
    ),
    Column(
        "scale_overflow",
        "operand",
        "fraction of blocks whose scale overflowed",
        "as scale_underflow, above the scale format's largest value (the scale saturates and "
        "the block clips)",
    ),
    Column(
        "nan", "operand", "NaN elements of the quantized operand", "number of NaN elements of x^"
    ),
    Column(
        "p_mass_lost",
        "product",
        "probability mass flushed per query row",
        "products with a P operand: probability mass whose P values were flushed to zero, in "
        "units of the final softmax probability, averaged over the tile's query rows (the "
        "forward normalises by the recipe's own log-sum-exp)",
    ),
    Column(
        "p_fwd_mismatch",
        "product",
        "relative difference of the backward's P from the forward's",
        "dv only: ||P_b - P_f||_F / ||P_f||_F, P_b the P that dV = P^T dO consumed (lift divided "
        "out), P_f the P^ the forward's P V consumed, replayed with the row references the "
        "forward used and normalized by its log-sum-exp (the weights the output gave each "
        "value row); 0 when the backward replays the forward",
    ),
    Column(
        "prod_err",
        "product",
        "relative error of the product tile",
        "||y^ - y||_F / ||y||_F of the product tile y^ (quantized operands) against y, the same "
        "product on the unquantized operands of this product (its local error; errors arriving "
        "from earlier products show in the out rows). For qk and dp, whose operands are whole "
        "tensors, computed in float64 from the tiles' Gram matrices (exact products of the "
        "quantized against the unquantized operands, resolved from about 1e-7 up) in blocks "
        "with nothing masked (no attn_mask, causal cut or padding and, for qk, no Q smoothing); "
        "elsewhere y is computed in reference_dtype over the entries the masks leave (the two "
        "routes differ at the 1e-7 level)",
    ),
    Column(
        "prod_nan", "product", "NaN elements of the product tile", "number of NaN elements of y^"
    ),
    Column(
        "row_sum_err",
        "out",
        "relative error of the softmax denominator",
        "mean over the tile's rows of l^ / l - 1, the sum of the P values that P V consumed over "
        "the sum of the unquantized P (same scores, same row references)",
    ),
    Column(
        "lse_err",
        "out",
        "absolute error of the log-sum-exp",
        "mean |lse - lse_ref| of the recipe's log-sum-exp against the exact one in "
        "reference_dtype from the unquantized Q, K",
    ),
    Column(
        "out_err",
        "out",
        "relative error of the output tile",
        "||O - O_ref||_F / ||O_ref||_F of the output tile against exact attention in "
        "reference_dtype on the unquantized inputs",
    ),
    Column(
        "out_nan",
        "out",
        "NaN elements of the output tile",
        "number of NaN elements of the output tile",
    ),
)

ID_COLUMNS = tuple(c.name for c in COLUMNS if c.kind == "id")
OPERAND_COLUMNS = tuple(c.name for c in COLUMNS if c.kind == "operand")
PRODUCT_COLUMNS = tuple(c.name for c in COLUMNS if c.kind == "product")
OUT_COLUMNS = tuple(c.name for c in COLUMNS if c.kind == "out")
# every statistic, as named in the frame
STATISTICS = (
    tuple(f"{side}_{c}" for side in "ab" for c in OPERAND_COLUMNS) + PRODUCT_COLUMNS + OUT_COLUMNS
)
_BY_NAME = {c.name: c for c in COLUMNS}
# A host block of at least this many entries per column is copied into its table column by
# column rather than stacked first: on a CPU, per-column copies cost a few microseconds each
# and stacking a block costs its size (measured: 20 columns of 256 entries stack in 0.03 ms,
# per column 0.08 ms; of 65536 entries 1.6 to 2.0 ms stacked, 0.3 to 0.4 ms per column).
_APART = 4096


def _compact(x: torch.Tensor) -> torch.Tensor:
    """A float64 copy of x's distinct values: each broadcast dim (stride 0) cut to one entry
    before the copy, so that a column the same over the other side's tiles stays small."""
    for dim, (size, stride) in enumerate(zip(x.shape, x.stride(), strict=True)):
        if stride == 0 and size > 1:
            x = x.narrow(dim, 0, 1)
    return x.to(torch.float64, copy=True)


def column(name: str) -> Column:
    """The `Column` of a frame column's name (``a_flushed`` gives the ``flushed`` operand
    column, with its short definition naming the operand side)."""
    if name[:2] in ("a_", "b_") and name[2:] in OPERAND_COLUMNS:
        base = _BY_NAME[name[2:]]
        side = "left" if name[0] == "a" else "right"
        return Column(name, base.kind, f"{base.short} ({side} operand)", base.definition)
    if name not in _BY_NAME:
        raise ValueError(
            f"{name!r} is not a trace column; the statistics are {', '.join(STATISTICS)}"
        )
    return _BY_NAME[name]


class Trace:
    """Collects per-tile statistics of the attention calls it is passed to.

    Args:
        reference_dtype: precision of the reference products and of the exact attention the
            ``out`` rows compare with: torch.float32, torch.float64, or None (the default)
            for the computation's working precision, float64 for float64 inputs and float32
            otherwise (see the module's "Reference precision"). Each call's metadata records
            the dtype it used.
    """

    def __init__(self, *, reference_dtype: torch.dtype | None = None) -> None:
        if reference_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(
                "reference_dtype must be torch.float32, torch.float64 or None, got "
                f"{reference_dtype}"
            )
        self.reference_dtype = reference_dtype
        self.calls: list[TraceCall] = []

    def begin(self, recipe: str, dims: tuple[int, ...], meta: dict) -> TraceCall:
        """Open the record of one attention call (used by `attention`)."""
        call = TraceCall(len(self.calls), recipe, dims, dict(meta))
        self.calls.append(call)
        return call

    def clear(self) -> None:
        """Forget every recorded call."""
        self.calls.clear()

    def to_frame(self) -> pd.DataFrame:
        """One row per (call, product, batch, head, query tile, key tile); see the module."""
        frames = [call.to_frame() for call in self.calls]
        frames = [f for f in frames if len(f)]
        if not frames:
            return pd.DataFrame(columns=list(ID_COLUMNS + STATISTICS))
        return pd.concat(frames, ignore_index=True)


@dataclass
class TraceCall:
    """The statistics of one attention call, as (B, Hkv, G, n_q_tiles, n_k_tiles) tensors.

    Heads are split as query head = kv_head * G + g (grouped-query attention's layout).
    """

    index: int
    recipe: str
    dims: tuple[int, ...]  # (B, Hkv, G, nQ, nK)
    meta: dict
    products: dict[Product, dict] = field(default_factory=dict)  # columns, stacked table
    done: dict[Product, torch.Tensor] = field(default_factory=dict)
    out: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(
        self,
        product: Product,
        i0: int,
        j0: int,
        stats: dict[str, torch.Tensor],
        visible: torch.Tensor,
    ) -> None:
        """Store a block's statistics: query tiles i0 .. i0 + n by key tiles j0 .. j0 + g,
        each (B, Hkv, G, n, g) or broadcastable to it; `visible` (n, g) marks the tiles that
        count (the others, a causal mask's skipped tiles, never appear in the frame).

        How they are kept. A block on the host that covers every tile with columns new to
        the product (the Triton backend's: whole tables, many columns the same over the
        other side's tiles) keeps each column as given, a private copy of its distinct
        values broadcast to the whole (a per-query-tile column holds n_q numbers, not
        n_q x n_k). Other blocks go into a stacked table (columns, B, Hkv, G, nQ, nK),
        NaN where nothing was written: a block on the GPU is stacked there and crosses to
        the host in one copy, whatever the number of columns; a large one on the host is
        copied column by column, with no stacked intermediate. A column kept whole that a
        later block writes into joins the table first."""
        shapes = {tuple(v.shape) for v in stats.values()}
        n, g = (shapes.pop() if len(shapes) == 1 else torch.broadcast_shapes(*shapes))[-2:]
        if product not in self.products:
            self.products[product] = {
                "columns": [],
                "table": torch.empty((0, *self.dims), dtype=torch.float64),
                "whole": {},
            }
            self.done[product] = torch.zeros(self.dims[3:], dtype=torch.bool)
        entry = self.products[product]
        covers = (i0, j0, n, g) == (0, 0, *self.dims[3:])
        on_host = all(v.device.type == "cpu" for v in stats.values())
        known = [name for name in stats if name in entry["columns"] or name in entry["whole"]]
        if covers and on_host and not known:
            for name, value in stats.items():
                entry["whole"][name] = _compact(value.detach()).expand(self.dims)
            self.done[product] |= visible
            return
        if any(name in entry["whole"] for name in known):  # into the table, in stats' order
            self._tabulate(entry, [name for name in stats if name in entry["whole"]])
        new = [name for name in stats if name not in entry["columns"]]
        if new:
            # a block that covers every tile writes all of its new columns: nothing to fill
            shape = (len(new), *self.dims)
            fill = (
                torch.empty(shape, dtype=torch.float64)
                if covers and len(new) == len(stats)
                else torch.full(shape, float("nan"), dtype=torch.float64)
            )
            table = entry["table"]
            entry["table"] = torch.cat([table, fill]) if len(table) else fill
            entry["columns"] += new
        first = entry["columns"].index(next(iter(stats)))
        names = entry["columns"][first : first + len(stats)]
        if set(names) != set(stats):
            raise ValueError(f"columns {list(stats)} are not stored together for {product.value}")
        values = [stats[name].detach() for name in names]
        dest = entry["table"][first : first + len(names), ..., i0 : i0 + n, j0 : j0 + g]
        if on_host and dest[0].numel() >= _APART:
            for column, value in zip(dest.unbind(0), values, strict=True):
                column.copy_(value)  # broadcast and converted in the copy
        else:
            dest.copy_(torch.stack(torch.broadcast_tensors(*values)).to("cpu", torch.float64))
        self.done[product][i0 : i0 + n, j0 : j0 + g] |= visible

    def column(self, product: Product, name: str) -> torch.Tensor:
        """Column `name` of `product`, (B, Hkv, G, nQ, nK) float64 (a broadcast view for a
        column kept whole; meaningful only where `done[product]`)."""
        entry = self.products[product]
        if name in entry["whole"]:
            return entry["whole"][name]
        return entry["table"][entry["columns"].index(name)]

    def columns(self, product: Product) -> list[str]:
        """The names of `product`'s columns."""
        entry = self.products[product]
        return entry["columns"] + list(entry["whole"])

    @staticmethod
    def _tabulate(entry: dict, names: list[str]) -> None:
        """Move columns kept whole into the stacked table, side by side in `names`' order."""
        values = torch.stack([entry["whole"].pop(name) for name in names])
        table = entry["table"]
        entry["table"] = torch.cat([table, values]) if len(table) else values
        entry["columns"] += names

    def add_out(self, i0: int, stats: dict[str, torch.Tensor]) -> None:
        """Store per-query-tile statistics of tiles i0 .. i0 + n, each (B, Hkv, G, n)."""
        for name, value in stats.items():
            if name not in self.out:
                self.out[name] = torch.full(self.dims[:4], float("nan"), dtype=torch.float64)
            self.out[name][..., i0 : i0 + value.shape[-1]] = value.detach().to("cpu", torch.float64)

    def to_frame(self) -> pd.DataFrame:
        frames = [self._product_frame(p) for p in Product if p in self.products]
        if self.out:
            frames.append(self._out_frame())
        if not frames:
            return pd.DataFrame(columns=list(ID_COLUMNS + STATISTICS))
        frame = pd.concat(frames, ignore_index=True)
        return frame.reindex(columns=list(ID_COLUMNS + STATISTICS))

    def _index(self, with_k: bool) -> dict[str, torch.Tensor]:
        b, h, g, nq, nk = self.dims
        shape = self.dims if with_k else self.dims[:4]
        grids = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
        index = {
            "batch": grids[0],
            "kv_head": grids[1],
            "head": grids[1] * g + grids[2],
            "q_tile": grids[3],
        }
        index["k_tile"] = grids[4] if with_k else torch.full(shape, -1)
        return index

    def _product_frame(self, product: Product) -> pd.DataFrame:
        keep = self.done[product].expand(self.dims)  # (B, Hkv, G, nQ, nK)
        columns = {k: v[keep].numpy() for k, v in self._index(True).items()}
        columns.update({k: self.column(product, k)[keep].numpy() for k in self.columns(product)})
        frame = pd.DataFrame(columns)
        a_name, b_name = product.operand_names
        return frame.assign(
            call=self.index, recipe=self.recipe, product=product.value, a_name=a_name, b_name=b_name
        )

    def _out_frame(self) -> pd.DataFrame:
        columns = {k: v.flatten().numpy() for k, v in self._index(False).items()}
        columns.update({k: v.flatten().numpy() for k, v in self.out.items()})
        return pd.DataFrame(columns).assign(call=self.index, recipe=self.recipe, product="out")
