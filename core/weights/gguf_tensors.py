"""GGUF tensor names mapped to Hugging Face ones, with the changes llama.cpp's converter made
undone so each tensor is laid out as the Hugging Face model expects.

GGUF names come from gguf.constants (the tables llama.cpp's converter writes with); the Hugging
Face names are the module paths of transformers' modeling files. The converter changes data in
two ways this module reverses (see convert_hf_to_gguf.py in llama.cpp, and transformers'
GGUF loader, which reverses them too):

- llama: it permutes the rows of every q_proj and k_proj weight and bias, per head, from
  Hugging Face's rotate-half rope layout into the interleaved pairs llama.cpp's rope reads;
- gemma, gemma2, gemma3: it adds 1 to every "*norm.weight", because those models compute
  x * (1 + w) where llama.cpp computes x * w.

Where GGUF fuses what Hugging Face keeps apart (phi2's and glm4's attn_qkv, StableLM's
per-head q/k norms stacked into one tensor, a MoE layer's experts stacked into one 3-D tensor per
projection), one GGUF tensor yields several recipes, each a range of its rows. Experts come back
one tensor per expert and projection, as the Hub's checkpoints store them. Where GGUF splits what
Hugging Face keeps whole (DeepSeek's kv_b_proj, stored by newer converters as attn_k_b and
attn_v_b), one recipe joins two GGUF tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
from gguf.constants import MODEL_TENSOR as T
from gguf.constants import TENSOR_NAMES

from candelabra.core.weights import CheckpointError
from candelabra.core.weights.gguf_file import GGUFFile, TensorInfo


@dataclass(frozen=True)
class TensorRecipe:
    """How one Hugging Face tensor is made from a GGUF tensor."""

    source: str  # the GGUF tensor's name
    shape: tuple[int, ...]  # the Hugging Face shape
    rows: tuple[int, int] | None = None  # [start, stop) of the source's rows, when the source fuses several tensors
    # Undoes a reordering of rows by the converter. Rows are independent in GGML's block formats
    # too, so it applies as well to the stored blocks, one row of blocks per row.
    reorder_rows: Callable[[np.ndarray], np.ndarray] | None = None
    fix: Callable[[np.ndarray], np.ndarray] | None = None  # undoes a change the converter made to values
    # Where the converter split one Hugging Face tensor in two: the other GGUF tensor, and how the
    # two, each read whole and dequantized (`source` first), make this one.
    joined: str | None = None
    join: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None


@dataclass(frozen=True)
class ExpertLayout:
    """Where a MoE layer's experts go: each of GGUF's 3-D tensors of every expert's gate, up or down
    projection, [experts, out_features, in_features] in numpy's order, becomes one tensor per expert,
    `model.layers.N.{block}.experts.{e}.{names[tensor]}.weight`."""

    block: str
    names: dict[T, str]


@dataclass(frozen=True)
class Layout:
    """One architecture's tensor names."""

    layer: dict[T, str]  # GGUF tensor in block N -> Hugging Face module under model.layers.N
    experts: ExpertLayout | None = None  # where a file with experts keeps them (its router is in `layer`)
    final_norm: str = "model.norm"
    split_qkv: bool = False  # attn_qkv fused in GGUF, q_proj/k_proj/v_proj apart in Hugging Face
    per_head_qk_norm: bool = False  # StableLM: one LayerNorm per head, stacked in GGUF
    permuted_qk: bool = False  # llama: rope rows permuted by the converter
    shifted_norms: bool = False  # gemma family: 1 added to every norm weight by the converter
    split_kv_b: bool = False  # DeepSeek: kv_b_proj stored whole (attn_kv_b) or split (attn_k_b, attn_v_b)
    # GGUF tensors whose ".weight" or ".bias" was "_weight" or "_bias" in the Hugging Face name,
    # renamed so by the converter (DeepSeek-V3's e_score_correction_bias became exp_probs_b.bias).
    underscored_suffix: frozenset[T] = field(default_factory=frozenset)
    config_only: frozenset[T] = field(default_factory=frozenset)  # GGUF tensors read into the config instead


