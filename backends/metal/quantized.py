"""GPTQ's and AWQ's grouped int4 weights kept as MLX quantized arrays, multiplied by `mx.quantized_matmul`.

MLX's affine 4-bit layout is w = scale * q + bias per group along K, with eight values to a uint32,
value i of the eight in bits 4i to 4i + 3. A grouped int4 block's nibble bytes (value 2i in the low
nibble of byte i) read as little-endian uint32 are that packing already, so only the header changes:
w = (q - z) * s gives scale = s and bias = -z * s. MLX takes groups of 32, 64 and 128: a group of 256
becomes two of 128 sharing a scale and bias. An act-order weight's columns stay in their stored order
and x's columns are taken in that order first.

Scales and biases are float32, and so is the product, rounded to x's dtype once: MLX multiplies in the
scales' dtype, and its CPU build accumulated a bfloat16 product in bfloat16 (INT4_G128, 256 x 1024, 3
rows: NMSE 1.6e-3 against its own weight's values, 2.4e-5 in float16; 8.7e-6 and 7.5e-8 with float32
scales, the output's rounding). Float32 scales cost 8 bytes a group, 0.06 bits a weight at 128.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from candelabra.core.contract.weights import INT4_GROUP_FORMATS, QuantizedTensor, int4_group_fields

# Group sizes mx.quantized_matmul takes.
MLX_GROUP_SIZES = (32, 64, 128)


class MlxInt4Weight:
    """A [N, K] weight for x @ W.T in compute dtype `dtype`: packed uint32 [N, K / 8], scales and biases
    float32 [N, K / group_size], and the stored columns' order (None where they are the weight's own)."""

    def __init__(self, packed, scales, biases, group_size: int, shape: tuple[int, int], dtype,
                 column_order=None) -> None:
        self.packed = packed
        self.scales = scales
        self.biases = biases
        self.group_size = group_size
        self.shape = shape
        self.dtype = dtype
        self.column_order = column_order  # int32 [K]: stored column j is weight column column_order[j]

    @classmethod
    def from_quantized(cls, weight: QuantizedTensor, dtype) -> MlxInt4Weight:
        """`weight`, 2-D in a grouped int4 format, for compute dtype `dtype` (an MLX dtype)."""
        group = INT4_GROUP_FORMATS.get(weight.format)
        if group is None or len(weight.shape) != 2:
            raise ValueError(f"MLX int4 weights are 2-D grouped int4 weights ({', '.join(INT4_GROUP_FORMATS)}), "
                             f"not {weight.format} {list(weight.shape)}")
        rows, columns = weight.shape
        packed, scales, zeros = int4_group_fields(weight.blocks, group)
        packed = np.ascontiguousarray(packed).reshape(rows, columns // 2)
        mlx_group = min(group, MLX_GROUP_SIZES[-1])
        repeats = group // mlx_group
        scales, biases = np.repeat(scales, repeats, axis=1), np.repeat(-zeros * scales, repeats, axis=1)
        order = None if weight.column_order is None else mx.array(weight.column_order.astype(np.int32))
        return cls(mx.array(packed.view("<u4")), mx.array(scales), mx.array(biases), mlx_group, (rows, columns),
                   dtype, order)

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in (self.packed, self.scales, self.biases))

    def matmul(self, x):
        """x [..., K] to x @ W.T [..., N] in x's dtype."""
        if self.column_order is not None:
            x = mx.take(x, self.column_order, axis=-1)
        out = mx.quantized_matmul(x, self.packed, self.scales, self.biases, transpose=True,
                                  group_size=self.group_size, bits=4)
        return out.astype(x.dtype)

    def dense(self):
        """The weight's values [N, K] in the compute dtype, in its own column order."""
        stored = mx.dequantize(self.packed, self.scales, self.biases, group_size=self.group_size, bits=4)
        stored = stored.astype(self.dtype)
        if self.column_order is None:
            return stored
        return mx.take(stored, mx.argsort(self.column_order), axis=1)
