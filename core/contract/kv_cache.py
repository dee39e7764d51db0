"""The shape of the paged KV cache and how many blocks fit in a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

from candelabra.core.contract.dtypes import DType, check_dtype

BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVCacheSpec:
    """Per layer, key and value are each [num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: DType = "float32"

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Key and value of one block, over all layers."""
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_dim * BYTES_PER_ELEMENT[self.dtype]
        return self.num_layers * per_layer

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

