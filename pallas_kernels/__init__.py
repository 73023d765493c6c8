"""Pallas kernels for jaxinfer, each with a jnp reference: attention (GPU Triton + TPU Mosaic),
the batch-invariant matmul of deterministic mode, the int8 / int4 weight matmuls (GPU
Triton) and the residual-add / RMSNorm junction before them (``junction``), and the
int8 / fp8 K/V page format the paged and ragged kernels read (``kv_quant``)."""

from pallas_kernels._common import (
    SUPPORTED_HEAD_DIMS,
    combine_splits,
    combine_splits_reference,
    interpret_here,
    largest_divisor,
)
from pallas_kernels.decode_attention import (
    decode_attention,
    decode_attention_layer,
    decode_attention_layer_reference,
    decode_attention_reference,
)
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.int4_matmul import (
    INT4_GEMV_ROWS,
    int4_matmul,
    int4_matmul_reference,
    int4_reads_pairs,
)
from pallas_kernels.junction import (
    ScaledPairs,
    add_norm_pairs,
    add_norm_pairs_reference,
    silu_mul_pairs,
    silu_mul_pairs_reference,
    sum_rope,
    sum_rope_reference,
)
from pallas_kernels.kv_quant import (
    KV_CACHE_DTYPES,
    SCALE_DTYPE,
    dequantize_kv,
    hadamard_rotate,
    quantize_kv,
    rotates_keys,
)
from pallas_kernels.matmul import (
    GEMV_ROWS,
    int8_matmul,
    int8_matmul_reference,
    int8_reads_pairs,
    matmul,
    matmul_reference,
    row_sum,
    row_sum_reference,
)
from pallas_kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    paged_attention_write,
    paged_attention_write_reference,
    paged_decode_launch,
    store_new_tokens,
)
from pallas_kernels.ragged_attention import ragged_attention, ragged_attention_reference
from pallas_kernels.word_gemv import WIDE_BLOCK_N

__all__ = [
    "GEMV_ROWS",
    "KV_CACHE_DTYPES",
    "SCALE_DTYPE",
    "INT4_GEMV_ROWS",
    "ScaledPairs",
    "SUPPORTED_HEAD_DIMS",
    "WIDE_BLOCK_N",
    "add_norm_pairs",
    "add_norm_pairs_reference",
    "combine_splits",
    "combine_splits_reference",
    "decode_attention",
    "decode_attention_layer",
    "decode_attention_layer_reference",
    "decode_attention_reference",
    "dequantize_kv",
    "flash_attention",
    "flash_attention_reference",
    "hadamard_rotate",
    "int4_matmul",
    "int4_matmul_reference",
    "int4_reads_pairs",
    "int8_matmul",
    "int8_matmul_reference",
    "int8_reads_pairs",
    "interpret_here",
    "largest_divisor",
    "matmul",
    "matmul_reference",
    "row_sum",
    "row_sum_reference",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_write",
    "paged_attention_write_reference",
    "paged_decode_launch",
    "quantize_kv",
    "ragged_attention",
    "ragged_attention_reference",
    "rotates_keys",
    "silu_mul_pairs",
    "silu_mul_pairs_reference",
    "sum_rope",
    "sum_rope_reference",
    "store_new_tokens",
]
