"""The shape of the paged KV cache and how many blocks fit in a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

from candelabra.core.contract.dtypes import DType, check_dtype

BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVCacheSpec:
    """Per layer, key is [num_blocks, block_size, num_kv_heads, head_dim] and value the same with
    `value_dim` (head_dim when not given) last.

    A model with multi-head latent attention (DeepSeek V2/V3) asks for a latent cache: one KV head, the
    shared rotary key as `key` (head_dim = its rotary width) and the compressed latent as `value`
    (value_dim = its rank), read by `Ops.paged_latent_attention`."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: DType = "float32"
    value_dim: int | None = None

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        if self.value_dim is None:
            object.__setattr__(self, "value_dim", self.head_dim)
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "value_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """The key cache's shape (and the value cache's, unless value_dim differs: `value_block_shape`)."""
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def value_block_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.value_dim)

    @property
    def bytes_per_token(self) -> int:
        """Key and value of one token, over all layers."""
        per_layer = self.num_kv_heads * (self.head_dim + self.value_dim) * BYTES_PER_ELEMENT[self.dtype]
        return self.num_layers * per_layer

    @property
    def bytes_per_block(self) -> int:
        """Key and value of one block, over all layers."""
        return self.block_size * self.bytes_per_token

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

