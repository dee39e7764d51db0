"""How K is split across the GEMV and GEMM programs: each split's steps, the last taking fewer where the
splits do not divide them, and how many splits a launch takes for the programs it wants."""

from __future__ import annotations

import pytest

from candelabra.backends.cuda.kernels.split_k import MAX_SPLIT_K, splits_for, splittable, steps_a_split


def test_each_split_takes_the_ceiling_of_its_share_and_the_last_what_is_left():
    assert steps_a_split(8, 4) == 2 and steps_a_split(37, 5) == 8 and steps_a_split(13, 5) == 3
    assert steps_a_split(1, 1) == 1 and steps_a_split(37, 1) == 37
    for steps, split_k in ((8, 3), (37, 5), (13, 5), (37, 13)):  # every split takes a step, none past K
        per_split = steps_a_split(steps, split_k)
        shares = [min(per_split, steps - split * per_split) for split in range(split_k)]
        assert sum(shares) == steps and min(shares) >= 1
    # four steps in three splits of two would leave the third none; five splits of one step each, none
    for steps, split_k in ((4, 3), (4, 5), (0, 1), (4, 0), (12, 5)):
        assert not splittable(steps, split_k)
        with pytest.raises(ValueError, match=f"{steps} steps along K cannot be split {split_k} ways"):
            steps_a_split(steps, split_k)


def test_a_divisor_of_the_steps_is_taken_where_one_gives_enough_programs_else_an_uneven_split():
    # 256 tiles wanting 1,056 programs: 5 splits would do, 8 divides 16 steps and does too
    assert splits_for(256, 16, 1056) == 8
    # 112 tiles, 37 steps (prime): no divisor but 1 gives enough, so 10 splits, nine of 4 steps and one of 1
    assert splits_for(112, 37, 1056) == 10
    # at most MAX_SPLIT_K, and two steps a split on average at least: 37 steps reach 13 (twelve of 3, one of 1)
    assert splits_for(4, 37, 10_000) == 13 <= MAX_SPLIT_K
    assert splits_for(4, 37, 10_000, most_splits=3) == 3
    assert splits_for(1000, 37, 1056) == 2  # 2 splits of 19 and 18 steps
    assert splits_for(4, 3, 10_000) == 1  # 3 steps: a split of fewer than two would not pay
