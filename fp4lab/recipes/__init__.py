"""What both execution paths share: attention recipes, their operands, presets, the trace.

`fp4lab.analysis` (the simulation path) and `fp4lab.kernels` (the Triton path) both read an
`AttentionRecipe` and write a `Trace`; this package defines them and imports nothing of
fp4lab but `fp4lab.formats`, so the kernels can use it without loading the reference.
"""

from fp4lab.recipes.operands import OPERAND_FIELDS, OPERANDS, Extent, Operand, Product, Seq, operand
from fp4lab.recipes.presets import (
    ATTN_QAT,
    ATTN_QAT_DROPIN,
    CROISSATTN,
    EXACT,
    FA3_FP8,
    FA4FP4_CAUSAL,
    FA4FP4_CAUSAL_MXFP4PV,
    FA4FP4_DIRECTP,
    FLASH_BF16,
    FP8_PER_TENSOR,
    PRESETS,
    SAGEATTN3,
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
    "resolve_recipe", "Product", "Operand", "OPERANDS", "OPERAND_FIELDS",
    "Extent", "Seq", "operand", "Trace", "TraceCall", "Column", "COLUMNS", "ID_COLUMNS",
    "OPERAND_COLUMNS", "PRODUCT_COLUMNS", "OUT_COLUMNS", "STATISTICS", "column", "PRESETS", "EXACT", "FLASH_BF16", "FP8_PER_TENSOR", "FA3_FP8", "SAGEATTN3",
    "ATTN_QAT_DROPIN", "ATTN_QAT", "FA4FP4_DIRECTP", "FA4FP4_CAUSAL", "FA4FP4_CAUSAL_MXFP4PV",
    "CROISSATTN",
]