def gguf_block_name(tensor: T) -> str:
    """The name gguf.constants gives a block tensor, without its "blk.{bid}." prefix."""
    return TENSOR_NAMES[tensor].removeprefix("blk.{bid}.")


ATTENTION = {
    T.ATTN_Q: "self_attn.q_proj",
    T.ATTN_K: "self_attn.k_proj",
    T.ATTN_V: "self_attn.v_proj",
    T.ATTN_OUT: "self_attn.o_proj",
}
GATED_MLP = {T.FFN_GATE: "mlp.gate_proj", T.FFN_UP: "mlp.up_proj", T.FFN_DOWN: "mlp.down_proj"}
QK_NORM = {T.ATTN_Q_NORM: "self_attn.q_norm", T.ATTN_K_NORM: "self_attn.k_norm"}
PRE_NORMS = {T.ATTN_NORM: "input_layernorm", T.FFN_NORM: "post_attention_layernorm"}
# Gemma 2 and 3 norm both the input and the output of attention and of the MLP.
SANDWICH_NORMS = {
    T.ATTN_NORM: "input_layernorm",
    T.ATTN_POST_NORM: "post_attention_layernorm",
    T.FFN_PRE_NORM: "pre_feedforward_layernorm",
    T.FFN_POST_NORM: "post_feedforward_layernorm",
}
LLAMA_LAYER = PRE_NORMS | ATTENTION | GATED_MLP
# Mixtral's GGUF files are llama's, with experts: its Hub checkpoints' names for them.
MIXTRAL_EXPERTS = ExpertLayout("block_sparse_moe", {T.FFN_GATE_EXP: "w1", T.FFN_UP_EXP: "w3", T.FFN_DOWN_EXP: "w2"})
QWEN_EXPERTS = ExpertLayout("mlp", {T.FFN_GATE_EXP: "gate_proj", T.FFN_UP_EXP: "up_proj", T.FFN_DOWN_EXP: "down_proj"})
DEEPSEEK_EXPERTS = QWEN_EXPERTS  # the same names
# Latent attention: the query (q_proj, or q_a_proj, its norm and q_b_proj) and the latent's projection
# and norm, then kv_b_proj, which expands the latent into each head's key and value.
LATENT_ATTENTION = {
    T.ATTN_Q: "self_attn.q_proj",
    T.ATTN_Q_A: "self_attn.q_a_proj",
    T.ATTN_Q_A_NORM: "self_attn.q_a_layernorm",
    T.ATTN_Q_B: "self_attn.q_b_proj",
    T.ATTN_KV_A_MQA: "self_attn.kv_a_proj_with_mqa",
    T.ATTN_KV_A_NORM: "self_attn.kv_a_layernorm",
    T.ATTN_KV_B: "self_attn.kv_b_proj",
    T.ATTN_OUT: "self_attn.o_proj",
}
DEEPSEEK_MOE = {
    T.FFN_GATE_INP: "mlp.gate",
    T.FFN_EXP_PROBS_B: "mlp.gate.e_score_correction",
    T.FFN_GATE_SHEXP: "mlp.shared_experts.gate_proj",
    T.FFN_UP_SHEXP: "mlp.shared_experts.up_proj",
    T.FFN_DOWN_SHEXP: "mlp.shared_experts.down_proj",
}

