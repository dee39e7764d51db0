"""The shape of the paged KV cache and how many blocks fit in a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

from candelabra.core.contract.dtypes import QUANTIZED_KV_DTYPES, KVDType, check_kv_dtype

BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8": 1}
# A quantized cache's row (one token's key or value in one KV head) is its codes, one byte each, then
# its float32 scale's 4 bytes (little-endian), so the cache tensors are bytes [..., dim + 4]: "int8"
# codes are signed bytes (int8 tensors), "fp8" codes float8 e4m3fn bits (uint8 tensors). Copying,
# swapping and moving blocks copy those bytes and need nothing else.
KV_SCALE_BYTES = 4
KV_STORAGE_DTYPES = {"int8": "int8", "fp8": "uint8"}


@dataclass(frozen=True)
class KVCacheSpec:
    """Per layer, key is [num_blocks, block_size, num_kv_heads, head_dim] and value the same with
    `value_dim` (head_dim when not given) last.

    A model with multi-head latent attention (DeepSeek V2/V3) asks for a latent cache: one KV head, the
    shared rotary key as `key` (head_dim = its rotary width) and the compressed latent as `value`
    (value_dim = its rank), read by `Ops.paged_latent_attention`.

    In a quantized `dtype` ("int8", "fp8") the tensors hold bytes, each row its codes then its scale
    (KV_SCALE_BYTES): `block_shape` and `value_block_shape` are then [.., head_dim + 4] and
    [.., value_dim + 4], in `storage_dtype`."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: KVDType = "float32"
    value_dim: int | None = None

    def __post_init__(self) -> None:
        check_kv_dtype(self.dtype)
        if self.value_dim is None:
            object.__setattr__(self, "value_dim", self.head_dim)
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "value_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_KV_DTYPES

    @property
    def storage_dtype(self) -> str:
        """The element type of the cache tensors: the dtype itself, or the byte type a quantized cache's
        rows are stored in."""
        return KV_STORAGE_DTYPES.get(self.dtype, self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """The key cache's shape (and the value cache's, unless value_dim differs: `value_block_shape`)."""
        return (self.num_blocks, self.block_size, self.num_kv_heads, self._row_width(self.head_dim))

    @property
    def value_block_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, self.num_kv_heads, self._row_width(self.value_dim))

    @property
    def bytes_per_token(self) -> int:
        """Key and value of one token, over all layers."""
        row_elements = self._row_width(self.head_dim) + self._row_width(self.value_dim)
        return self.num_layers * self.num_kv_heads * row_elements * BYTES_PER_ELEMENT[self.dtype]

    def _row_width(self, dim: int) -> int:
        return dim + KV_SCALE_BYTES if self.quantized else dim

    @property
    def bytes_per_block(self) -> int:
        """Key and value of one block, over all layers."""
        return self.block_size * self.bytes_per_token

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

