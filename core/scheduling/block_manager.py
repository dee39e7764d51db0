"""Decides which blocks of the paged KV cache each sequence's tokens live in.

The cache is split into blocks of `block_size` token slots. A sequence's block table lists its
blocks in order: token i sits in slot `i % block_size` of block `table[i // block_size]`. This
module only keeps the books; the engine moves the data, following the copy pairs that `append`,
`swap_out` and `swap_in` return.

Sharing: a block may be held by several sequences (after `fork`, or when a prompt starts with
content already in the cache); its reference count says by how many. A shared block is never
written: a sequence about to write into a shared, partly filled block first gets its own copy.

Prefix caching: once the KV of a full block is computed (`mark_computed`), the block is
registered under a hash of its tokens chained with the hash of the block before it, so the hash
names the whole prefix up to the block's end. A new prompt reuses the longest run of leading
blocks whose hashes are registered. A registered block that no sequence holds any more keeps its
content and is taken for new data only when no truly free block is left, least recently used
first.

Where the cache's memory is committed only when first written (host RAM), `reuse_written_first`
changes that order: a new block is a free one written before, else the least recently used cached
one, and a never written block only when neither is left. The prefix cache then lives in the
memory the busiest moment needed instead of growing, block by block, to the whole cache.

Swapping: `swap_out` moves a group of sequences to host blocks and `swap_in` brings them back to
new device blocks; blocks shared inside the group stay shared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from candelabra.core.requests.sequence import PENDING_TOKEN

_ROOT_HASH = b""


class BlockManagerError(ValueError):
    """A call the block manager cannot honour: unknown sequence, wrong state, bad argument."""


class OutOfBlocksError(BlockManagerError):
    """Not enough free device or host blocks; ask the matching `can_*` method first."""


def _chain_hash(previous: bytes, block_tokens: Sequence[int]) -> bytes:
    # A cryptographic digest: with a weak hash, a crafted prompt could collide with another
    # user's prefix and be served that user's KV.
    data = previous + np.asarray(block_tokens, dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass
class _SequenceBlocks:
    """The blocks of one sequence. Its tokens are the engine's to keep: here only how many there
    are, the chained hash of each full block, and, while prefix caching, the tokens of the last
    block not yet full, which its hash will need."""

    num_tokens: int
    # int32, so that a step's block tables reach numpy as copies of memory, not element by element
    block_table: array
    # Host blocks while swapped out (block_table is then empty), else None.
    host_table: list[int] | None = None
    num_computed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    unhashed_tokens: list[int] = field(default_factory=list)
    # Leading blocks already offered to the prefix cache.
    num_offered_blocks: int = 0

    @property
    def swapped(self) -> bool:
        return self.host_table is not None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, reuse_written_first: bool = False):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 0 or num_host_blocks < 0:
            raise ValueError(f"block counts must be >= 0, got num_blocks={num_blocks}, "
                             f"num_host_blocks={num_host_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.reuse_written_first = reuse_written_first

        self._ref_counts = [0] * num_blocks
        # Free blocks written before, the last freed on top: its memory is the likeliest still warm.
        self._free: list[int] = []
        self._never_written = deque(range(num_blocks))
        # Registered blocks no sequence holds, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_by_hash: dict[bytes, int] = {}
        self._hash_by_block: dict[int, bytes] = {}

        self._host_ref_counts = [0] * num_host_blocks
        self._free_host = deque(range(num_host_blocks))

        self._seqs: dict[int, _SequenceBlocks] = {}

    # ---- counts

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._never_written) + len(self._evictable)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        if self.num_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- sequence lifetime

    def can_allocate(self, token_ids: Sequence[int], max_cached_tokens: int | None = None) -> bool:
        if len(token_ids) == 0:
            return False
        _, _, needed, available = self._plan_allocation(token_ids, max_cached_tokens)
        return needed <= available

    def allocate(self, seq_id: int, token_ids: Sequence[int], max_cached_tokens: int | None = None) -> int:
        """Blocks for a new sequence's whole prompt. Returns how many leading prompt tokens are
        already in the cache (their KV need not be computed): at most `max_cached_tokens`, when given."""
        self._check_new(seq_id)
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise BlockManagerError(f"sequence {seq_id}: the prompt is empty")
        hits, hashes, needed, available = self._plan_allocation(tokens, max_cached_tokens)
        if needed > available:
            raise OutOfBlocksError(
                f"sequence {seq_id}: a prompt of {len(tokens)} tokens needs {needed} more blocks "
                f"({len(hits)} reused from the prefix cache), but only {available} are free")
        # Hits first: taking new blocks may evict, and must not evict what is about to be reused.
        for block in hits:
            self._hold(block)
        table = array("i", hits + [self._take_block() for _ in range(needed)])
        num_cached_tokens = len(hits) * self.block_size
        seq = _SequenceBlocks(0, table, num_computed=num_cached_tokens, block_hashes=hashes,
                              num_offered_blocks=len(hits))
        seq.num_tokens = len(hashes) * self.block_size
        self._add_tokens(seq, tokens[seq.num_tokens:])
        self._seqs[seq_id] = seq
        return num_cached_tokens

    def mark_computed(self, seq_id: int, num_computed_tokens: int) -> None:
        """The KV of the sequence's first `num_computed_tokens` tokens is now in the cache."""
        seq = self._device_sequence(seq_id)
        if not 0 <= num_computed_tokens <= seq.num_tokens:
            raise BlockManagerError(f"sequence {seq_id} has {seq.num_tokens} tokens, "
                                    f"cannot mark {num_computed_tokens} computed")
        seq.num_computed = max(seq.num_computed, num_computed_tokens)
        self._offer_computed_blocks(seq)

    def can_append(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        seq = self._device_sequence(seq_id)
        return self._blocks_to_append(seq, num_new_tokens) <= self.num_free_blocks

    def append(self, seq_id: int, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Grows the sequence by `token_ids`. Returns (source, destination) block copies to make
        before the new tokens' KV is written."""
        copies = self.append_if_room(seq_id, token_ids)
        if copies is None:
            needed = self._blocks_to_append(self._device_sequence(seq_id), len(token_ids))
            raise OutOfBlocksError(f"sequence {seq_id}: {len(token_ids)} more tokens need {needed} blocks, "
                                   f"but only {self.num_free_blocks} are free")
        return copies

    def append_if_room(self, seq_id: int, token_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """`append` where the free blocks hold the new tokens; else None, and nothing changes."""
        seq = self._device_sequence(seq_id)
        tokens = [int(t) for t in token_ids]
        if self._blocks_to_append(seq, len(tokens)) > self.num_free_blocks:
            return None
        copies = []
        if tokens and self._last_block_is_shared_and_partial(seq):
            shared = seq.block_table[-1]
            own = self._take_block()
            self._release(shared)
            seq.block_table[-1] = own
            copies.append((shared, own))
        self._add_tokens(seq, tokens)
        while len(seq.block_table) < self._blocks_for(seq.num_tokens):
            seq.block_table.append(self._take_block())
        return copies

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent and starts with the same tokens."""
        parent = self._sequence(parent_id)
        self._check_new(child_id)
        if parent.swapped:
            for host_block in parent.host_table:
                self._host_ref_counts[host_block] += 1
        for block in parent.block_table:
            self._ref_counts[block] += 1
        self._seqs[child_id] = _SequenceBlocks(
            parent.num_tokens, array("i", parent.block_table),
            host_table=None if parent.host_table is None else list(parent.host_table),
            num_computed=parent.num_computed, block_hashes=list(parent.block_hashes),
            unhashed_tokens=list(parent.unhashed_tokens), num_offered_blocks=parent.num_offered_blocks)

    def free(self, seq_id: int) -> None:
        seq = self._sequence(seq_id)
        del self._seqs[seq_id]
        if seq.swapped:
            for host_block in seq.host_table:
                self._release_host(host_block)
        else:
            self._release_table(seq.block_table)

    # ---- queries

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        return self._device_sequence(seq_id).block_table.tolist()

    def block_table_array(self, seq_id: int) -> np.ndarray:
        """The block table as an int32 array of its own (a copy)."""
        return np.frombuffer(self._device_sequence(seq_id).block_table, dtype=np.int32).copy()

    def num_tokens(self, seq_id: int) -> int:
        return self._sequence(seq_id).num_tokens

    def is_swapped(self, seq_id: int) -> bool:
        return self._sequence(seq_id).swapped

    # ---- swapping

    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        """False also when a block of these sequences is held by a sequence outside them."""
        seqs = self._group(seq_ids, swapped=False)
        refs = Counter(block for seq in seqs for block in seq.block_table)
        return self._held_only_by_group(refs) and len(refs) <= self.num_free_host_blocks

    def swap_out(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Moves the sequences to host blocks. Returns the (device, host) block copies to make."""
        seq_ids = list(seq_ids)
        seqs = self._group(seq_ids, swapped=False)
        refs = Counter(block for seq in seqs for block in seq.block_table)
        if not self._held_only_by_group(refs):
            raise BlockManagerError(f"sequences {seq_ids} share blocks with sequences outside them; "
                                    "swap them out together")
        if len(refs) > self.num_free_host_blocks:
            raise OutOfBlocksError(f"sequences {seq_ids} need {len(refs)} host blocks, "
                                   f"but only {self.num_free_host_blocks} are free")
        host_of = {}
        for block, count in refs.items():
            host_block = self._free_host.popleft()
            self._host_ref_counts[host_block] = count
            host_of[block] = host_block
        for seq in seqs:
            seq.host_table = [host_of[block] for block in seq.block_table]
            # The content stays valid, so registered blocks remain reusable prefix cache.
            self._release_table(seq.block_table)
            seq.block_table = array("i")
        return list(host_of.items())

    def can_swap_in(self, seq_ids: Iterable[int]) -> bool:
        seqs = self._group(seq_ids, swapped=True)
        distinct = {host_block for seq in seqs for host_block in seq.host_table}
        return len(distinct) <= self.num_free_blocks

    def swap_in(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Brings the sequences back to device blocks. Returns the (host, device) block copies to
        make."""
        seq_ids = list(seq_ids)
        seqs = self._group(seq_ids, swapped=True)
        refs = Counter(host_block for seq in seqs for host_block in seq.host_table)
        if len(refs) > self.num_free_blocks:
            raise OutOfBlocksError(f"sequences {seq_ids} need {len(refs)} blocks, "
                                   f"but only {self.num_free_blocks} are free")
        device_of = {}
        for host_block, count in refs.items():
            block = self._take_block()
            self._ref_counts[block] = count
            device_of[host_block] = block
            self._host_ref_counts[host_block] -= count
            if self._host_ref_counts[host_block] == 0:
                self._free_host.append(host_block)
        for seq in seqs:
            seq.block_table = array("i", [device_of[host_block] for host_block in seq.host_table])
            seq.host_table = None
            # The prefix cache may have dropped these blocks' content meanwhile; offer it again.
            seq.num_offered_blocks = 0
            self._offer_computed_blocks(seq)
        return list(device_of.items())

    # ---- internals

    def _sequence(self, seq_id: int) -> _SequenceBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise BlockManagerError(f"unknown sequence {seq_id}") from None

    def _device_sequence(self, seq_id: int) -> _SequenceBlocks:
        seq = self._sequence(seq_id)
        if seq.swapped:
            raise BlockManagerError(f"sequence {seq_id} is swapped out; swap it in first")
        return seq

    def _check_new(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise BlockManagerError(f"sequence {seq_id} already exists")

    def _group(self, seq_ids: Iterable[int], swapped: bool) -> list[_SequenceBlocks]:
        seq_ids = list(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise BlockManagerError(f"sequences {seq_ids} are listed more than once")
        seqs = [self._sequence(seq_id) for seq_id in seq_ids]
        for seq_id, seq in zip(seq_ids, seqs):
            if seq.swapped != swapped:
                state = "already swapped out" if seq.swapped else "not swapped out"
                raise BlockManagerError(f"sequence {seq_id} is {state}")
        return seqs

    def _held_only_by_group(self, refs: Counter) -> bool:
        return all(self._ref_counts[block] == count for block, count in refs.items())

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _plan_allocation(self, token_ids: Sequence[int],
                         max_cached_tokens: int | None = None) -> tuple[list[int], list[bytes], int, int]:
        """(reused blocks, their hashes, new blocks needed, blocks available for them)."""
        hits, hashes = self._prefix_hits(token_ids)
        if max_cached_tokens is not None:
            reusable = max_cached_tokens // self.block_size
            hits, hashes = hits[:reusable], hashes[:reusable]
        needed = self._blocks_for(len(token_ids)) - len(hits)
        available = self.num_free_blocks - sum(block in self._evictable for block in hits)
        return hits, hashes, needed, available

    def _prefix_hits(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        if not self.enable_prefix_caching:
            return [], []
        hits, hashes = [], []
        previous = _ROOT_HASH
        # The last prompt token is always computed (its logits are needed), so the block holding
        # it is never reused, even when registered.
        for index in range((len(token_ids) - 1) // self.block_size):
            start = index * self.block_size
            previous = _chain_hash(previous, token_ids[start:start + self.block_size])
            block = self._block_by_hash.get(previous)
            if block is None:
                break
            hits.append(block)
            hashes.append(previous)
        return hits, hashes

    def _add_tokens(self, seq: _SequenceBlocks, tokens: list[int]) -> None:
        seq.num_tokens += len(tokens)
        if not self.enable_prefix_caching:
            return
        seq.unhashed_tokens += tokens
        self._hash_full_blocks(seq)

    def _hash_full_blocks(self, seq: _SequenceBlocks) -> None:
        """Hash the full blocks of the unhashed tokens, up to the first that holds a pending token."""
        pending, size = seq.unhashed_tokens, self.block_size
        hashed = 0
        while hashed + size <= len(pending):
            block_tokens = pending[hashed:hashed + size]
            if PENDING_TOKEN in block_tokens:
                break
            seq.block_hashes.append(_chain_hash(seq.block_hashes[-1] if seq.block_hashes else _ROOT_HASH,
                                                block_tokens))
            hashed += size
        if hashed:
            seq.unhashed_tokens = pending[hashed:]

    def resolve_pending(self, seq_id: int, token_id: int) -> None:
        """The sequence's earliest pending token (appended as PENDING_TOKEN) is `token_id`: the blocks
        it completes are hashed, and offered to the prefix cache where computed."""
        seq = self._sequence(seq_id)
        if not self.enable_prefix_caching:
            return
        try:
            seq.unhashed_tokens[seq.unhashed_tokens.index(PENDING_TOKEN)] = int(token_id)
        except ValueError:
            raise BlockManagerError(f"sequence {seq_id} has no pending token") from None
        self._hash_full_blocks(seq)
        if not seq.swapped:
            self._offer_computed_blocks(seq)

    def _offer_computed_blocks(self, seq: _SequenceBlocks) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed // self.block_size, len(seq.block_hashes))
        for index in range(seq.num_offered_blocks, num_full):
            block_hash = seq.block_hashes[index]
            # Another block may already hold the same content; the first one registered stays.
            if block_hash not in self._block_by_hash:
                block = seq.block_table[index]
                self._block_by_hash[block_hash] = block
                self._hash_by_block[block] = block_hash
        seq.num_offered_blocks = max(seq.num_offered_blocks, num_full)

    def _last_block_is_shared_and_partial(self, seq: _SequenceBlocks) -> bool:
        return seq.num_tokens % self.block_size != 0 and self._ref_counts[seq.block_table[-1]] > 1

    def _blocks_to_append(self, seq: _SequenceBlocks, num_new_tokens: int) -> int:
        if num_new_tokens < 0:
            raise BlockManagerError(f"cannot append {num_new_tokens} tokens")
        needed = self._blocks_for(seq.num_tokens + num_new_tokens) - len(seq.block_table)
        if num_new_tokens > 0 and self._last_block_is_shared_and_partial(seq):
            needed += 1
        return needed

    def _hold(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._evictable[block]
        self._ref_counts[block] += 1

    def _take_block(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._never_written and not (self.reuse_written_first and self._evictable):
            block = self._never_written.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_by_hash[self._hash_by_block.pop(block)]
        self._ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if block in self._hash_by_block:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _release_table(self, block_table: array) -> None:
        # Last block first: of blocks freed together, a prefix's head becomes the most recently
        # used and is evicted last, since the blocks after it are useless without it.
        for block in reversed(block_table):
            self._release(block)

    def _release_host(self, host_block: int) -> None:
        self._host_ref_counts[host_block] -= 1
        if self._host_ref_counts[host_block] == 0:
            self._free_host.append(host_block)
