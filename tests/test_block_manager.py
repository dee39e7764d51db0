"""The paged-KV block manager: exhaustion, prefix caching, eviction, copy-on-write and swapping.

Most tests drive the manager as the engine would, through `CacheSim`: it writes each token into
its cache slot, applies every copy pair the manager returns, and reads each sequence back, so a
wrong block mapping shows up as wrong content.
"""

from collections import Counter

import numpy as np
import pytest

from candelabra.core.scheduling.block_manager import BlockManager, BlockManagerError, OutOfBlocksError

POISON = "stale"


def assert_consistent(bm: BlockManager) -> None:
    """White-box: every block is in exactly one place and reference counts match the tables."""
    device_refs, host_refs = Counter(), Counter()
    for seq in bm._seqs.values():
        if seq.swapped:
            assert len(seq.block_table) == 0
            host_refs.update(seq.host_table)
        else:
            assert len(set(seq.block_table)) == len(seq.block_table)
            device_refs.update(seq.block_table)
        # The engine keeps the tokens; the manager only the hashes and the last partial block's.
        if bm.enable_prefix_caching:
            assert len(seq.block_hashes) == seq.num_tokens // bm.block_size
            assert len(seq.unhashed_tokens) == seq.num_tokens % bm.block_size
        else:
            assert seq.block_hashes == seq.unhashed_tokens == []
    assert bm._ref_counts == [device_refs[block] for block in range(bm.num_blocks)]
    assert sorted([*bm._free, *bm._never_written, *bm._evictable, *device_refs]) == list(range(bm.num_blocks))
    assert bm._hash_by_block == {block: h for h, block in bm._block_by_hash.items()}
    assert set(bm._evictable) <= set(bm._hash_by_block)
    assert bm.num_free_blocks == bm.num_blocks - len(device_refs)
    assert bm.num_cached_blocks == len(bm._evictable)
    assert bm.usage == pytest.approx(len(device_refs) / bm.num_blocks if bm.num_blocks else 0.0)
    assert bm._host_ref_counts == [host_refs[block] for block in range(bm.num_host_blocks)]
    assert sorted([*bm._free_host, *host_refs]) == list(range(bm.num_host_blocks))


def assert_no_leak(bm: BlockManager) -> None:
    assert_consistent(bm)
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_free_host_blocks == bm.num_host_blocks
    assert bm.usage == 0.0


