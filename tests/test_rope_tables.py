"""Rotary tables: their layout, linear and yarn scaling, and unknown scalings refused."""

import math

import numpy as np
import pytest

from candelabra.core.models.rope import RopeScaling, cos_sin_table, rope_frequencies


def test_rope_table_layout_and_linear_scaling():
    table = cos_sin_table(8, 5, 10000.0)
    freqs = rope_frequencies(8, 10000.0)
    assert table.shape == (5, 8) and table.dtype == np.float32
    np.testing.assert_allclose(table[3, :4], np.cos(3 * freqs), rtol=1e-6)
    np.testing.assert_allclose(table[3, 4:], np.sin(3 * freqs), rtol=1e-6)
    linear = rope_frequencies(8, 10000.0, RopeScaling.from_hf({"type": "linear", "factor": 2.0}, 2048))
    np.testing.assert_allclose(linear, freqs / 2)


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
    scaling = RopeScaling.from_hf({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, 16384)
    table = cos_sin_table(64, 2, 1e6, scaling)
    assert table[0, 0] == pytest.approx(0.1 * math.log(4.0) + 1)


def test_unknown_rope_scaling_is_rejected():
    with pytest.raises(ValueError, match="unsupported rope scaling 'ntk-by-parts'"):
        RopeScaling.from_hf({"type": "ntk-by-parts"}, 4096)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rope_frequencies(7, 10000.0)
