"""A checkpoint's tensors as a decoder family's weights on a backend: which tensors a family takes,
fused where the graph multiplies them together, kept quantized or dequantized, and sliced to a
tensor-parallel rank's shard.

Query, key and value projections are fused into one matmul at load time, and so are gate and up;
a checkpoint that stores them fused is read as it is. A MoE layer's experts are stacked into two
3-D weights (`Experts`), from one tensor per expert and projection or from transformers 5's fused
ones, where the family's `expert_names` say (a tensor-parallel rank keeps its share of them, whole
experts), the last of them in host memory where an `ExpertOffload` asks
(`candelabra.core.models.offloaded_experts`); a GGUF file's quantized experts stay quantized, as one
3-D `QuantizedTensor`, for a backend that keeps their format for the experts role. Biases and
per-head q/k norms are taken where the checkpoint holds them. What differs between families is said
by the family class: its block's norm names, a gated or plain MLP, its attention output's and final
norm's names. With a communicator of more than one rank only this rank's part of each weight is
read (the rules are in `candelabra.core.models.sharding`).
"""

from __future__ import annotations

import logging

import numpy as np
from tqdm import tqdm

from candelabra.core.contract.backend import Backend
from candelabra.core.contract.communicator import Communicator
from candelabra.core.contract.dtypes import DType
from candelabra.core.contract.weights import QuantizedTensor, RowStack, WeightRole, same_column_order, stays_quantized
from candelabra.core.models.base import DecoderModel
from candelabra.core.models.config import ConfigError, ModelConfig
from candelabra.core.models.layer_weights import DecoderWeights, Experts, LatentAttention, Layer, Norm
from candelabra.core.models.offloaded_experts import ExpertOffload, OffloadedExperts
from candelabra.core.models.sharding import (
    VOCAB_PARALLEL,
    HostWeight,
    check_lm_head_layout,
    expert_share,
    intermediate_columns,
    pad_rows,
    quantization_block,
    shard_heads,
    take_columns,
    take_experts,
    take_rows,
    vocab_rows,
)
from candelabra.core.weights import Checkpoint

log = logging.getLogger("candelabra")


def load_decoder_weights(family: type[DecoderModel], config: ModelConfig, backend: Backend, checkpoint: Checkpoint,
                         dtype: DType, communicator: Communicator | None = None, lm_head_layout: str | None = None,
                         progress: bool = False, expert_offload: ExpertOffload | None = None) -> DecoderWeights:
    """`checkpoint`'s weights for `family` on `backend` in `dtype`: the whole model's, or with a
    `communicator` of more than one rank that rank's shard, its LM head laid out as `lm_head_layout`
    (one of `sharding.LM_HEAD_LAYOUTS`; the family's default when None), and with `expert_offload` some
    of each MoE layer's experts in host memory (see `offloaded_experts`; the backend must take them).
    ValueError when the world size does not split the heads (see `sharding.shard_heads`) or leaves a rank
    no experts of a MoE layer (`sharding.expert_share`)."""
    return _Loader(family, config, backend, checkpoint, dtype, communicator, lm_head_layout, progress,
                   expert_offload).load()


