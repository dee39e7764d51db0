import numpy as np
import pytest

from candelabra.core.contract.step_metadata import NO_TOKEN, SamplingMetadata, StepMetadata, pad_token_lists


def test_build_lays_out_a_mixed_batch():
    # a decode at position 4, then a 3-token chunk continuing a sequence that had 2 cached tokens
    meta = StepMetadata.build(query_lens=[1, 3], seq_lens=[5, 5], block_tables=[[7, 2], [4, 9, 1]], block_size=4)

    assert meta.positions.tolist() == [4, 2, 3, 4]
    # position 4 of sequence 0 is offset 0 of its second block (2); sequence 1's positions 2, 3
    # sit in block 4, position 4 in block 9
    assert meta.slot_mapping.tolist() == [2 * 4 + 0, 4 * 4 + 2, 4 * 4 + 3, 9 * 4 + 0]
    assert meta.query_start_loc.tolist() == [0, 1, 4]
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 9, 1]]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_tokens, meta.num_seqs) == (3, 5, 4, 2)
    assert all(a.dtype == np.int32 for a in (meta.positions, meta.slot_mapping, meta.query_start_loc,
                                             meta.seq_lens, meta.block_tables))


@pytest.mark.parametrize("query_lens, seq_lens, tables, message", [
    ([0], [3], [[0]], "1 <= query_len <= seq_len"),
    ([4], [3], [[0]], "1 <= query_len <= seq_len"),
    ([1], [9], [[0, 1]], "needs 3 blocks of 4, but its block table has 2"),
    ([1, 1], [1], [[0]], "equal length"),
])
def test_build_rejects_inconsistent_batches(query_lens, seq_lens, tables, message):
    with pytest.raises(ValueError, match=message):
        StepMetadata.build(query_lens, seq_lens, tables, block_size=4)


def _sampling(**overrides):
    rows = 2
    fields = dict(
        temperature=np.ones(rows, np.float32), top_k=np.zeros(rows, np.int32), top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32), repetition_penalty=np.ones(rows, np.float32),
        presence_penalty=np.zeros(rows, np.float32), frequency_penalty=np.zeros(rows, np.float32),
        penalty_tokens=pad_token_lists([[], []]), output_tokens=pad_token_lists([[], []]),
        bias_token_ids=pad_token_lists([[], []]), bias_values=np.zeros((rows, 1), np.float32),
        uniform=np.array([0.1, 0.9], np.float32),
    )
    return SamplingMetadata(**{**fields, **overrides})


@pytest.mark.parametrize("overrides, message", [
    ({"uniform": np.array([0.1, 0.9])}, "float32"),
    ({"uniform": np.array([0.1, 1.0], np.float32)}, r"\[0, 1\)"),
    ({"top_p": np.array([0.0, 1.0], np.float32)}, r"top_p must lie in \(0, 1\]"),
    ({"temperature": np.array([-1.0, 1.0], np.float32)}, "temperature must be >= 0"),
    ({"min_p": np.zeros(3, np.float32)}, "min_p has 3 rows, expected 2"),
    ({"num_top_logprobs": -1}, "num_top_logprobs"),
])
def test_sampling_metadata_rejects_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        _sampling(**overrides)


def test_pad_token_lists_pads_short_rows_with_no_token_to_the_longest():
    assert pad_token_lists([[5, 6], [], [7]]).tolist() == [[5, 6], [NO_TOKEN, NO_TOKEN], [7, NO_TOKEN]]
    assert _sampling().num_rows == 2