class CacheSim:
    """The engine's side of the contract, with each token's 'KV' being the token itself."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.bs = bm.block_size
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.host_tables: dict[int, list[int]] = {}

    def allocate(self, seq_id, prompt) -> int:
        cached = self.bm.allocate(seq_id, prompt)
        assert cached % self.bs == 0 and 0 <= cached < len(prompt)
        self.tokens[seq_id] = list(prompt)
        self.computed[seq_id] = cached
        self.check_sequence(seq_id)  # reused blocks must already hold the prompt's tokens
        return cached

    def compute(self, seq_id, upto=None) -> None:
        """One model step: writes the KV of tokens computed[seq_id]:upto."""
        upto = len(self.tokens[seq_id]) if upto is None else upto
        table = self.bm.block_table(seq_id)
        others = {block for other in self.on_device() if other != seq_id for block in self.bm.block_table(other)}
        for position in range(self.computed[seq_id], upto):
            block = table[position // self.bs]
            assert block not in others, f"sequence {seq_id} writes into block {block}, which another one holds"
            self.device.setdefault(block, [POISON] * self.bs)[position % self.bs] = self.tokens[seq_id][position]
        self.computed[seq_id] = max(self.computed[seq_id], upto)
        self.bm.mark_computed(seq_id, upto)

    def append(self, seq_id, new_tokens) -> list[tuple[int, int]]:
        copies = self.bm.append(seq_id, new_tokens)
        for source, destination in copies:
            self.device[destination] = list(self.device[source])
        self.tokens[seq_id].extend(new_tokens)
        return copies

    def fork(self, parent_id, child_id) -> None:
        self.bm.fork(parent_id, child_id)
        self.tokens[child_id] = list(self.tokens[parent_id])
        self.computed[child_id] = self.computed[parent_id]
        if parent_id in self.host_tables:
            self.host_tables[child_id] = list(self.host_tables[parent_id])

    def free(self, seq_id) -> None:
        blocks = [] if seq_id in self.host_tables else self.bm.block_table(seq_id)
        self.bm.free(seq_id)
        del self.tokens[seq_id], self.computed[seq_id]
        self.host_tables.pop(seq_id, None)
        self._poison_released(blocks)

    def swap_out(self, seq_ids) -> list[tuple[int, int]]:
        tables = {seq_id: self.bm.block_table(seq_id) for seq_id in seq_ids}
        pairs = self.bm.swap_out(seq_ids)
        host_of = dict(pairs)
        assert len(host_of) == len(pairs) and len(set(host_of.values())) == len(pairs)
        assert set(host_of) == {block for table in tables.values() for block in table}
        for device_block, host_block in pairs:
            self.host[host_block] = list(self.device.get(device_block, [POISON] * self.bs))
        for seq_id, table in tables.items():
            self.host_tables[seq_id] = [host_of[block] for block in table]
        self._poison_released(host_of)
        return pairs

    def swap_in(self, seq_ids) -> list[tuple[int, int]]:
        pairs = self.bm.swap_in(seq_ids)
        device_of = dict(pairs)
        assert len(device_of) == len(pairs) and len(set(device_of.values())) == len(pairs)
        assert set(device_of) == {host_block for seq_id in seq_ids for host_block in self.host_tables[seq_id]}
        for host_block, device_block in pairs:
            self.device[device_block] = list(self.host[host_block])
        for seq_id in seq_ids:
            assert self.bm.block_table(seq_id) == [device_of[h] for h in self.host_tables.pop(seq_id)]
        return pairs

    def on_device(self) -> list[int]:
        return [seq_id for seq_id in self.tokens if seq_id not in self.host_tables]

    def check_sequence(self, seq_id) -> None:
        tokens, bs = self.tokens[seq_id], self.bs
        assert self.bm.num_tokens(seq_id) == len(tokens)
        assert self.bm.is_swapped(seq_id) == (seq_id in self.host_tables)
        if seq_id in self.host_tables:
            table, store = self.host_tables[seq_id], self.host
        else:
            table, store = self.bm.block_table(seq_id), self.device
        assert len(table) == -(-len(tokens) // bs)
        read = [store[table[p // bs]][p % bs] for p in range(self.computed[seq_id])]
        assert read == tokens[:self.computed[seq_id]], f"sequence {seq_id} reads back wrong KV"

    def check(self) -> None:
        for seq_id in self.tokens:
            self.check_sequence(seq_id)
        assert_consistent(self.bm)

    def free_all(self) -> None:
        for seq_id in list(self.tokens):
            self.free(seq_id)
        assert_no_leak(self.bm)

    def _poison_released(self, blocks) -> None:
        # A truly free block's content is garbage to whoever gets it next; cached ones stay valid.
        for block in blocks:
            if self.bm._ref_counts[block] == 0 and block not in self.bm._hash_by_block:
                self.device[block] = [POISON] * self.bs


@pytest.fixture
def new_manager():
    """Makes managers, and at the end frees whatever the test left and checks nothing leaked."""
    made = []

    def make(num_blocks, block_size=4, num_host_blocks=0, enable_prefix_caching=True, reuse_written_first=False):
        made.append(BlockManager(num_blocks, block_size, num_host_blocks, enable_prefix_caching, reuse_written_first))
        return made[-1]

    yield make
    for bm in made:
        assert_consistent(bm)
        for seq_id in list(bm._seqs):
            bm.free(seq_id)
        assert_no_leak(bm)


@pytest.fixture
def new_sim(new_manager):
    return lambda *args, **kwargs: CacheSim(new_manager(*args, **kwargs))


# ---- allocation and exhaustion


def test_allocation_takes_whole_blocks_until_exhausted(new_manager):
    bm = new_manager(num_blocks=4, block_size=4)
    assert bm.can_allocate(range(16)) and not bm.can_allocate(range(17))
    with pytest.raises(OutOfBlocksError, match="needs 5 more blocks.*only 4 are free"):
        bm.allocate(1, range(17))
    assert bm.num_free_blocks == 4

    assert bm.allocate(1, range(12)) == 0
    assert len(bm.block_table(1)) == 3 and bm.num_tokens(1) == 12
    assert (bm.num_free_blocks, bm.usage) == (1, 0.75)
    assert bm.can_allocate(range(4)) and not bm.can_allocate(range(5))
    assert bm.can_append(1, 4) and not bm.can_append(1, 5)
    with pytest.raises(OutOfBlocksError):
        bm.append(1, range(5))
    assert (bm.num_tokens(1), bm.num_free_blocks) == (12, 1)

    bm.allocate(2, [9] * 4)
    assert bm.num_free_blocks == 0 and not bm.can_allocate([1])
    assert not bm.can_append(1) and bm.can_append(1, 0)
    bm.free(1)
    assert bm.num_free_blocks == 3 and bm.can_allocate(range(12))


def test_misuse_is_rejected_with_a_clear_error(new_manager):
    bm = new_manager(num_blocks=4)
    assert not bm.can_allocate([])
    with pytest.raises(BlockManagerError, match="prompt is empty"):
        bm.allocate(1, [])
    bm.allocate(1, [1, 2, 3])
    with pytest.raises(BlockManagerError, match="sequence 1 already exists"):
        bm.allocate(1, [1])
    with pytest.raises(BlockManagerError, match="sequence 1 already exists"):
        bm.fork(1, 1)
    for call in (bm.free, bm.block_table, bm.num_tokens, bm.is_swapped, lambda s: bm.append(s, [1])):
        with pytest.raises(BlockManagerError, match="unknown sequence 7"):
            call(7)
    with pytest.raises(BlockManagerError, match="has 3 tokens, cannot mark 4 computed"):
        bm.mark_computed(1, 4)
    with pytest.raises(BlockManagerError, match="listed more than once"):
        bm.swap_out([1, 1])
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockManager(4, 0)


# ---- prefix caching


def test_prefix_is_reused_only_after_its_kv_is_computed(new_sim):
    sim = new_sim(num_blocks=12, block_size=4)
    prompt = list(range(10))  # two full blocks and a partial one
    assert sim.allocate(1, prompt) == 0
    assert sim.allocate(2, prompt) == 0, "nothing is computed yet"
    assert not set(sim.bm.block_table(1)) & set(sim.bm.block_table(2))

    sim.compute(1)
    assert sim.allocate(3, prompt) == 8
    a, c = sim.bm.block_table(1), sim.bm.block_table(3)
    assert c[:2] == a[:2] and c[2] != a[2], "full blocks shared, the partial last block never"
    sim.compute(3)
    sim.compute(2)  # same content as 1's blocks: computed, but the first registration stays
    sim.check()
    sim.free_all()


def test_a_fully_cached_prompt_still_leaves_its_last_block_to_compute(new_sim):
    sim = new_sim(num_blocks=8, block_size=4)
    prompt = list(range(8))
    sim.allocate(1, prompt)
    sim.compute(1)
    assert sim.allocate(2, prompt) == 4
    assert sim.bm.block_table(2)[0] == sim.bm.block_table(1)[0]
    assert sim.bm.block_table(2)[1] != sim.bm.block_table(1)[1]
    sim.compute(2)
    sim.check()
    sim.free_all()


def test_chunked_prefill_registers_only_finished_blocks(new_sim):
    sim = new_sim(num_blocks=12, block_size=4)
    prompt = list(range(12))
    sim.allocate(1, prompt)
    sim.compute(1, 6)  # block 1 is half filled
    assert sim.allocate(2, prompt) == 4
    sim.compute(1)
    assert sim.allocate(3, prompt) == 8
    sim.check()
    sim.free_all()


def test_hashes_name_the_whole_prefix_not_one_block(new_sim):
    sim = new_sim(num_blocks=12, block_size=4)
    sim.allocate(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    sim.compute(1)
    assert sim.allocate(2, [0, 0, 0, 0, 5, 6, 7, 8, 9]) == 0, "same second block after another first"
    assert sim.allocate(3, [1, 2, 3, 4, 0, 0, 0, 0, 9]) == 4
    sim.check()
    sim.free_all()


def test_abort_mid_prefill_leaves_nothing_cached(new_sim):
    sim = new_sim(num_blocks=4, block_size=4)
    prompt = list(range(10))
    sim.allocate(1, prompt)
    sim.free(1)
    assert (sim.bm.num_cached_blocks, sim.bm.num_free_blocks) == (0, 4)
    assert sim.allocate(2, prompt) == 0

    sim.compute(2, 5)  # only the first block finished before the abort
    sim.free(2)
    assert (sim.bm.num_cached_blocks, sim.bm.num_free_blocks) == (1, 4)
    assert sim.allocate(3, prompt) == 4
    sim.free_all()


def test_freed_prefix_stays_cached_until_reused(new_sim):
    sim = new_sim(num_blocks=4, block_size=4)
    prompt = list(range(10))
    sim.allocate(1, prompt)
    sim.compute(1)
    sim.free(1)
    assert (sim.bm.num_cached_blocks, sim.bm.num_free_blocks, sim.bm.usage) == (2, 4, 0.0)
    assert sim.allocate(2, prompt) == 8
    assert (sim.bm.num_cached_blocks, sim.bm.num_free_blocks) == (0, 1)
    sim.free_all()


def test_prefix_caching_can_be_turned_off(new_sim):
    sim = new_sim(num_blocks=6, block_size=4, enable_prefix_caching=False)
    sim.allocate(1, list(range(10)))
    sim.compute(1)
    assert sim.allocate(2, list(range(10))) == 0
    sim.free(1)
    assert sim.bm.num_cached_blocks == 0
    sim.free_all()


# ---- eviction


def cached_tokens(sim: CacheSim, prompt, seq_id=99) -> int:
    """How much of `prompt` the cache holds (allocates and frees a probe sequence)."""
    cached = sim.allocate(seq_id, prompt)
    sim.free(seq_id)
    return cached


def test_eviction_takes_free_blocks_first_then_least_recently_used(new_sim):
    sim = new_sim(num_blocks=4, block_size=2)
    for seq_id, prompt in enumerate(([1, 1], [2, 2], [3, 3])):
        sim.allocate(seq_id, prompt)
        sim.compute(seq_id)
        sim.free(seq_id)
    assert (sim.bm.num_cached_blocks, sim.bm.num_free_blocks) == (3, 4)

    # a hit refreshes [1, 1]: least recently used are now [2, 2], then [3, 3], then [1, 1]
    assert sim.allocate(10, [1, 1, 5]) == 2
    assert sim.bm.num_cached_blocks == 2, "the one truly free block was taken, nothing evicted"
    sim.free(10)

    sim.allocate(11, [7] * 6)  # three blocks: the free one, then [2, 2] and [3, 3] evicted
    assert sim.bm.num_cached_blocks == 1
    assert not sim.bm.can_allocate([1, 1, 9]), "its hit is the only evictable block, so no room for more"
    assert sim.bm.can_allocate([1, 1])
    sim.free(11)
    assert cached_tokens(sim, [2, 2, 9]) == 0
    assert cached_tokens(sim, [3, 3, 9]) == 0
    assert cached_tokens(sim, [1, 1, 9]) == 2
    sim.free_all()


def test_a_freed_block_is_taken_again_before_a_never_written_one(new_manager):
    bm = new_manager(num_blocks=8, block_size=2)
    bm.allocate(1, [1, 2, 3])
    first = bm.block_table(1)
    bm.allocate(2, [4])
    bm.free(1)
    bm.allocate(3, [5, 6, 7])
    assert sorted(bm.block_table(3)) == sorted(first), "the freed blocks, not the five never written"


@pytest.mark.parametrize("reuse_written_first", [False, True])
def test_reusing_written_blocks_first_evicts_before_writing_a_fresh_block(new_sim, reuse_written_first):
    sim = new_sim(num_blocks=6, block_size=2, reuse_written_first=reuse_written_first)
    for seq_id, prompt in enumerate(([1, 1, 0], [2, 2, 0])):
        sim.allocate(seq_id, prompt)
        sim.compute(seq_id)
    sim.free(0)
    sim.free(1)
    assert (sim.bm.num_cached_blocks, sim.bm.num_free_blocks, len(sim.bm._never_written)) == (2, 6, 2)

    sim.allocate(10, [7] * 6)  # three blocks: the two partly filled ones freed above, then a third
    if reuse_written_first:
        assert (sim.bm.num_cached_blocks, len(sim.bm._never_written)) == (1, 2)
        assert cached_tokens(sim, [2, 2, 9]) == 2
        assert cached_tokens(sim, [1, 1, 9]) == 0, "the least recently used cached block went first"
    else:
        assert (sim.bm.num_cached_blocks, len(sim.bm._never_written)) == (2, 1)
        assert cached_tokens(sim, [1, 1, 9]) == 2 and cached_tokens(sim, [2, 2, 9]) == 2
    assert sim.bm.can_allocate([8] * 6), "never written blocks are still taken once nothing else is left"
    sim.free_all()


def test_a_prefix_loses_its_tail_before_its_head(new_sim):
    sim = new_sim(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    sim.allocate(1, prompt)
    sim.compute(1)
    sim.free(1)
    assert sim.bm.num_cached_blocks == 2
    sim.allocate(2, [9] * 6)  # two truly free blocks and one eviction
    sim.free(2)
    assert cached_tokens(sim, prompt) == 2
    sim.free_all()


# ---- fork and copy-on-write


def test_fork_then_diverge_copies_the_shared_partial_block_once(new_sim):
    sim = new_sim(num_blocks=8, block_size=4)
    sim.allocate(1, [1, 2, 3, 4, 5, 6])
    sim.compute(1)
    sim.fork(1, 2)
    full, partial = sim.bm.block_table(1)
    assert sim.bm.block_table(2) == [full, partial]
    assert sim.bm.num_tokens(2) == 6

    copies = sim.append(1, [7])
    (source, own), = copies
    assert source == partial and sim.bm.block_table(1) == [full, own]
    sim.compute(1)
    assert sim.append(2, [8]) == [], "the other sharer is now the block's only holder"
    sim.compute(2)
    assert sim.bm.block_table(2) == [full, partial]
    for seq_id, token in ((1, 10), (2, 20), (2, 21)):
        assert sim.append(seq_id, [token]) == []
        sim.compute(seq_id)
    sim.check()

    # forked on a block boundary: nothing to copy, each gets a new block
    sim.fork(1, 3)
    assert sim.append(1, [12]) == [] and sim.append(3, [30]) == []
    sim.compute(1)
    sim.compute(3)
    assert sim.bm.block_table(1)[:2] == sim.bm.block_table(3)[:2]
    assert sim.bm.block_table(1)[2] != sim.bm.block_table(3)[2]
    sim.check()

    sim.free(1)
    sim.check()
    sim.free_all()


def test_copy_on_write_needs_a_free_block(new_manager):
    bm = new_manager(num_blocks=2, block_size=4)
    bm.allocate(1, [1, 2, 3, 4, 5])
    bm.fork(1, 2)
    assert not bm.can_append(1)
    with pytest.raises(OutOfBlocksError):
        bm.append(1, [6])
    assert bm.block_table(1) == bm.block_table(2) and bm.num_tokens(1) == 5


def test_append_if_room_grows_as_append_does_or_changes_nothing(new_manager):
    bm = new_manager(num_blocks=3, block_size=4)
    bm.allocate(1, [1, 2, 3, 4, 5])
    bm.fork(1, 2)
    assert bm.append_if_room(1, [6]) == [(bm.block_table(2)[1], bm.block_table(1)[1])]  # copy-on-write
    assert bm.num_tokens(1) == 6 and bm.num_free_blocks == 0
    table, tokens = bm.block_table(2), bm.num_tokens(2)
    assert bm.append_if_room(2, [7, 8, 9, 10]) is None
    assert (bm.block_table(2), bm.num_tokens(2), bm.num_free_blocks) == (table, tokens, 0)
    assert bm.append_if_room(2, [7, 8, 9]) == []  # its last block is its own now, with room for three
    assert bm.num_tokens(2) == 8


# ---- swapping


def test_swap_out_and_in_round_trip_keeps_content_and_sharing(new_sim):
    sim = new_sim(num_blocks=12, block_size=4, num_host_blocks=8, enable_prefix_caching=False)
    sim.allocate(1, [1, 2, 3, 4, 5, 6])
    sim.compute(1)
    for child in (2, 3):
        sim.fork(1, child)
    for seq_id, new_tokens in ((1, [7, 8, 9]), (2, [20]), (3, [30, 31])):
        sim.append(seq_id, new_tokens)
        sim.compute(seq_id)
    held = {block for seq_id in (1, 2, 3) for block in sim.bm.block_table(seq_id)}

    pairs = sim.swap_out([1, 2, 3])
    assert {device for device, _ in pairs} == held
    assert all(sim.bm.is_swapped(seq_id) for seq_id in (1, 2, 3))
    assert (sim.bm.num_free_blocks, sim.bm.num_free_host_blocks) == (12, 8 - len(held))
    sim.check()

    sim.allocate(4, list(range(100, 112)))  # takes and overwrites device blocks meanwhile
    sim.compute(4)
    sim.swap_in([1, 2, 3])
    assert sim.bm.num_free_host_blocks == 8
    tables = [sim.bm.block_table(seq_id) for seq_id in (1, 2, 3)]
    assert tables[0][0] == tables[1][0] == tables[2][0], "the shared first block is still shared"
    sim.check()

    for seq_id in (1, 2, 3):
        sim.append(seq_id, [seq_id * 100])
        sim.compute(seq_id)
    sim.check()
    sim.free_all()


def test_swap_out_needs_host_space(new_manager):
    bm = new_manager(num_blocks=4, block_size=4, num_host_blocks=1)
    bm.allocate(1, range(6))
    assert not bm.can_swap_out([1])
    with pytest.raises(OutOfBlocksError, match="need 2 host blocks, but only 1 are free"):
        bm.swap_out([1])
    assert not bm.is_swapped(1) and bm.num_free_host_blocks == 1 and len(bm.block_table(1)) == 2


def test_swap_in_needs_device_space(new_sim):
    sim = new_sim(num_blocks=2, block_size=4, num_host_blocks=4)
    sim.allocate(1, list(range(6)))
    sim.compute(1)
    sim.swap_out([1])
    sim.allocate(2, list(range(50, 58)))
    assert not sim.bm.can_swap_in([1])
    with pytest.raises(OutOfBlocksError):
        sim.bm.swap_in([1])
    sim.free(2)
    assert sim.bm.can_swap_in([1])
    sim.swap_in([1])
    sim.check()
    sim.free_all()


def test_swapping_out_blocks_shared_with_an_outsider_is_refused(new_manager):
    bm = new_manager(num_blocks=8, block_size=4, num_host_blocks=8)
    bm.allocate(1, range(6))
    bm.fork(1, 2)
    assert not bm.can_swap_out([1])
    with pytest.raises(BlockManagerError, match="share blocks with sequences outside them"):
        bm.swap_out([1])
    assert not bm.is_swapped(1) and bm.num_free_host_blocks == 8

    bm.mark_computed(1, 6)
    bm.allocate(3, range(6))  # shares the first block with 1 and 2 through the prefix cache
    assert not bm.can_swap_out([1, 2])
    assert bm.can_swap_out([1, 2, 3])
    bm.swap_out([1, 2, 3])


def test_free_while_swapped_returns_the_host_blocks(new_manager):
    bm = new_manager(num_blocks=4, block_size=4, num_host_blocks=4)
    bm.allocate(1, range(6))
    bm.fork(1, 2)
    bm.swap_out([1, 2])
    assert bm.num_free_host_blocks == 2
    bm.free(1)
    assert bm.num_free_host_blocks == 2, "2 still holds them"
    bm.free(2)
    assert_no_leak(bm)


def test_swapped_sequences_can_come_back_one_at_a_time(new_sim):
    sim = new_sim(num_blocks=8, block_size=4, num_host_blocks=4)
    sim.allocate(1, [1, 2, 3, 4, 5, 6])
    sim.compute(1)
    sim.fork(1, 2)
    sim.fork(1, 3)
    sim.swap_out([1, 2, 3])
    sim.fork(3, 4)  # a swapped-out parent makes a swapped-out child
    assert sim.bm.is_swapped(4)
    sim.swap_in([1])
    assert sim.bm.num_free_host_blocks == 2, "2, 3 and 4 still hold the host blocks"
    sim.swap_in([2, 4])
    sim.check()
    sim.free(3)
    assert sim.bm.num_free_host_blocks == 4
    sim.append(2, [7])
    sim.compute(2)
    sim.check()
    sim.free_all()


def test_a_swapped_out_prefix_stays_in_the_prefix_cache(new_sim):
    sim = new_sim(num_blocks=6, block_size=4, num_host_blocks=4)
    prompt = list(range(10))
    sim.allocate(1, prompt)
    sim.compute(1)
    sim.swap_out([1])
    assert sim.bm.num_cached_blocks == 2
    assert sim.allocate(2, prompt) == 8
    sim.compute(2)
    sim.swap_in([1])
    sim.check()
    sim.free(2)
    sim.free_all()


def test_a_prefix_evicted_while_swapped_out_is_cached_again_after_swap_in(new_sim):
    sim = new_sim(num_blocks=3, block_size=4, num_host_blocks=3)
    prompt = list(range(10))
    sim.allocate(1, prompt)
    sim.compute(1)
    sim.swap_out([1])
    sim.allocate(2, [50] * 12)  # evicts both cached blocks
    sim.free(2)
    assert sim.bm.num_cached_blocks == 0
    sim.swap_in([1])
    sim.free(1)
    assert sim.bm.num_cached_blocks == 2
    assert cached_tokens(sim, prompt) == 8
    sim.free_all()


def test_a_swapped_out_sequence_refuses_device_operations(new_manager):
    bm = new_manager(num_blocks=4, block_size=4, num_host_blocks=4)
    bm.allocate(1, range(6))
    bm.swap_out([1])
    for call in (bm.block_table, bm.can_append, lambda s: bm.append(s, [1]), lambda s: bm.mark_computed(s, 1)):
        with pytest.raises(BlockManagerError, match="sequence 1 is swapped out; swap it in first"):
            call(1)
    with pytest.raises(BlockManagerError, match="sequence 1 is already swapped out"):
        bm.swap_out([1])
    bm.allocate(2, [1])
    with pytest.raises(BlockManagerError, match="sequence 2 is not swapped out"):
        bm.swap_in([2])
    assert bm.num_tokens(1) == 6 and bm.is_swapped(1)


# ---- everything at once


def sharing_group(sim: CacheSim, seq_id) -> list[int]:
    """seq_id and every device sequence linked to it through shared blocks."""
    group, frontier = {seq_id}, [seq_id]
    while frontier:
        blocks = set(sim.bm.block_table(frontier.pop()))
        for other in sim.on_device():
            if other not in group and blocks & set(sim.bm.block_table(other)):
                group.add(other)
                frontier.append(other)
    return sorted(group)


@pytest.mark.parametrize("seed", range(24))
def test_random_operations_keep_the_books_straight(seed):
    rng = np.random.default_rng(seed)
    block_size = int(rng.integers(1, 5))
    bm = BlockManager(num_blocks=int(rng.integers(3, 24)), block_size=block_size,
                      num_host_blocks=int(rng.integers(0, 16)), enable_prefix_caching=seed % 4 != 3,
                      reuse_written_first=seed % 3 == 1)
    sim = CacheSim(bm)
    # few distinct tokens and common stems, so prompts share prefixes often
    stems = [[int(t) for t in rng.integers(0, 3, size=int(rng.integers(1, 13)))] for _ in range(3)]
    next_id = 0

    def pick(choices):
        return choices[int(rng.integers(len(choices)))]

    for _ in range(300):
        op = pick(["allocate", "allocate", "compute", "compute", "append", "append", "append",
                   "fork", "free", "free", "swap_out", "swap_in"])
        prefilling = [s for s in sim.on_device() if sim.computed[s] < len(sim.tokens[s])]
        ready = [s for s in sim.on_device() if sim.computed[s] == len(sim.tokens[s])]

        if op == "allocate":
            stem = pick(stems)
            prompt = stem[:int(rng.integers(0, len(stem) + 1))] + [int(t) for t in rng.integers(0, 3, size=3)]
            prompt = prompt[:int(rng.integers(1, len(prompt) + 1))]
            if bm.can_allocate(prompt):
                sim.allocate(next_id, prompt)
                next_id += 1
            else:
                with pytest.raises(OutOfBlocksError):
                    bm.allocate(next_id, prompt)
        elif op == "compute" and prefilling:
            seq_id = pick(prefilling)
            sim.compute(seq_id, int(rng.integers(sim.computed[seq_id] + 1, len(sim.tokens[seq_id]) + 1)))
        elif op == "append" and ready:
            seq_id = pick(ready)
            new_tokens = [int(t) for t in rng.integers(0, 3, size=int(rng.integers(1, 4)))]
            if bm.can_append(seq_id, len(new_tokens)):
                assert len(sim.append(seq_id, new_tokens)) <= 1
                sim.compute(seq_id)
            else:
                with pytest.raises(OutOfBlocksError):
                    bm.append(seq_id, new_tokens)
        elif op == "fork" and ready:
            sim.fork(pick(ready), next_id)
            next_id += 1
        elif op == "free" and sim.tokens:
            sim.free(pick(list(sim.tokens)))
        elif op == "swap_out" and sim.on_device():
            seq_id = pick(sim.on_device())
            group = sharing_group(sim, seq_id) if rng.integers(2) else [seq_id]
            blocks = {block for s in group for block in bm.block_table(s)}
            outsiders = {block for s in sim.on_device() if s not in group for block in bm.block_table(s)}
            expected = not blocks & outsiders and len(blocks) <= bm.num_free_host_blocks
            assert bm.can_swap_out(group) == expected
            if expected:
                sim.swap_out(group)
            else:
                with pytest.raises(BlockManagerError):
                    bm.swap_out(group)
        elif op == "swap_in" and sim.host_tables:
            swapped = list(sim.host_tables)
            group = [s for s in swapped if rng.integers(2)] or [pick(swapped)]
            expected = len({h for s in group for h in sim.host_tables[s]}) <= bm.num_free_blocks
            assert bm.can_swap_in(group) == expected
            if expected:
                sim.swap_in(group)
            else:
                with pytest.raises(OutOfBlocksError):
                    bm.swap_in(group)
        sim.check()

    sim.free_all()