LAYOUTS: dict[str, Layout] = {
    "llama": Layout(LLAMA_LAYER | {T.FFN_GATE_INP: "block_sparse_moe.gate"}, experts=MIXTRAL_EXPERTS,
                    permuted_qk=True, config_only=frozenset({T.ROPE_FREQS, T.ATTN_ROT_EMBD})),
    "qwen2": Layout(LLAMA_LAYER),
    "qwen3": Layout(LLAMA_LAYER | QK_NORM),
    "qwen3moe": Layout(PRE_NORMS | ATTENTION | QK_NORM | {T.FFN_GATE_INP: "mlp.gate"}, experts=QWEN_EXPERTS),
    "gemma": Layout(LLAMA_LAYER, shifted_norms=True),
    "gemma2": Layout(SANDWICH_NORMS | ATTENTION | GATED_MLP, shifted_norms=True),
    "gemma3": Layout(SANDWICH_NORMS | ATTENTION | GATED_MLP | QK_NORM, shifted_norms=True),
    "phi3": Layout(
        {
            T.ATTN_NORM: "input_layernorm",
            T.ATTN_QKV: "self_attn.qkv_proj",
            T.ATTN_OUT: "self_attn.o_proj",
            T.FFN_NORM: "post_attention_layernorm",
            T.FFN_UP: "mlp.gate_up_proj",  # gate and up fused, gate first, in both formats
            T.FFN_DOWN: "mlp.down_proj",
        },
        config_only=frozenset({T.ROPE_FACTORS_LONG, T.ROPE_FACTORS_SHORT}),
    ),
    "phi2": Layout(
        {
            T.ATTN_NORM: "input_layernorm",
            T.ATTN_Q: "self_attn.q_proj",
            T.ATTN_K: "self_attn.k_proj",
            T.ATTN_V: "self_attn.v_proj",
            T.ATTN_OUT: "self_attn.dense",
            T.FFN_UP: "mlp.fc1",
            T.FFN_DOWN: "mlp.fc2",
        },
        final_norm="model.final_layernorm",
        split_qkv=True,
    ),
    "stablelm": Layout(LLAMA_LAYER, per_head_qk_norm=True, config_only=frozenset({T.ROPE_FREQS})),
    "glm4": Layout(
        {
            T.ATTN_NORM: "input_layernorm",
            **ATTENTION,
            T.ATTN_POST_NORM: "post_self_attn_layernorm",
            T.FFN_NORM: "post_attention_layernorm",
            T.FFN_POST_NORM: "post_mlp_layernorm",
            T.FFN_UP: "mlp.gate_up_proj",
            T.FFN_DOWN: "mlp.down_proj",
        },
        split_qkv=True,
        config_only=frozenset({T.ROPE_FREQS}),
    ),
    # Dense first layers keep gate/up/down_proj; the others route to experts beside a shared one.
    "deepseek2": Layout(PRE_NORMS | LATENT_ATTENTION | GATED_MLP | DEEPSEEK_MOE, experts=DEEPSEEK_EXPERTS,
                        split_kv_b=True, underscored_suffix=frozenset({T.FFN_EXP_PROBS_B})),
}

BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
QKV = gguf_block_name(T.ATTN_QKV)
KV_B, K_B, V_B = (gguf_block_name(tensor) for tensor in (T.ATTN_KV_B, T.ATTN_K_B, T.ATTN_V_B))
Q_NORM, K_NORM = gguf_block_name(T.ATTN_Q_NORM), gguf_block_name(T.ATTN_K_NORM)


def tensor_recipes(file: GGUFFile, arch: str, config: dict) -> dict[str, TensorRecipe]:
    """Every Hugging Face tensor the file holds, by name, in the file's order."""
    builder = _RecipeBuilder(file, LAYOUTS[arch], config)
    for info in file.tensors.values():
        builder.add(info)
    return builder.recipes


