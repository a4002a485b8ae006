"""Attention's six matrix products and their twelve operands: one table of facts.

Attention is six matrix products. The forward computes S = Q K^T and O = P V; the backward
computes dV = P^T dO, dP = dO V^T, dQ = dS K and dK = dS^T Q (FlashAttention-2, Dao 2023,
arXiv 2307.08691, Algorithm 2). Each product has two operands, a (left) and b (right), and an
`AttentionRecipe` gives each operand its own format. Everything either execution path needs
to know about an operand is one `Operand` literal in `OPERANDS`; every other list of operands
(the recipe's fields, the trace's operand names, which side of the sequence a tensor is tiled
along, the random-stream ids) is derived from it.

Blocks run along each product's reduction axis, the axis a block-scaled matrix instruction
shares a scale along. 2-D tiles ((r, c) blocks) lie on an operand's natural layout instead:
r rows along its sequence (queries for P and dS) and c columns along head_dim (keys for P and
dS), so P and P^T see the very same tiles. P and dS exist only inside the kernel: they are
quantized tile by tile, and a tensor scale of theirs is taken per tile (one batch, head,
query tile and key tile), since a fused kernel never sees the whole tensor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Product", "Extent", "Seq", "Operand", "OPERANDS", "OPERAND_FIELDS", "operand"]


class Product(enum.Enum):
    """One of attention's six matrix products; its operands are in `OPERANDS`."""

    QK = "qk"
    """S = Q K^T (forward)."""

    PV = "pv"
    """O = P V (forward)."""

    DV = "dv"
    """dV = P^T dO (backward)."""

    DP = "dp"
    """dP = dO V^T (backward)."""

    DQ = "dq"
    """dQ = dS K (backward)."""

    DK = "dk"
    """dK = dS^T Q (backward)."""

    @property
    def backward(self) -> bool:
        return self not in (Product.QK, Product.PV)

    @property
    def operands(self) -> tuple[Operand, Operand]:
        """Operands (a, b)."""
        return _BY_PRODUCT[self]

    @property
    def fields(self) -> tuple[str, str]:
        """The recipe fields of operands (a, b)."""
        return tuple(o.field for o in self.operands)

    @property
    def operand_names(self) -> tuple[str, str]:
        """Short names of operands (a, b), as the trace reports them."""
        return tuple(o.name for o in self.operands)


class Extent(enum.Enum):
    """What an axis of an operand spans."""

    HEAD_DIM = "head_dim"  # Q's and K's last dim, D
    V_DIM = "v_dim"  # V's and dO's last dim, Dv
    SEQ = "seq"  # a whole tensor's sequence (queries or keys)
    BLOCK_M = "block_m"  # a tile's query rows
    BLOCK_N = "block_n"  # a tile's key columns


class Seq(enum.Enum):
    """Which sequence an operand's rows run along, and so which tile size cuts it."""

    QUERY = "query"  # block_m rows
    KEY = "key"  # block_n rows


@dataclass(frozen=True)
class Operand:
    """One operand of one product.

    Attributes:
        field: the `AttentionRecipe` field holding its format.
        product: the product it is an operand of.
        side: "a" (left) or "b" (right).
        name: its short name in the trace (q, k, v, p, do, ds).
        axis: the axis its 1-D blocks run along, in its tensor (B, H, S, E) or, for a
            per-tile operand, in its tiles (..., block_m, block_n).
        along: what that axis spans.
        tile_rows, tile_cols: what a 2-D block's rows and columns span.
        per_tile: True for P and dS, which exist only inside the kernel.
        lift: the recipe field of the constant it is multiplied by before quantization (and
            divided by after), or None.
        seq: the sequence its rows run along (a whole tensor is cut into tiles of that
            side's size; a per-tile operand's rows are always queries).
        stream: its id in the stochastic-rounding streams. Fixed: changing one changes every
            draw of that operand.
    """

    field: str
    product: Product
    side: str
    name: str
    axis: int
    along: Extent
    tile_rows: Extent
    tile_cols: Extent
    per_tile: bool
    lift: str | None
    seq: Seq
    stream: int


_D, _DV, _S, _M, _N = Extent.HEAD_DIM, Extent.V_DIM, Extent.SEQ, Extent.BLOCK_M, Extent.BLOCK_N
_Q, _K = Seq.QUERY, Seq.KEY
QK, PV, DV, DP, DQ, DK = Product
# fmt: off
# field, product, side, name, axis, along, tile rows, tile cols, per tile, lift, seq, stream
OPERANDS = (
    Operand("q",     QK, "a", "q",  -1, _D,  _S, _D,  False, None,        _Q, 0),
    Operand("k",     QK, "b", "k",  -1, _D,  _S, _D,  False, None,        _K, 1),
    Operand("p",     PV, "a", "p",  -1, _N,  _M, _N,  True,  "p_lift",    _Q, 3),
    Operand("v",     PV, "b", "v",  -2, _S,  _S, _DV, False, None,        _K, 2),
    Operand("dv_p",  DV, "a", "p",  -2, _M,  _M, _N,  True,  "dv_p_lift", _Q, 4),
    Operand("dv_do", DV, "b", "do", -2, _S,  _S, _DV, False, None,        _Q, 5),
    Operand("dp_do", DP, "a", "do", -1, _DV, _S, _DV, False, None,        _Q, 6),
    Operand("dp_v",  DP, "b", "v",  -1, _DV, _S, _DV, False, None,        _K, 7),
    Operand("dq_ds", DQ, "a", "ds", -1, _N,  _M, _N,  True,  "ds_lift",   _Q, 8),
    Operand("dq_k",  DQ, "b", "k",  -2, _S,  _S, _D,  False, None,        _K, 9),
    Operand("dk_ds", DK, "a", "ds", -2, _M,  _M, _N,  True,  "ds_lift",   _Q, 10),
    Operand("dk_q",  DK, "b", "q",  -2, _S,  _S, _D,  False, None,        _Q, 11),
)
# fmt: on

OPERAND_FIELDS = tuple(o.field for o in OPERANDS)
_BY_FIELD = {o.field: o for o in OPERANDS}
_BY_PRODUCT = {p: tuple(o for o in OPERANDS if o.product is p) for p in Product}


def operand(field: str) -> Operand:
    """The `Operand` of a recipe field ("q", "dv_p", ...)."""
    try:
        return _BY_FIELD[field]
    except KeyError:
        raise ValueError(
            f"field must be one of {', '.join(OPERAND_FIELDS)}; got {field!r}"
        ) from None
