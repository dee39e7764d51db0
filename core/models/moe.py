"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router scores the experts for each
token, the best `experts_per_token` run their gated MLPs on it, and their outputs, weighted by the
router, are the token's MLP output. How the experts run is the backend's (`Ops.moe_experts`).

`ExpertNames` says where a family's checkpoints keep one MoE layer's tensors, for the loader;
`SparseMoeMlp` is the graph a MoE layer runs in place of the dense MLP.
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
    gated MLP where the layer has them (DeepSeek)."""

    moe: MoeConfig

    def __call__(self, ops: Ops, experts: Experts, h):
        moe = self.moe
        router_logits = ops.linear(h, experts.router)
        weights, expert_ids = ops.route_experts(
            router_logits, moe.experts_per_token, moe.scoring, moe.renormalize, moe.routed_scale,
            moe.num_groups, moe.top_groups, moe.group_scoring, experts.correction_bias)
        routed = ops.moe_experts(h, weights, expert_ids, experts.gate_up, experts.down)
        if experts.shared_gate_up is None:
            return routed
        return routed + ops.linear(ops.silu_and_mul(ops.linear(h, experts.shared_gate_up)), experts.shared_down)
