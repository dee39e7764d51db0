"""How many KV cache blocks a model gets: as many megabytes as asked, else a share of the backend's
free memory, never more than the engine could ever fill."""

from __future__ import annotations

from dataclasses import dataclass

from candelabra.core.contract.kv_cache import KVCacheSpec


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int
    chosen_by: str  # how the size was chosen, for the start-up line


def model_kv_cache(model, num_blocks: int, block_size: int, kv_dtype: str) -> KVCacheSpec:
    """`model`'s KV cache of `num_blocks` blocks, all layers (its own KV heads, under tensor parallelism;
    a latent cache for a model with latent attention)."""
    kv_heads, key_width, value_width = model.kv_cache_dims()
    return KVCacheSpec(model.config.num_layers, num_blocks, block_size, kv_heads, key_width, kv_dtype, value_width)


def one_block(model, block_size: int, kv_dtype: str) -> KVCacheSpec:
    """The cache of one block, all layers, for `model`."""
    return model_kv_cache(model, 1, block_size, kv_dtype)


def blocks_in(memory_mb: float, block: KVCacheSpec, flag: str) -> int:
    """How many blocks `memory_mb` megabytes hold; ValueError naming `flag` when not one."""
    blocks = int(memory_mb * 2**20) // block.bytes_per_block
    if blocks < 1:
        raise ValueError(f"{flag} ({memory_mb:g} MB) holds no KV cache block: one block of {block.block_size} tokens "
                         f"takes {block.bytes_per_block / 2**20:.3g} MB")
    return blocks


def check_kv_fraction(fraction: float, flag: str = "kv_fraction") -> float:
    if not 0 < fraction <= 1:
        raise ValueError(f"{flag} is a share of the free memory, more than 0 and at most 1, not {fraction:g}")
    return fraction


def device_cache_size(backend, block: KVCacheSpec, kvcache_mem_gpu: float | None, kv_fraction: float | None,
                      max_num_seqs: int, max_model_len: int) -> KVCacheSize:
    """`kvcache_mem_gpu` MB when given; else `kv_fraction` (default: the backend's
    `kv_cache_fraction()`) of `backend.free_memory()`, capped at the blocks `max_num_seqs`
    sequences of `max_model_len` tokens can fill, since more would only ever hold cached prefixes."""
    if kvcache_mem_gpu is not None:
        blocks = blocks_in(kvcache_mem_gpu, block, "kvcache_mem_gpu")
        return KVCacheSize(blocks, f"kvcache_mem_gpu {kvcache_mem_gpu:g} MB")
    fraction = check_kv_fraction(backend.kv_cache_fraction() if kv_fraction is None else kv_fraction)
    free = backend.free_memory()
    share = f"{fraction:g} of the {_in_words(free)} free on {backend.name}"
    blocks = int(fraction * free) // block.bytes_per_block
    if blocks < 1:
        raise ValueError(f"the KV cache, {share}, holds no block: one block of {block.block_size} tokens takes "
                         f"{block.bytes_per_block / 2**20:.3g} MB; give kvcache_mem_gpu in MB")
    chosen_by = share + (" (kv_fraction)" if kv_fraction is not None else " (the backend's default share)")
    most = max_num_seqs * -(-max_model_len // block.block_size)
    if blocks > most:
        blocks = most
        chosen_by += f", capped at what {max_num_seqs} sequences of {max_model_len} tokens can fill"
    return KVCacheSize(blocks, chosen_by)


def _in_words(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"