class _Loader:
    def __init__(self, family: type[DecoderModel], config: ModelConfig, backend: Backend, checkpoint: Checkpoint,
                 dtype: DType, communicator: Communicator | None, lm_head_layout: str | None, progress: bool,
                 expert_offload: ExpertOffload | None = None) -> None:
        self.family, self.config, self.backend = family, config, backend
        self.expert_offload = expert_offload
        self.dtype = backend.check_dtype(dtype)
        self.communicator = communicator if communicator is not None and communicator.world_size > 1 else None
        rank, world_size = (communicator.rank, communicator.world_size) if self.communicator else (0, 1)
        self.head_shard = shard_heads(config.num_heads, config.num_kv_heads, rank, world_size)
        self.experts = expert_share(config.moe.num_experts, rank, world_size) if config.moe is not None else None
        layout = check_lm_head_layout(lm_head_layout or family.lm_head_layout)
        self.vocab_parallel = self.communicator is not None and layout == VOCAB_PARALLEL
        self.block = family.block_for(config)
        self._checkpoint = checkpoint
        self._names = set(checkpoint.tensor_names())
        self._progress = tqdm(total=len(self._names), desc="loading weights", unit="tensor",
                              disable=not progress, leave=False)

    def load(self) -> DecoderWeights:
        try:
            embed_tokens, (lm_head, vocab_size) = self._embedding_and_lm_head()
            layers = [self._layer(index) for index in range(self.config.num_layers)]
            final_norm = self._norm(self.family.final_norm_name)
            lm_head_bias = self._lm_head_bias()
        finally:
            self._progress.close()
        return DecoderWeights(dtype=self.dtype, embed_tokens=embed_tokens, lm_head=lm_head, lm_head_bias=lm_head_bias,
                              final_norm=final_norm, layers=layers, vocab_size=vocab_size,
                              head_shard=self.head_shard, vocab_parallel=self.vocab_parallel)

    def _layer(self, index: int) -> Layer:
        prefix = f"model.layers.{index}"
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        out = f"{attn}.{self.family.attention_out_name}"
        qkv_rows = self._qkv_rows()
        latent = self.config.mla is not None
        value_width = self.config.mla.v_head_dim if latent else self.config.head_dim
        out_columns = None if self.communicator is None else self.head_shard.output_columns(value_width)
        layer = Layer(
            qkv=None if latent else self._fused(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), "weight", qkv_rows),
            qkv_bias=None if latent else self._fused(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), "bias",
                                                     qkv_rows),
            out=self._row_parallel(f"{out}.weight", out_columns),
            out_bias=self._row_parallel_bias(f"{out}.bias"),
            norms={name: self._norm(f"{prefix}.{name}") for name in self.block.norm_names
                   if f"{prefix}.{name}.weight" in self._names},
            q_norm=self._norm(f"{attn}.q_norm") if f"{attn}.q_norm.weight" in self._names else None,
            k_norm=self._norm(f"{attn}.k_norm") if f"{attn}.k_norm.weight" in self._names else None,
        )
        if latent:
            layer.latent_attention = self._latent_attention(attn)
        moe = self.config.moe
        if moe is not None and moe.is_sparse(index):
            layer.experts = self._experts(prefix)
        elif self.family.gated_mlp:
            layer.mlp_in, layer.mlp_out = self._gated_mlp(mlp)
        else:
            columns = self._intermediate_columns(f"{mlp}.fc2.weight")
            rows = None if columns is None else [columns]
            layer.mlp_in = self._column_parallel(f"{mlp}.fc1.weight", WeightRole.LINEAR, rows)
            if f"{mlp}.fc1.bias" in self._names:
                layer.mlp_in_bias = self._column_parallel(f"{mlp}.fc1.bias", WeightRole.BIAS, rows)
            layer.mlp_out = self._row_parallel(f"{mlp}.fc2.weight", columns)
            layer.mlp_out_bias = self._row_parallel_bias(f"{mlp}.fc2.bias")
        return layer

    def _experts(self, prefix: str) -> Experts:
        """A MoE layer's router (whole: every rank routes every token) and this rank's experts,
        stacked (see `ExpertNames` for the layouts read)."""
        names, moe, kept = self.family.expert_names, self.config.moe, self.experts
        blocks = [f"{prefix}.{block}" for block in names.blocks]
        block = next((b for b in blocks if f"{b}.gate.weight" in self._names), blocks[0])
        router = self._weight(f"{block}.gate.weight", WeightRole.LINEAR)
        fused_gate_up, fused_down = f"{block}.experts.gate_up_proj", f"{block}.experts.down_proj"
        each = [f"{block}.experts.{e}" for e in kept]
        size, hidden = moe.expert_intermediate_size, self.config.hidden_size
        gate_up = self._stacked_experts(fused_gate_up, [[f"{expert}.{names.gate}.weight", f"{expert}.{names.up}.weight"]
                                                        for expert in each], (2 * size, hidden))
        down = self._stacked_experts(fused_down, [[f"{expert}.{names.down}.weight"] for expert in each], (hidden, size))
        _check_shape(fused_gate_up, gate_up, (len(kept), 2 * size, hidden))
        _check_shape(fused_down, down, (len(kept), hidden, size))
        if self.expert_offload is not None:
            # the slots hold dense rows: offloaded experts are dequantized (kept quantized is not built yet)
            gate_up, down = (w.dequantize() if isinstance(w, QuantizedTensor) else w for w in (gate_up, down))
            offloaded = OffloadedExperts.place(
                self.backend, self.expert_offload, self.config.architecture, (fused_gate_up, fused_down), gate_up,
                down, self.dtype, lambda name, weight: self._upload(name, WeightRole.EXPERTS, weight),
                first_expert=kept.start, layer_experts=moe.num_experts)
            experts = Experts(router=router, gate_up=offloaded.gate_up, down=offloaded.down, offloaded=offloaded,
                              first=kept.start)
        else:
            experts = Experts(router=router, gate_up=self._upload(fused_gate_up, WeightRole.EXPERTS, gate_up),
                              down=self._upload(fused_down, WeightRole.EXPERTS, down), first=kept.start)
        bias = f"{block}.gate.e_score_correction_bias"
        if bias in self._names:  # float32, as the op takes it: it only breaks near-ties between experts
            experts.correction_bias = self.backend.to_device(self._host([bias], WeightRole.BIAS), "float32")
        if f"{block}.shared_experts.down_proj.weight" in self._names:
            experts.shared_gate_up, experts.shared_down = self._gated_mlp(f"{block}.shared_experts")
        return experts

    def _gated_mlp(self, prefix: str):
        """A gated MLP's fused gate and up projection and its down projection, column- and row-parallel
        over one range of the intermediate features under tensor parallelism."""
        down = f"{prefix}.down_proj.weight"
        columns = self._intermediate_columns(down)
        rows = None if columns is None else [columns, _shifted(columns, self._checkpoint.tensor_shape(down)[1])]
        return (self._fused(prefix, "gate_up_proj", ("gate_proj", "up_proj"), "weight", rows),
                self._row_parallel(down, columns))

    def _latent_attention(self, attn: str) -> LatentAttention:
        """A layer's latent attention weights (see `LatentAttention`): the query's and the latent's
        down-projections as one, and kv_b_proj split into each head's absorbed key and value. Under
        tensor parallelism a rank keeps its query heads' rows of q_proj (or q_b_proj) and of kv_b_proj;
        the latent's projection and norms, and so the latent cache, are the same on every rank."""
        mla, heads, shard = self.config.mla, self.config.num_heads, self.head_shard.query_heads
        q_down = "q_a_proj" if mla.q_lora_rank else "q_proj"
        parts = (q_down, "kv_a_proj_with_mqa")
        biases = [f"{attn}.{part}.bias" in self._names for part in parts]
        if any(biases) and not all(biases):
            raise ConfigError(f"{attn}: kv_a_proj_with_mqa and {q_down} must both have a bias or neither")
        name = f"{attn}.kv_b_proj.weight"
        up = self._host([name], WeightRole.PER_HEAD)
        nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
        _check_shape(name, up, (heads * (nope + mla.v_head_dim), rank), "kv_b_proj is")
        up = up.reshape(heads, nope + mla.v_head_dim, rank)[shard.start : shard.stop]
        query_rows = range(shard.start * mla.qk_head_dim, shard.stop * mla.qk_head_dim)
        latent_rows = None
        if self.communicator is not None and not mla.q_lora_rank:  # q_proj's heads, then all of kv_a
            width = heads * mla.qk_head_dim
            latent_rows = [query_rows, range(width, width + rank + mla.qk_rope_head_dim)]
        weights = LatentAttention(
            latent_in=self._fused(attn, "latent_in", parts, "weight", latent_rows),
            latent_in_bias=self._fused(attn, "latent_in", parts, "bias"),
            latent_norm=self._norm(f"{attn}.kv_a_layernorm"),
            absorbed_key=self._upload(f"{name}:key", WeightRole.PER_HEAD,
                                      np.ascontiguousarray(up[:, :nope].transpose(0, 2, 1))),
            absorbed_value=self._upload(f"{name}:value", WeightRole.PER_HEAD, np.ascontiguousarray(up[:, nope:])),
        )
        if mla.q_lora_rank:
            weights.q_norm = self._norm(f"{attn}.q_a_layernorm")
            rows = None if self.communicator is None else [query_rows]
            weights.q_up = self._column_parallel(f"{attn}.q_b_proj.weight", WeightRole.LINEAR, rows)
        return weights

    def _stacked_experts(self, fused: str, per_expert: list[list[str]], matrix: tuple[int, int]) -> HostWeight:
        """One projection of this rank's experts, [E', out, in]: those of the checkpoint's fused 3-D tensor
        of every expert's `matrix` where it has one, else the tensors `per_expert` of each (their rows
        one after another) stacked, the other experts' not read; still quantized where they all share a
        format the backend keeps for experts and one column order (act-order GPTQ experts each have their own)."""
        if fused in self._names:
            every = self._host([fused], WeightRole.EXPERTS)
            _check_shape(fused, every, (self.config.moe.num_experts, *matrix))
            return take_experts(every, self.experts)
        kept = self._kept_format([name for names in per_expert for name in names], WeightRole.EXPERTS)
        experts = [self._read(names, kept) for names in per_expert]
        self._progress.update((self.config.moe.num_experts - len(per_expert)) * len(per_expert[0]))
        if kept is None:
            return np.stack(experts)
        return _in_one_column_order(experts, QuantizedTensor.stack, np.stack,
                                    f"{fused}: the experts dequantized to float32 at load to be stacked")

    # One tensor, or several stacked, from the checkpoint to the backend.

    def _host(self, names: list[str], role: WeightRole) -> HostWeight:
        """The tensors `names`, their rows one after another, as the backend takes them for `role`:
        still quantized when they share a format it keeps, a `RowStack` when they are a linear weight's
        parts in formats it keeps and it keeps row stacks, else dequantized to float32."""
        kept = self._kept_format(names, role)
        if kept is None and len(names) > 1 and self._keeps_row_stack(names, role):
            quantized = [self._checkpoint.load_quantized(name) for name in names]
            self._progress.update(len(names))
            return _in_one_column_order(quantized, RowStack.of, np.concatenate,
                                        f"{' and '.join(names)}: dequantized to float32 at load to be fused")
        return self._read(names, kept)

    def _keeps_row_stack(self, names: list[str], role: WeightRole) -> bool:
        backend = self.backend
        return (backend.keeps_row_stacks and role is WeightRole.LINEAR
                and all(stays_quantized(role, self._checkpoint.quantized_format(name), backend.quantized_formats,
                                        backend.quantized_roles) for name in names))

    def _read(self, names: list[str], kept_format: str | None) -> HostWeight:
        """The tensors `names`, their rows one after another: dequantized to float32 where `kept_format`
        is None, else as stored."""
        if kept_format is None:
            parts = [self._checkpoint.load(name) for name in names]
            tensor = parts[0] if len(parts) == 1 else np.concatenate(parts)
        else:
            quantized = [self._checkpoint.load_quantized(name) for name in names]
            tensor = quantized[0] if len(quantized) == 1 else _joined(names, quantized)
        self._progress.update(len(names))
        return tensor

    def _kept_format(self, names: list[str], role: WeightRole) -> str | None:
        formats = {self._checkpoint.quantized_format(name) for name in names}
        stored = formats.pop() if len(formats) == 1 else None
        backend = self.backend
        return stored if stays_quantized(role, stored, backend.quantized_formats, backend.quantized_roles) else None

    def _upload(self, name: str, role: WeightRole, tensor: HostWeight):
        return self.backend.upload_weight(name, role, tensor, self.dtype)

    def _weight(self, name: str, role: WeightRole):
        return self._upload(name, role, self._host([name], role))

    def _optional(self, name: str, role: WeightRole):
        return self._weight(name, role) if name in self._names else None

    def _norm(self, prefix: str) -> Norm:
        weight = self._weight(f"{prefix}.weight", WeightRole.NORM)
        return Norm(weight, self._optional(f"{prefix}.bias", WeightRole.BIAS))

    # The embedding and the LM head.

    def _embedding_and_lm_head(self):
        """The embedding table, and (the LM head, its rows): its own tensor, or else (tied) the
        embedding uploaded again with role lm_head, right after it and as the same host array or
        QuantizedTensor where the LM head takes the same form."""
        name = "model.embed_tokens.weight"
        table = self._host([name], WeightRole.EMBEDDING)
        embedding = self._upload(name, WeightRole.EMBEDDING, table)
        if "lm_head.weight" in self._names and not self.config.tie_word_embeddings:
            return embedding, self._lm_head("lm_head.weight", self._host(["lm_head.weight"], WeightRole.LM_HEAD))
        quantized_head = self._kept_format([name], WeightRole.LM_HEAD) is not None
        if isinstance(table, QuantizedTensor) and not quantized_head:
            table = table.dequantize()
        elif quantized_head and not isinstance(table, QuantizedTensor):
            table = self._checkpoint.load_quantized(name)
        return embedding, self._lm_head(name, table)

    def _lm_head(self, name: str, table: HostWeight):
        """The LM head uploaded from its host rows `table` (this rank's share of the vocabulary, padded,
        where it is vocabulary-parallel), and the rows of the whole."""
        return self._upload(name, WeightRole.LM_HEAD, self._vocab_shard(table)), table.shape[0]

    def _lm_head_bias(self):
        name = "lm_head.bias"
        if name not in self._names:
            return None
        return self._upload(name, WeightRole.BIAS, self._vocab_shard(self._host([name], WeightRole.BIAS)))

    def _vocab_shard(self, rows: HostWeight) -> HostWeight:
        if not self.vocab_parallel:
            return rows
        kept, padded = vocab_rows(rows.shape[0], self.communicator.rank, self.communicator.world_size)
        return pad_rows(take_rows(rows, [kept]), padded)

    # Projections, fused and sharded.

    def _fused(self, prefix: str, fused: str, parts: tuple[str, ...], suffix: str, rows: list[range] | None = None):
        """A fused projection from the checkpoint, or its parts concatenated; None if absent. With
        `rows`, only those rows of the fused projection (a column-parallel shard)."""
        role = WeightRole.LINEAR if suffix == "weight" else WeightRole.BIAS
        name = f"{prefix}.{fused}.{suffix}"
        names = [name] if name in self._names else [f"{prefix}.{part}.{suffix}" for part in parts]
        if not all(n in self._names for n in names):
            return None
        return self._column_parallel(name, role, rows, names)

    def _column_parallel(self, name: str, role: WeightRole, rows: list[range] | None, stacked: list[str] | None = None):
        """The tensor `name`, or the tensors `stacked` (their rows one after another) uploaded as
        `name`; with `rows`, only those rows."""
        host = self._host(stacked or [name], role)
        return self._upload(name, role, host if rows is None else take_rows(host, rows))

    def _row_parallel(self, name: str, columns: range | None):
        """The linear weight `name`, or only its input features `columns`."""
        host = self._host([name], WeightRole.LINEAR)
        return self._upload(name, WeightRole.LINEAR, host if columns is None else take_columns(host, columns))

    def _row_parallel_bias(self, name: str):
        """A row-parallel projection's bias, None if absent: on rank 0 only, so the sum over ranks adds it once."""
        if self.communicator is not None and self.communicator.rank != 0:
            self._progress.update(int(name in self._names))
            return None
        return self._optional(name, WeightRole.BIAS)

    def _qkv_rows(self) -> list[range] | None:
        c = self.config
        return None if self.communicator is None else self.head_shard.qkv_rows(c.num_heads, c.num_kv_heads, c.head_dim)

    def _intermediate_columns(self, row_parallel: str) -> range | None:
        """This rank's MLP intermediate features, split on the blocks of the row-parallel weight
        `row_parallel` where it stays quantized; None without tensor parallelism."""
        if self.communicator is None:
            return None
        block = quantization_block(self._kept_format([row_parallel], WeightRole.LINEAR))
        size = self._checkpoint.tensor_shape(row_parallel)[1]
        return intermediate_columns(size, self.communicator.rank, self.communicator.world_size, block)


