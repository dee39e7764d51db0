"""A decoder layer's graph, one class per residual layout: where the norms sit and where the residual
adds go. A family names its block (with its checkpoint's norm names) and the model runs it for every
layer; the attention and the MLP inside are the model's own (`DecoderModel.attention`, `.mlp`: a layer's
dense MLP or its experts).

Each `forward` takes the residual stream and the branch the layer before left to add to it (None at the
first layer), and returns the same two for the next layer with the updated KV cache: a layer's last add
is made by the next layer's first norm, and a norm and the projection that reads its output are one op
(`DecoderModel.normed_projection`), which a backend may make one kernel. With tensor parallelism
the attention output and the MLP are this rank's partial sums, and the block says where they are summed
over the ranks (`DecoderModel.summed_over_ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from candelabra.core.models.base import DecoderModel
    from candelabra.core.models.layer_weights import Layer


@dataclass(frozen=True)
class SequentialBlock:
    """Pre-norm attention, then pre-norm MLP, each added to the residual (Llama, Qwen, Gemma, Phi-3)."""

    before_attention: str = "input_layernorm"
    before_mlp: str = "post_attention_layernorm"

    @property
    def norm_names(self) -> tuple[str, ...]:
        return (self.before_attention, self.before_mlp)

    def forward(self, model: DecoderModel, index: int, layer: Layer, x, branch, step, positions, cache):
        projected, x = model.normed_projection(layer.norms[self.before_attention], x, branch,
                                               *model.attention_projection(layer))
        attended, cache = model.attention(index, layer, projected, step, positions, cache)
        out, x = model.normed_mlp(layer, layer.norms[self.before_mlp], x, model.summed_over_ranks(attended))
        return x, model.summed_over_ranks(out), cache


@dataclass(frozen=True)
class SandwichBlock:
    """Norms on both sides of attention and of the MLP: each branch's output is normalised before it
    joins the residual (Gemma 2 and 3, GLM-4)."""

    before_attention: str
    after_attention: str
    before_mlp: str
    after_mlp: str

    @property
    def norm_names(self) -> tuple[str, ...]:
        return (self.before_attention, self.after_attention, self.before_mlp, self.after_mlp)

    def forward(self, model: DecoderModel, index: int, layer: Layer, x, branch, step, positions, cache):
        norms = layer.norms
        projected, x = model.normed_projection(norms[self.before_attention], x, branch,
                                               *model.attention_projection(layer))
        attended, cache = model.attention(index, layer, projected, step, positions, cache)
        attended = model.norm(norms[self.after_attention], model.summed_over_ranks(attended))
        out, x = model.normed_mlp(layer, norms[self.before_mlp], x, attended)
        return x, model.norm(norms[self.after_mlp], model.summed_over_ranks(out)), cache


@dataclass(frozen=True)
class ParallelBlock:
    """Attention and MLP side by side from one norm, both added to the residual (Phi-2, StableLM with
    use_parallel_residual)."""

    norm: str = "input_layernorm"

    @property
    def norm_names(self) -> tuple[str, ...]:
        return (self.norm,)

    def forward(self, model: DecoderModel, index: int, layer: Layer, x, branch, step, positions, cache):
        h, x = joined_and_normed(model, layer.norms[self.norm], x, branch)
        weight, bias = model.attention_projection(layer)
        attended, cache = model.attention(index, layer, model.ops.linear(h, weight, bias), step, positions, cache)
        if model.communicator is None:
            return x + attended, model.mlp(layer, h), cache
        # both branches' partial sums add up before the layer's one all-reduce
        return x, model.summed_over_ranks(attended + model.mlp(layer, h)), cache


Block = SequentialBlock | SandwichBlock | ParallelBlock


def joined_and_normed(model: DecoderModel, norm, x, branch):
    """(norm(x + branch), x + branch), the add made by the norm's kernel; (norm(x), x) without a branch."""
    return (model.norm(norm, x), x) if branch is None else model.add_norm(norm, branch, x)
