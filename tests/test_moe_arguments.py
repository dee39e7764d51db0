"""The MoE ops' argument checks: routing that cannot pick its experts, and expert weights whose shapes do
not fit the tokens, are refused with the reason."""

import numpy as np
import pytest

from candelabra.backends.cpu import CpuBackend
from candelabra.core.contract.ops import check_routing


@pytest.mark.parametrize("arguments, reason", [
    (dict(scoring="tanh"), "unknown expert scoring 'tanh'"),
    (dict(group_scoring="mean"), "unknown group scoring 'mean'"),
    (dict(num_groups=3), "8 experts do not form 3 groups of equal size"),
    (dict(num_groups=4, top_groups=5), "top_groups 5 must be between 1 and num_groups 4"),
    (dict(num_groups=8, top_groups=4, group_scoring="top2_sum"), "groups of 1 have one"),
    (dict(num_groups=4, top_groups=1, top_k=3), "top_k 3 must be between 1 and the 2 experts"),
    (dict(top_k=0), "top_k 0 must be between 1 and the 8 experts"),
])
def test_routing_that_cannot_pick_its_experts_is_refused_with_the_reason(arguments, reason):
    settings = dict(num_experts=8, top_k=2, scoring="softmax", num_groups=1, top_groups=1, group_scoring="max")
    with pytest.raises(ValueError, match=reason):
        check_routing(**(settings | arguments))


def test_the_numpy_backend_refuses_expert_weights_that_do_not_fit_the_tokens():
    ops = CpuBackend().ops
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    weights, ids = np.full((3, 2), 0.5, np.float32), np.zeros((3, 2), np.int32)
    gate_up = rng.standard_normal((4, 2 * 8, 16)).astype(np.float32)
    down = rng.standard_normal((4, 16, 9)).astype(np.float32)  # 9 is not the experts' 8
    with pytest.raises(ValueError, match="down"):
        ops.moe_experts(x, weights, ids, gate_up, down)
    with pytest.raises(ValueError, match="unknown expert scoring"):
        ops.route_experts(rng.standard_normal((3, 4)).astype(np.float32), 2, scoring="tanh")


def test_a_negative_first_expert_is_refused():
    ops = CpuBackend().ops
    x, ids = np.zeros((2, 16), np.float32), np.zeros((2, 1), np.int32)
    gate_up, down = np.zeros((4, 2 * 8, 16), np.float32), np.zeros((4, 16, 8), np.float32)
    with pytest.raises(ValueError, match="first_expert .* got -1"):
        ops.moe_experts(x, np.ones((2, 1), np.float32), ids, gate_up, down, first_expert=-1)