def _check_shape(name: str, weight: HostWeight, expected: tuple[int, ...],
                 what: str = "the experts stacked are") -> None:
    if weight.shape != expected:
        raise ConfigError(f"{name}: {what} {list(weight.shape)}, but config.json's counts and sizes make it "
                          f"{list(expected)}")


def _joined(names: list[str], parts: list[QuantizedTensor]) -> HostWeight:
    """The parts' rows one after another: quantized where they share a column order, as fused act-order
    GPTQ projections do (q, k and v, or gate and up, read the same inputs), else dequantized."""
    return _in_one_column_order(parts, QuantizedTensor.concatenate, np.concatenate,
                                f"{' and '.join(names)}: dequantized to float32 at load to be fused")


def _in_one_column_order(parts: list[HostWeight], join_quantized, join_dense, dequantized: str) -> HostWeight:
    """The parts joined quantized where all are quantized with their columns in one order, else dequantized
    and joined, with `dequantized` logged."""
    if all(isinstance(part, QuantizedTensor) for part in parts) and same_column_order(parts):
        return join_quantized(parts)
    log.info("%s, since their act-order column orders differ", dequantized)
    return join_dense([part.dequantize() if isinstance(part, QuantizedTensor) else part for part in parts])


def _shifted(indices: range, offset: int) -> range:
    return range(indices.start + offset, indices.stop + offset)