class _RecipeBuilder:
    def __init__(self, file: GGUFFile, layout: Layout, config: dict) -> None:
        self.file, self.layout, self.config = file, layout, config
        self.layer_names = {gguf_block_name(tensor): hf for tensor, hf in layout.layer.items()}
        self.expert_names = {gguf_block_name(tensor): hf for tensor, hf in
                             (layout.experts.names.items() if layout.experts else ())}
        self.top_names = {
            TENSOR_NAMES[T.TOKEN_EMBD]: "model.embed_tokens",
            TENSOR_NAMES[T.OUTPUT_NORM]: layout.final_norm,
            TENSOR_NAMES[T.OUTPUT]: "lm_head",
        }
        self.underscored = {gguf_block_name(tensor) for tensor in layout.underscored_suffix}
        self.config_only = {TENSOR_NAMES[tensor] for tensor in layout.config_only}
        self.config_only |= {gguf_block_name(tensor) for tensor in layout.config_only}
        self.recipes: dict[str, TensorRecipe] = {}

    def add(self, info: TensorInfo) -> None:
        stem, suffix = split_suffix(info.name)
        block = BLOCK_TENSOR.fullmatch(stem)
        if block is None:
            self._add_top_level(info, stem, suffix)
        else:
            self._add_block(info, int(block.group(1)), block.group(2), suffix)

    def _add_top_level(self, info: TensorInfo, stem: str, suffix: str) -> None:
        if stem in self.config_only:
            return
        if stem not in self.top_names:
            raise self._unknown(info)
        self._put(hf_name(self.top_names[stem], suffix), TensorRecipe(info.name, info.shape, fix=self._fix(info)))

    def _add_block(self, info: TensorInfo, layer: int, part: str, suffix: str) -> None:
        if part in self.config_only:
            return
        if layer >= self.config["num_hidden_layers"]:
            layers = self.config["num_hidden_layers"]
            raise CheckpointError(self.file.path, f"holds tensor {info.name!r} but declares only {layers} blocks")
        prefix = f"model.layers.{layer}."
        if self.layout.split_qkv and part == QKV:
            self._split_qkv(info, prefix, suffix)
        elif self.layout.per_head_qk_norm and part in (Q_NORM, K_NORM):
            module = "self_attn.q_layernorm" if part == Q_NORM else "self_attn.k_layernorm"
            self._split_heads(info, prefix + module, suffix)
        elif part in self.expert_names:
            self._split_experts(info, prefix, self.expert_names[part], suffix)
        elif self.layout.split_kv_b and part in (K_B, V_B):
            self._join_kv_b(info, layer, part, prefix, suffix)
        elif part in self.layer_names:
            module = prefix + self.layer_names[part]
            name = f"{module}_{suffix}" if part in self.underscored else hf_name(module, suffix)
            recipe = TensorRecipe(info.name, info.shape, reorder_rows=self._reorder_rows(part), fix=self._fix(info))
            self._put(name, recipe)
        else:
            raise self._unknown(info)

    def _unknown(self, info: TensorInfo) -> CheckpointError:
        hf_class = self.config["architectures"][0]
        problem = f"holds tensor {info.name!r}, which {hf_class} has no place for; is it a plain {hf_class}?"
        return CheckpointError(self.file.path, problem)

    def _put(self, name: str, recipe: TensorRecipe) -> None:
        if name in self.recipes:
            other = self.recipes[name].source
            raise CheckpointError(self.file.path, f"holds both {other!r} and {recipe.source!r} for {name!r}")
        self.recipes[name] = recipe

    def _fix(self, info: TensorInfo) -> Callable[[np.ndarray], np.ndarray] | None:
        if self.layout.shifted_norms and info.name.endswith("norm.weight"):
            return subtract_one
        return None

    def _reorder_rows(self, part: str) -> Callable[[np.ndarray], np.ndarray] | None:
        if self.layout.permuted_qk and part == gguf_block_name(T.ATTN_Q):
            return partial(unpermute_rope_rows, n_heads=self.config["num_attention_heads"])
        if self.layout.permuted_qk and part == gguf_block_name(T.ATTN_K):
            return partial(unpermute_rope_rows, n_heads=self.config["num_key_value_heads"])
        return None

    def _split_qkv(self, info: TensorInfo, prefix: str, suffix: str) -> None:
        head_dim = self.config["head_dim"]
        sizes = {
            "q_proj": self.config["num_attention_heads"] * head_dim,
            "k_proj": self.config["num_key_value_heads"] * head_dim,
            "v_proj": self.config["num_key_value_heads"] * head_dim,
        }
        if info.shape[0] != sum(sizes.values()):
            problem = f"tensor {info.name!r} has {info.shape[0]} rows; q, k and v need {sum(sizes.values())} {sizes}"
            raise CheckpointError(self.file.path, problem)
        start = 0
        for module, size in sizes.items():
            recipe = TensorRecipe(info.name, (size, *info.shape[1:]), rows=(start, start + size))
            self._put(hf_name(f"{prefix}self_attn.{module}", suffix), recipe)
            start += size

    def _split_heads(self, info: TensorInfo, module: str, suffix: str) -> None:
        head_dim = self.config["head_dim"]
        if len(info.shape) != 2 or info.shape[1] != head_dim:
            problem = f"tensor {info.name!r} is {list(info.shape)}, expected one row of {head_dim} per head"
            raise CheckpointError(self.file.path, problem)
        for head in range(info.shape[0]):
            recipe = TensorRecipe(info.name, (head_dim,), rows=(head, head + 1))
            self._put(hf_name(f"{module}.norms.{head}", suffix), recipe)


    def _join_kv_b(self, info: TensorInfo, layer: int, part: str, prefix: str, suffix: str) -> None:
        """kv_b_proj from the attn_k_b and attn_v_b llama.cpp's converters write since April 2025 (the
        recipe made at attn_k_b), or from attn_kv_b where the file holds that too."""
        key, value, whole = (f"blk.{layer}.{name}.{suffix}" for name in (K_B, V_B, KV_B))
        if whole in self.file.tensors:
            return
        missing = next((name for name in (key, value) if name not in self.file.tensors), None)
        if missing is not None:
            raise CheckpointError(self.file.path, f"holds {info.name!r} but not {missing!r}, its other half")
        if part == V_B:
            return
        c = self.config
        heads, rank, nope, width = (c["num_attention_heads"], c["kv_lora_rank"], c["qk_nope_head_dim"],
                                    c["v_head_dim"])
        for name, shape in ((key, (heads, rank, nope)), (value, (heads, width, rank))):
            if self.file.tensors[name].shape != shape:
                problem = f"tensor {name!r} is {list(self.file.tensors[name].shape)}, expected {list(shape)}"
                raise CheckpointError(self.file.path, f"{problem} (heads, rows, columns)")
        recipe = TensorRecipe(key, (heads * (nope + width), rank), joined=value, join=joined_kv_b)
        self._put(hf_name(f"{prefix}{self.layer_names[KV_B]}", suffix), recipe)

    def _split_experts(self, info: TensorInfo, prefix: str, module: str, suffix: str) -> None:
        c = self.config
        experts = c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts")
        if not experts:
            raise self._unknown(info)
        if len(info.shape) != 3 or info.shape[0] != experts:
            problem = f"tensor {info.name!r} is {list(info.shape)}, expected [{experts} experts, rows, columns]"
            raise CheckpointError(self.file.path, problem)
        rows = info.shape[1]
        block = f"{prefix}{self.layout.experts.block}.experts"
        for expert in range(experts):
            recipe = TensorRecipe(info.name, info.shape[1:], rows=(expert * rows, (expert + 1) * rows))
            self._put(hf_name(f"{block}.{expert}.{module}", suffix), recipe)


