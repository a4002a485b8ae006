"""What both execution paths share: attention recipes, their operands, presets, the trace.

`fp4lab.analysis` (the simulation path) and `fp4lab.kernels` (the Triton path) both read an
`AttentionRecipe` and write a `Trace`; this package defines them and imports nothing of
fp4lab but `fp4lab.formats`, so the kernels can use it without loading the reference.
"""

from fp4lab.recipes.operands import OPERAND_FIELDS, OPERANDS, Extent, Operand, Product, Seq, operand
from fp4lab.recipes.presets import (
    ATTN_QAT,
    ATTN_QAT_DROPIN,
    ATTN_QAT_KERNEL,
    CROISSATTN,
    CROISSATTN_EDEN,
    EXACT,
    FA3_FP8,
    FA3_FP8_PAPER,
    FA4FP4_CAUSAL,
    FA4FP4_CAUSAL_MXFP4PV,
    FA4FP4_CAUSAL_MXFP4PV_D64,
    FA4FP4_CAUSAL_MXFP4PV_FIXED,
    FA4FP4_CAUSAL_MXFP8PV,
    FA4FP4_DIRECTP,
    FLASH_BF16,
    FP8_PER_TENSOR,
    PRESETS,
    SAGEATTN3,
    SAGEATTN3_PAPER,
)
from fp4lab.recipes.recipe import (
    AttentionRecipe,
    BackwardMode,
    BackwardP,
    BackwardV,
    DeltaSource,
    DsP,
    KVOrder,
    OperandSpec,
    PQuant,
    RowReference,
    RowSum,
    SmoothK,
    TensorScope,
    resolve_recipe,
)
from fp4lab.recipes.trace import (
    COLUMNS,
    ID_COLUMNS,
    OPERAND_COLUMNS,
    OUT_COLUMNS,
    PRODUCT_COLUMNS,
    STATISTICS,
    Column,
    Trace,
    TraceCall,
    column,
)

__all__ = [
    "AttentionRecipe", "OperandSpec", "PQuant", "RowReference", "RowSum", "KVOrder", "SmoothK",
    "TensorScope", "BackwardMode", "BackwardP", "BackwardV", "DsP", "DeltaSource",
    "resolve_recipe", "Product", "Operand", "OPERANDS", "OPERAND_FIELDS", "Extent", "Seq",
    "operand", "Trace", "TraceCall", "Column", "COLUMNS", "ID_COLUMNS", "OPERAND_COLUMNS",
    "PRODUCT_COLUMNS", "OUT_COLUMNS", "STATISTICS", "column",
    # presets
    "PRESETS", "EXACT", "FLASH_BF16", "FP8_PER_TENSOR", "FA3_FP8", "FA3_FP8_PAPER", "SAGEATTN3",
    "SAGEATTN3_PAPER", "ATTN_QAT", "ATTN_QAT_KERNEL", "ATTN_QAT_DROPIN", "FA4FP4_CAUSAL",
    "FA4FP4_CAUSAL_MXFP4PV", "FA4FP4_CAUSAL_MXFP4PV_D64", "FA4FP4_CAUSAL_MXFP4PV_FIXED",
    "FA4FP4_CAUSAL_MXFP8PV", "FA4FP4_DIRECTP", "CROISSATTN", "CROISSATTN_EDEN",
]
