"""Mixtral: Mistral's graph (a sliding window when config.json gives one) with a sparse
mixture-of-experts MLP in every layer. Its Hub checkpoints keep a layer's router and experts under
`block_sparse_moe`, each expert as w1 (gate), w3 (up) and w2 (down); transformers 5 keeps them
fused under `mlp`."""

from candelabra.core.models.base import DecoderModel
from candelabra.core.models.moe import ExpertNames


class Mixtral(DecoderModel):
    expert_names = ExpertNames(blocks=("block_sparse_moe", "mlp"), gate="w1", up="w3", down="w2")