def split_suffix(name: str) -> tuple[str, str]:
    stem, _, suffix = name.rpartition(".")
    return (stem, suffix) if suffix in ("weight", "bias") else (name, "")


def hf_name(module: str, suffix: str) -> str:
    return f"{module}.{suffix}" if suffix else module


def subtract_one(weights: np.ndarray) -> np.ndarray:
    weights -= 1.0
    return weights


def joined_kv_b(key: np.ndarray, value: np.ndarray) -> np.ndarray:
    """DeepSeek's kv_b_proj, [heads * (qk_nope + v_head), kv_lora_rank], each head's key rows then its
    value rows, from llama.cpp's attn_k_b, [heads, kv_lora_rank, qk_nope] (each head's key rows
    transposed), and attn_v_b, [heads, v_head, kv_lora_rank]."""
    heads, rank, _ = key.shape
    return np.concatenate([key.transpose(0, 2, 1), value], axis=1).reshape(-1, rank)


def unpermute_rope_rows(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a q/k weight or bias (or of a weight's blocks).

    The converter views each head's rows as (2, head_dim/2) and transposes them, moving row
    i * head_dim/2 + j to 2j + i; viewing them as (head_dim/2, 2) and transposing moves it back.
    """
    half = weights.shape[0] // n_heads // 2
    restored = weights.reshape(n_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(restored.reshape(weights.shape))
