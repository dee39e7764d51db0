"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router scores the experts for each
token, the best `experts_per_token` run their gated MLPs on it, and their outputs, weighted by the
router, are the token's MLP output. How the experts run is the backend's (`Ops.moe_experts`).

`ExpertNames` says where a family's checkpoints keep one MoE layer's tensors, for the loader;
`SparseMoeMlp` is the graph a MoE layer runs in place of the dense MLP, and `run_experts` its experts,
some of which may be in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from candelabra.core.models.config import MoeConfig

if TYPE_CHECKING:
    from candelabra.core.contract.ops import Ops
    from candelabra.core.models.layer_weights import Experts

# The ops a model with MoE layers needs beyond a dense one's.
MOE_OPS = ("route_experts", "moe_experts")


@dataclass(frozen=True)
class ExpertNames:
    """A MoE layer's tensors, under `model.layers.N.{block}` for the first of `blocks` the checkpoint
    holds: the router `gate.weight` [E, H], and the experts either fused in 3-D as transformers 5 keeps
    them (`experts.gate_up_proj` [E, 2I, H], gate rows first, and `experts.down_proj` [E, H, I]) or one
    by one as the Hub's checkpoints store them (`experts.{e}.{gate}.weight` [I, H], `{up}` [I, H],
    `{down}` [H, I])."""

    blocks: tuple[str, ...] = ("mlp",)
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


@dataclass(frozen=True)
class SparseMoeMlp:
    """Router, routing, experts: `Ops.route_experts` then `Ops.moe_experts`, plus the shared experts'
    gated MLP where the layer has them (DeepSeek). Every token is routed over all the layer's experts;
    those `experts` holds run (with tensor parallelism this rank's share, whose output, like the shared
    experts' intermediate share, is a partial sum)."""

    moe: MoeConfig

    def __call__(self, ops: Ops, experts: Experts, h):
        moe = self.moe
        router_logits = ops.linear(h, experts.router)
        weights, expert_ids = ops.route_experts(
            router_logits, moe.experts_per_token, moe.scoring, moe.renormalize, moe.routed_scale,
            moe.num_groups, moe.top_groups, moe.group_scoring, experts.correction_bias)
        routed = run_experts(ops, experts, h, weights, expert_ids)
        if experts.shared_gate_up is None:
            return routed
        return routed + ops.gated_linear(ops.linear(h, experts.shared_gate_up), experts.shared_down)


def run_experts(ops: Ops, experts: Experts, h, weights, expert_ids):
    """`Ops.moe_experts` of the routed picks: at once where the layer's experts (this rank's) are all on
    the device; where some are in host memory, in the turns that bring them in (`offloaded_experts`), each
    on the device rows a lookup table gives (`gather_rows` of an int32 [E, 1] table is exact), the picks
    of other turns weighted 0, and the turns' outputs summed."""
    if experts.offloaded is None:
        return ops.moe_experts(h, weights, expert_ids, experts.gate_up, experts.down, first_expert=experts.first)
    tokens, top_k = expert_ids.shape
    picks = expert_ids.reshape(tokens * top_k)
    out = None
    for turn in experts.offloaded.turns(expert_ids):
        rows = ops.gather_rows(turn.rows, picks).reshape(tokens, top_k)
        turn_weights = weights if turn.mask is None else weights * turn.mask
        part = ops.moe_experts(h, turn_weights, rows, experts.gate_up, experts.down)
        out = part if out is None else out + part
    return out
