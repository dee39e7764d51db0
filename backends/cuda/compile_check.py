"""The cuda backend's Triton kernels compiled for a GPU that need not be here.

    python -m candelabra.backends.cuda.compile_check [--target sm_90a sm_80] [--config FILE ...]
                                                     [--dtype bfloat16 ...] [--kv-dtype int8 fp8] [--json FILE]

Every specialization the backend launches for the given models (default: bench/configs/*) is built for
each target by Triton and assembled by the ptxas inside Triton's wheel, and a table says, per kernel and
variant: registers per thread, bytes spilled to local memory, shared memory, and the matrix instruction
its dots became (wgmma on sm_90a's tensor cores, mma.sync on sm_80's, fma where none was used).

The variants are found, not listed: each kernel's own launch code runs on CPU tensors of a model's shapes
(one decoder layer's ops at the batch shapes serving uses: decode steps of every CUDA-graph size, prefill
chunks, mixed steps, a mixture-of-experts model's experts at each of those token counts; sampling; the
int4 GEMM at every band of rows) with Triton's launcher replaced by a recorder, planning its grids for
the target's SM count. The KV cache is in the compute dtype, or in each of `--kv-dtype`'s (a quantized
cache's write and attention kernels are variants of their own; fp8 only for targets of sm_89 and later,
where the backend offers it). What is compiled is what those wrappers would launch on that GPU. Needs
TRITON_INTERPRET unset: under the interpreter nothing is compiled.

A variant fails when it does not compile, spills where its kernel's docstring says it does not (`SPILL_FREE`),
needs more shared memory than one block may have on the target, or, where a kernel is bound by the
instructions it issues (`INSTRUCTION_BUDGETS`: the GEMVs), its innermost loop issues more machine
instructions per unit of work than its docstring allows (counted in the SASS that the nvdisasm inside
Triton's wheel prints from the cubin), or, launched as a dependent of the kernel before it (sm_90a on,
kernels/dependent_launch.py), its PTX writes global memory or ends before it waits for that kernel.

The specialization of a launch is computed the way `JITFunction.run` computes it, through Triton's own
binder and `_pack_args`, which are internal to Triton 3.5 and 3.6 (the versions the `cuda` extra allows).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from candelabra.backends.cuda.availability import (
    assume_capability,
    assume_gpu,
    assume_multiprocessors,
    interpreting,
    multiprocessor_count,
)
from candelabra.core.contract.dtypes import KV_DTYPES
from candelabra.core.contract.kv_cache import KVCacheSpec
from candelabra.core.models.config import LatentAttentionConfig


@dataclass(frozen=True)
class Target:
    name: str  # what ptxas is told: sm_90a, sm_80
    capability: int  # 90, 80
    multiprocessors: int  # of the GPU the grids are planned for
    shared_memory_per_block: int  # bytes one block may use once it opts in
    gpus: tuple[str, ...] = ()  # the GPU models of this target whose measured GEMV tables are built too


# H100 SXM (132 SMs, 227 KiB per block) and A100 (108 SMs, 163 KiB per block).
TARGETS = {
    "sm_90a": Target("sm_90a", 90, 132, 227 * 1024, gpus=("NVIDIA H200",)),
    "sm_80": Target("sm_80", 80, 108, 163 * 1024),
}
DEFAULT_CONFIGS = Path(__file__).resolve().parents[2] / "bench" / "configs"


@dataclass(frozen=True)
class Claim:
    """What a kernel's docstring says of some of its variants on one target."""

    target: str
    markers: tuple[str, ...]  # a variant is claimed when its description holds every word of one; () for all
    where: str  # the docstring that says so

    def covers(self, target: str, variant: str) -> bool:
        words = set(variant.split())
        return self.target == target and (not self.markers or any(set(marker.split()) <= words
                                                                  for marker in self.markers))


@dataclass(frozen=True)
class SpillFreeClaim(Claim):
    """ptxas builds these variants without spills."""


# Spills are reported for every variant and fail the check where a docstring claims there are none.
SPILL_FREE: dict[str, SpillFreeClaim] = {
    "_attention_tile_kernel": SpillFreeClaim("sm_90a", ("DOT_DTYPE=bf16", "DOT_DTYPE=fp16"),
                                             "kernels/paged_attention.py choose_tiling"),
    "_int4_matmul_kernel": SpillFreeClaim("sm_90a", (), "kernels/int4_matmul.py choose_config"),
    "_int4_gemv_kernel": SpillFreeClaim("sm_90a", (), "kernels/int4_matmul.py choose_config"),
    "_dense_gemv_kernel": SpillFreeClaim("sm_90a", (), "kernels/dense_gemv.py"),
    "_gate_up_kernel": SpillFreeClaim("sm_90a", (), "kernels/fused_moe.py choose_tiles"),
    "_down_kernel": SpillFreeClaim("sm_90a", (), "kernels/fused_moe.py choose_tiles"),
    "_latent_attention_kernel": SpillFreeClaim("sm_90a", ("DOT_DTYPE=bf16 CODES=none", "DOT_DTYPE=fp16 CODES=none"),
                                               "kernels/latent_attention.py choose_latent_tiling"),
}


@dataclass(frozen=True)
class InstructionBudget(Claim):
    """The claimed variants' innermost loop issues at most `most` SASS instructions a thread per unit of
    work (a weight, for the GEMVs)."""

    most: float
    unit: str
    units: Callable[[dict, int], float]  # (constexprs by name, warps) -> units a thread takes per trip of the loop


# In the time HBM delivers an int4 weight, an H200 issues about four instructions a thread and an H100 six
# (kernels/int4_matmul.py): past that the GEMV is bound by issue, not bytes. Tiles 32 x 512 are what
# Llama-class shapes get on a GPU without a measured table; narrower K (a 0.5B model's 896) takes
# shallower tiles and more per weight. A measured table's tilings are held to what they measured (16-wide
# ones, at 4.5 to 4.8 instructions a weight, streamed gate/up and down fastest on an H200, and 32-wide ones
# at 4 warps, 4.7 with groups of 128, the attention's output projection).
def _weights_a_thread(constexprs: dict, warps: int) -> float:
    return constexprs["BLOCK_N"] * constexprs["BLOCK_K"] / (32 * warps)


# The 16-bit GEMV has about fourteen instructions a weight to spend on an H200 (kernels/dense_gemv.py), but
# its layout decides whether a thread converts an x for every weight: 5.6 a weight so, 4.1 to 4.4 as it is.
# With a gated MLP's activation computed as it loads x, each x costs 17 to 24 more (SiLU, GELU's tanh form),
# shared by the BLOCK_N outputs a thread takes: 6.3 to 7.2 a weight at 8 outputs, 8.7 to 10.5 at 4, still
# under the fourteen. Normalising x as it loads it (the residual added, the norm's weight applied, its squares
# summed, the first column tile storing x + residual) issued 4.3 to 5.0 a weight at 8 to 32 outputs, 5.7 to
# 6.1 at 4 (Llama-3-8B's shapes).
INSTRUCTION_BUDGETS: dict[str, tuple[InstructionBudget, ...]] = {  # per kernel, the first covering a variant
    "_int4_gemv_kernel": (InstructionBudget("sm_90a", ("BLOCK_N=32 BLOCK_K=512 w2s1",),
                                            "kernels/int4_matmul.py GEMV_CONFIG", 4.5, "weight", _weights_a_thread),),
    "_dense_gemv_kernel": (
        InstructionBudget("sm_90a", ("NORM=True",), "kernels/dense_gemv.py (normalised x)", 6.5, "weight",
                          _weights_a_thread),
        InstructionBudget("sm_90a", ("GATE=-1",), "kernels/dense_gemv.py", 4.5, "weight", _weights_a_thread),
        InstructionBudget("sm_90a", ("GATE=0", "GATE=1", "GATE=2"), "kernels/dense_gemv.py (gated x)", 12.0,
                          "weight", _weights_a_thread),
    ),
}


# Decode steps are replayed at these batch sizes (graphs.CAPTURE_SIZES up to 64 covers every decode
# split the attention kernel chooses); prefill and mixed steps at these query lengths.
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_LENGTHS = (2, 5, 17, 100, 2048)
INT4_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 2048)
# A scale group of several runs of 32 changes no tiling, only where a run finds its scale: its variants
# are built for the GEMV, a decode tile and a prefill tile.
GPTQ_GROUP = 128
GPTQ_INT4_ROWS = (1, 16, 2048)
BLOCK_SIZE = 16


# Recording launches.

@dataclass
class Launch:
    kernel: object  # a triton JITFunction
    args: tuple
    kwargs: dict
    grid: tuple = ()

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@contextlib.contextmanager
def recording_launches(target: Target) -> Iterator[list[Launch]]:
    """Inside, a Triton kernel launch is recorded instead of run, and grids are planned for `target`."""
    if interpreting():
        raise RuntimeError("TRITON_INTERPRET=1: the kernels are interpreted, not compiled; unset it to compile them")
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs, tuple(grid)))

    original = JITFunction.run
    JITFunction.run = record
    try:
        with assume_multiprocessors(target.multiprocessors), assume_capability(*divmod(target.capability, 10)):
            yield launches
    finally:
        JITFunction.run = original


# One model's launches.

@dataclass(frozen=True)
class Workload:
    """What a model asks of the kernels: its ModelConfig's shapes and its class's choices."""

    label: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    intermediate: int
    vocab: int
    windows: tuple[int | None, ...]  # per attention kind in the model: None is full attention
    softcap: float | None
    norm: str  # "rms" or "layer"
    mlp: str  # "silu_and_mul", "gelu_and_mul" or "gelu"
    gelu_approximation: str
    rotary_style: str
    experts: int = 0  # routed experts of a mixture-of-experts model's sparse layers; 0 for a dense model
    experts_per_token: int = 0
    expert_intermediate: int = 0
    mla: LatentAttentionConfig | None = None  # latent attention (DeepSeek) in place of paged attention

    @classmethod
    def from_hf_config(cls, label: str, config: dict) -> Workload:
        from candelabra.core.models.base import _gelu_approximation
        from candelabra.core.models.config import ModelConfig
        from candelabra.plugins import installed_plugins

        model = ModelConfig.from_hf(config)
        model_class = installed_plugins().model_architectures.get(model.architecture)
        act = model.hidden_act
        mlp = ("silu_and_mul" if act == "silu" else "gelu_and_mul") if model_class.gated_mlp else "gelu"
        windows = tuple(sorted({model.window_of(layer) for layer in range(model.num_layers)},
                               key=lambda window: window or 0))
        moe = model.moe
        return cls(label=label, hidden=model.hidden_size, heads=model.num_heads, kv_heads=model.num_kv_heads,
                   head_dim=model.head_dim, rotary_dim=model.rotary_dim, intermediate=model.intermediate_size,
                   vocab=model.vocab_size, windows=windows, softcap=model.attn_logit_softcapping,
                   norm=model_class.norm_kind, mlp=mlp,
                   gelu_approximation="none" if act == "silu" else _gelu_approximation(act),
                   rotary_style=model_class.rotary_style, experts=moe.num_experts if moe else 0,
                   experts_per_token=moe.experts_per_token if moe else 0,
                   expert_intermediate=moe.expert_intermediate_size if moe else 0, mla=model.mla)

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(N, K) of each linear layer: qkv (with latent attention, its input projection and the query's
        up-projection where it has one), attention out, gate/up (or up), down, LM head."""
        mlp_in = 2 * self.intermediate if self.mlp != "gelu" else self.intermediate
        mlp_and_head = [(mlp_in, self.hidden), (self.hidden, self.intermediate), (self.vocab, self.hidden)]
        if self.mla is not None:  # core/models/deepseek.py's projections
            mla, q_width = self.mla, self.heads * self.mla.qk_head_dim
            latent_in = (mla.q_lora_rank or q_width) + mla.kv_lora_rank + mla.qk_rope_head_dim
            q_up = [(q_width, mla.q_lora_rank)] if mla.q_lora_rank else []
            return [(latent_in, self.hidden), *q_up, (self.hidden, self.heads * mla.v_head_dim), *mlp_and_head]
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(q_width + 2 * kv_width, self.hidden), (self.hidden, q_width), *mlp_and_head]

    def normed_shapes(self) -> dict[tuple[int, int], tuple[bool, ...]]:
        """(N, K) of each linear layer that reads an RMS norm's output (`Ops.rms_norm_linear`), with whether
        the norm adds a residual first: a layer's qkv (latent attention's input projection) with one, and
        the first layer's without; a plain dense MLP's up projection with one; the LM head and the query's
        up-projection without. None for a model of layer norms. (A gated MLP's gate and up: `gated_mlp_in`.)"""
        if self.norm != "rms":
            return {}
        shapes = self.linear_shapes()
        normed = {shapes[0]: (True, False), (self.vocab, self.hidden): (False,)}
        if self.mla is not None and self.mla.q_lora_rank:
            normed[shapes[1]] = (False,)
        if self.mlp == "gelu":
            mlp_in = (self.intermediate, self.hidden)
            normed[mlp_in] = tuple(sorted({*normed.get(mlp_in, ()), True}))
        return normed

    def gated_mlp_in(self) -> tuple[tuple[int, int], str] | None:
        """(N, K) of a dense gated MLP's gate and up weight after an RMS norm, which `Ops.rms_norm_gated_mlp`
        multiplies normalising x (after a residual add) and writing the gated values, with its activation (a
        mixture of experts may have dense layers too: DeepSeek's first); None for other models."""
        if self.norm != "rms" or self.mlp == "gelu":
            return None
        activation = {"silu_and_mul": "silu", "gelu_and_mul": "gelu_tanh" if self.gelu_approximation == "tanh"
                      else "gelu"}[self.mlp]
        return (2 * self.intermediate, self.hidden), activation


def launch_workload(workload: Workload, dtype: str, kv_dtypes: tuple[str, ...],
                    steps: list[list[int]] | None = None, gpus: tuple[str, ...] = ()) -> None:
    """Run the kernels' launch code for one decoder layer of `workload` at every step shape serving uses
    (its routed experts too, for a mixture-of-experts model), then sampling and the int4 GEMMs (inside
    `recording_launches`, nothing runs). `steps` (query lengths per sequence) replaces the step shapes
    of attention and the cache write; the GEMVs are launched again at every tiling start-up measurement
    tries (gemv_tuning) and as each of `gpus`' measured tables tiles them."""
    import torch

    from candelabra.backends.cuda.gemv_tuning import dense_candidates, int4_candidates
    from candelabra.backends.cuda.kernels import activations, dense_gemv, norms, rotary, sampling
    from candelabra.backends.cuda.kernels.gemv_tilings import measured_tilings
    from candelabra.backends.cuda.kernels.int4_matmul import GROUP_SIZE, int4_matmul, normed_int4_gemv
    from candelabra.backends.cuda.kernels.paged_attention import DecodeRotary, fuses_rotary, paged_attention
    from candelabra.backends.torch.dtypes import torch_dtype

    compute = torch_dtype(dtype)
    w = workload
    for rows in (1, 64):
        x = torch.empty(rows, w.hidden, dtype=compute)
        if w.norm == "rms":
            weight = torch.empty(w.hidden, dtype=compute)
            norms.rms_norm(x, weight, 1e-6)
            norms.add_rms_norm(x, torch.empty_like(x), weight, 1e-6)
        projected = torch.empty(rows, w.intermediate * (1 if w.mlp == "gelu" else 2), dtype=compute)
        if w.mlp == "silu_and_mul":
            activations.silu_and_mul(projected)
        elif w.mlp == "gelu_and_mul":
            activations.gelu_and_mul(projected, w.gelu_approximation)
        else:
            activations.gelu(projected, w.gelu_approximation)

    for kv_dtype in kv_dtypes:
        for query_lens in steps or _step_shapes():
            step = _cuda_step(query_lens)
            if w.mla is not None:
                _launch_latent_attention(w, step, compute, kv_dtype)
                continue
            tokens = step.num_tokens
            blocks = int(step.block_tables.max()) + 1
            key_cache = _cache(blocks, w.kv_heads, w.head_dim, kv_dtype)
            value_cache = torch.empty_like(key_cache)
            q = torch.empty(tokens, w.heads, w.head_dim, dtype=compute)
            k = torch.empty(tokens, w.kv_heads, w.head_dim, dtype=compute)
            cos_sin = torch.empty(max(query_lens) * 4, w.rotary_dim, dtype=torch.float32)
            # a step of decodes over a float cache rotates and writes its keys in the attention's launch
            # (Ops.rotary_and_paged_attention); other steps in the rotary kernel first
            in_attention = DecodeRotary(k, torch.empty_like(k), step.rope_positions, cos_sin, w.rotary_style,
                                        step.slot_mapping)
            if not fuses_rotary(q, key_cache, value_cache, step, in_attention):
                in_attention = None
                rotary.rotary_write_kv(q, k, torch.empty_like(k), step.rope_positions, cos_sin, w.rotary_style,
                                       key_cache, value_cache, step.slot_mapping)
            rotary.write_kv(key_cache, value_cache, k, torch.empty_like(k), step.slot_mapping)
            for window in w.windows:
                paged_attention(q, key_cache, value_cache, step, w.head_dim ** -0.5, window, w.softcap, in_attention)

    if w.experts:
        launch_experts(w, compute)

    # a batch that draws among candidates and one past them, which searches in split passes
    for sampling_rows in (4, sampling.CANDIDATE_ROWS + 1):
        logits = torch.empty(sampling_rows, w.vocab, dtype=torch.float32)
        for temperature, top_k, top_p in ((0.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 0, 0.9), (0.7, 40, 0.9)):
            sampling.sample(logits, _sampling(sampling_rows, w.vocab, temperature, top_k, top_p))

    # the 16-bit GEMV at every tiling start-up measurement tries, and those the GPUs' dense tables chose; the
    # down projection of a gated MLP also with its activation computed as it loads x (Ops.gated_linear), the
    # projections of a norm's output with the norm (Ops.rms_norm_linear), and a gated MLP's gate and up with the
    # norm, writing the gated values (Ops.rms_norm_gated_mlp)
    sm_count = multiprocessor_count(torch.device("cuda"))
    normed = w.normed_shapes() if compute in dense_gemv.DTYPES else {}
    gate_up, gate_output = w.gated_mlp_in() or (None, None)

    def normed_row(width: int, residual: bool):
        """An x [1, width] and the RMS norm a GEMV applies to it, after a residual add where `residual`."""
        row = torch.empty(1, width, dtype=compute)
        return row, norms.RowNorm(torch.empty(width, dtype=compute), 1e-6, 0.0,
                                  torch.empty_like(row) if residual else None)

    if compute in dense_gemv.DTYPES:
        down = (w.hidden, w.intermediate)
        gated = {"silu_and_mul": "silu", "gelu_and_mul": "gelu_tanh" if w.gelu_approximation == "tanh" else "gelu"}
        for columns, width in w.linear_shapes():
            tilings = set(dense_candidates(columns, width, sm_count))
            tilings |= {measured_tilings(gpu, "dense").get((columns, width)) for gpu in gpus} - {None}
            weight = torch.empty(columns, width, dtype=compute)
            for tiling in sorted(tilings, key=repr):
                dense_gemv.dense_gemv(torch.empty(1, width, dtype=compute), weight, tiling)
                if (columns, width) == down and w.mlp in gated:
                    dense_gemv.dense_gemv(torch.empty(1, 2 * width, dtype=compute), weight, tiling,
                                          gated=gated[w.mlp])
                for residual in normed.get((columns, width), ()):
                    dense_gemv.normed_dense_gemv(*normed_row(width, residual), weight, tiling)
                if (columns, width) == gate_up:
                    dense_gemv.normed_dense_gemv(*normed_row(width, True), weight, tiling, gate_output=gate_output)

    # GGUF's groups of 32 at every batch, GPTQ's and AWQ's usual 128 at a kernel form each; a norm's
    # projections' GEMVs also normalising x as they load it (Ops.rms_norm_linear), at GGUF's groups
    for group, batches in ((GROUP_SIZE, INT4_ROWS), (GPTQ_GROUP, GPTQ_INT4_ROWS)):
        for columns, width in w.linear_shapes():
            if width % group:
                continue
            packed = torch.empty(columns, width // 2, dtype=torch.uint8)
            scales = torch.empty(columns, width // group, dtype=compute)
            for rows in batches:
                int4_matmul(torch.empty(rows, width, dtype=compute), packed, scales, torch.empty_like(scales))
            one_row = [*int4_candidates(columns, width, group, sm_count), None]  # what start-up tries, the fallback
            for config in one_row:
                int4_matmul(torch.empty(1, width, dtype=compute), packed, scales, torch.empty_like(scales), config)
            for gpu in gpus:
                with assume_gpu(gpu):
                    int4_matmul(torch.empty(1, width, dtype=compute), packed, scales, torch.empty_like(scales))
            residuals = normed.get((columns, width), ()) if group == GROUP_SIZE else ()
            for residual, config in itertools.product(residuals, one_row):
                normed_int4_gemv(*normed_row(width, residual), packed, scales, torch.empty_like(scales), config)
            for config in one_row if group == GROUP_SIZE and (columns, width) == gate_up else ():
                normed_int4_gemv(*normed_row(width, True), packed, scales, torch.empty_like(scales), config,
                                 gate_output=gate_output)


def launch_experts(workload: Workload, compute) -> None:
    """`moe_experts` of a mixture-of-experts layer at the token count of every step shape serving uses."""
    import torch

    from candelabra.backends.cuda.kernels.fused_moe import moe_experts

    w = workload
    # never touched: memory the recorded launches only take the strides of
    gate_up = torch.empty(w.experts, 2 * w.expert_intermediate, w.hidden, dtype=compute)
    down = torch.empty(w.experts, w.hidden, w.expert_intermediate, dtype=compute)
    for tokens in sorted({sum(query_lens) for query_lens in _step_shapes()}):
        moe_experts(torch.empty(tokens, w.hidden, dtype=compute),
                    torch.empty(tokens, w.experts_per_token, dtype=torch.float32),
                    torch.empty(tokens, w.experts_per_token, dtype=torch.int32), gate_up, down)


def _cache(blocks: int, heads: int, dim: int, kv_dtype: str):
    """One layer's key (or value) cache in `kv_dtype`, as the backend allocates it."""
    import torch

    from candelabra.backends.torch.dtypes import torch_dtype

    spec = KVCacheSpec(1, blocks, BLOCK_SIZE, heads, dim, kv_dtype)
    return torch.empty(spec.block_shape, dtype=torch_dtype(spec.storage_dtype))


def _launch_latent_attention(w: Workload, step, compute, kv_dtype: str) -> None:
    """What a latent-attention layer launches (core/models/deepseek.py): the query's and the latent's
    norms, rotary with the cache write of the rotary key and the latent, attention over the latent cache."""
    import torch

    from candelabra.backends.cuda.kernels import norms, rotary
    from candelabra.backends.cuda.kernels.latent_attention import paged_latent_attention

    mla, tokens = w.mla, step.num_tokens
    rank, rope_dim, q_width = mla.kv_lora_rank, mla.qk_rope_head_dim, w.heads * mla.qk_head_dim
    projected = torch.empty(tokens, (mla.q_lora_rank or q_width) + rank + rope_dim, dtype=compute)
    for width in filter(None, (mla.q_lora_rank, rank)):
        norms.rms_norm(projected[:, :width], torch.empty(width, dtype=compute), 1e-6)
    blocks = int(step.block_tables.max()) + 1
    rope_cache, latent_cache = _cache(blocks, 1, rope_dim, kv_dtype), _cache(blocks, 1, rank, kv_dtype)
    q = torch.empty(tokens, w.heads, mla.qk_head_dim, dtype=compute)
    cos_sin = torch.empty(int(step.max_query_len) * 4, rope_dim, dtype=torch.float32)
    q_rope = rotary.rotary_write_kv(q[..., mla.qk_nope_head_dim:], projected[:, -rope_dim:].reshape(tokens, 1, -1),
                                    torch.empty(tokens, 1, rank, dtype=compute), step.rope_positions, cos_sin,
                                    w.rotary_style, rope_cache, latent_cache, step.slot_mapping)
    q_latent = torch.empty(w.heads, tokens, rank, dtype=compute).transpose(0, 1)  # as per_head_linear gives it
    paged_latent_attention(q_latent, q_rope, rope_cache, latent_cache, step, mla.qk_head_dim ** -0.5)


def _step_shapes() -> list[list[int]]:
    """Query lengths per sequence: plain decodes of every graph size, one prefill chunk of each length,
    and a chunk beside three decodes."""
    return ([[1] * batch for batch in DECODE_BATCHES] + [[length] for length in PREFILL_LENGTHS]
            + [[length, 1, 1, 1] for length in PREFILL_LENGTHS[:-1]])


def _cuda_step(query_lens: list[int]):
    import torch

    from candelabra.backends.cuda.step import CudaStep
    from candelabra.core.contract.step_metadata import StepMetadata

    seq_lens = [length + 300 if length == 1 else length for length in query_lens]
    tables, next_block = [], 0
    for seq_len in seq_lens:
        count = -(-seq_len // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    meta = StepMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
    return CudaStep.prepare(meta, torch.device("cpu"))


def _sampling(rows: int, vocab: int, temperature: float, top_k: int, top_p: float):
    import torch

    from candelabra.backends.torch.sampling import TorchSampling
    from candelabra.core.contract.step_metadata import plain_sampling

    meta = plain_sampling(temperature, top_p, np.full(rows, 0.5))
    meta.top_k[:] = top_k
    return TorchSampling.prepare(meta, torch.device("cpu"))


# Compiling a launch.

@dataclass
class Compiled:
    kernel: str
    variant: str
    target: str
    registers: int | None = None
    spilled: int | None = None  # bytes stored to local memory for spills
    shared: int | None = None
    mma: str = "-"
    per_unit: float | None = None  # innermost loop's instructions a unit of work, where a budget applies
    dependent_fault: str | None = None  # how a variant launched as a dependent breaks dependent_launch.py's rules
    seconds: float = 0.0
    error: str | None = None
    models: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        found = []
        if self.error:
            found.append(f"does not compile: {self.error}")
        if self.dependent_fault:
            found.append(f"is launched as a dependent of the kernel before it but {self.dependent_fault}")
        claim = SPILL_FREE.get(self.kernel)
        if self.spilled and claim and claim.covers(self.target, self.variant):
            found.append(f"spills {self.spilled} bytes, where {claim.where} says it does not")
        limit = TARGETS[self.target].shared_memory_per_block
        if self.shared is not None and self.shared > limit:
            found.append(f"needs {self.shared} bytes of shared memory, more than the {limit} a block may have")
        budget = self.budget
        if budget and not self.error:
            if self.per_unit is None:
                found.append(f"its loop's instructions a {budget.unit} were not counted (no nvdisasm in Triton's "
                             f"wheel), where {budget.where} says at most {budget.most}")
            elif self.per_unit > budget.most:
                found.append(f"issues {self.per_unit:.2f} instructions a {budget.unit} in its loop, where "
                             f"{budget.where} says at most {budget.most}")
        return found

    @property
    def budget(self) -> InstructionBudget | None:
        return next((budget for budget in INSTRUCTION_BUDGETS.get(self.kernel, ())
                     if budget.covers(self.target, self.variant)), None)


@dataclass
class Specialization:
    signature: dict
    constexprs: dict
    attrs: dict
    options: object

    def identity(self, kernel: str) -> str:
        return repr((kernel, sorted(self.signature.items()), sorted(self.constexprs.items()),
                     sorted(self.attrs.items()), sorted(self.options.__dict__.items())))


def specialization(launch: Launch, target: Target) -> Specialization:
    """What Triton would compile this launch as on `target`."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(_gpu_target(target))
    kwargs = dict(launch.kwargs, debug=launch.kwargs.get("debug", False) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    binder = create_function_from_signature(launch.kernel.signature, launch.kernel.params, backend)
    bound, specialized, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = launch.kernel._pack_args(backend, kwargs, bound, specialized, options)
    return Specialization(signature, constexprs, attrs, options)


def describe(spec: Specialization) -> str:
    """The variant in words: its constexprs (integer arguments of 1 among them), the integer arguments
    Triton specialized as multiples of 16, its pointer element types, warps and stages."""
    signature, constexprs, options = spec.signature, spec.constexprs, spec.options
    names = list(signature)
    constants = [f"{names[path[0]]}={_short(value)}" for path, value in sorted(constexprs.items())
                 if len(path) == 1 and signature[names[path[0]]] == "constexpr"]
    multiples = [names[path[0]] for path in sorted(spec.attrs) if len(path) == 1
                 and not signature[names[path[0]]].startswith("*")]
    pointers = sorted({kind[1:] for kind in signature.values() if kind.startswith("*")})
    return " ".join(constants + ([f"mult16={','.join(multiples)}"] if multiples else [])
                    + ["/".join(pointers), f"w{options.num_warps}s{options.num_stages}"])


def _short(value) -> str:
    text = str(value)
    return text.removeprefix("triton.language.").removeprefix("tl.")


def compile_launch(launch: Launch, spec: Specialization, target: Target) -> Compiled:
    """Build one specialization for `target`; ptxas's report of it is the one Triton's own build printed."""
    from triton import knobs
    from triton.compiler import ASTSource, compile

    compiled = Compiled(launch.name, describe(spec), target.name)
    started = time.perf_counter()
    report = io.StringIO()
    previous = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(report):
            kernel = compile(ASTSource(launch.kernel, spec.signature, spec.constexprs, spec.attrs),
                             target=_gpu_target(target), options=spec.options.__dict__)
    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile is the finding
        lines = str(exc).strip().splitlines()
        compiled.error = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
        return compiled
    finally:
        knobs.nvidia.dump_ptxas_log = previous
    compiled.seconds = time.perf_counter() - started
    compiled.shared = int(kernel.metadata.shared)
    ptx = kernel.asm["ptx"]
    compiled.mma = "wgmma" if "wgmma.mma_async" in ptx else "mma" if "mma.sync" in ptx else "-"
    if getattr(spec.options, "launch_pdl", False):
        compiled.dependent_fault = dependent_fault(ptx)
    compiled.registers, compiled.spilled = parse_ptxas_report(report.getvalue())
    budget = compiled.budget
    prefetches = getattr(spec.options, "launch_pdl", False) and launch.name in PREFETCHING
    sass = disassemble(kernel.asm["cubin"]) if budget or prefetches else None
    if budget and sass is not None:
        names = list(spec.signature)
        constants = {names[path[0]]: value for path, value in spec.constexprs.items() if len(path) == 1}
        compiled.per_unit = longest_loop(sass) / budget.units(constants, spec.options.num_warps)
    if prefetches and sass is not None and not compiled.dependent_fault and not loads_before_wait(sass):
        compiled.dependent_fault = ("loads none of its weight before it waits (no LDG ahead of ACQBULK in its "
                                    "SASS), so nothing streams while the kernel before finishes")
    return compiled


# The kernels that load their first step's weight before they wait for the kernel before (the GEMVs): the
# machine code must keep those loads ahead of the wait, which ptxas could move after it.
PREFETCHING = frozenset({"_dense_gemv_kernel", "_int4_gemv_kernel"})


def loads_before_wait(sass: str) -> int:
    """The global loads (LDG) a program issues before it first waits for the kernel before it (ACQBULK,
    PTX's griddepcontrol.wait), in nvdisasm's listing; all of them where it never waits."""
    wait = re.search(r"\bACQBULK\b", sass)
    return len(re.findall(r"\bLDG\b", sass[:wait.start()] if wait else sass))


# What a program may not do before it waits for the kernel before it (kernels/dependent_launch.py): write
# global memory, or end.
_BEFORE_WAIT = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:st|atom|red)\.global[\w.]*|ret|exit);?", re.MULTILINE)


def dependent_fault(ptx: str) -> str | None:
    """None where the PTX waits for the kernel before (griddepcontrol.wait) ahead of its first global store,
    atomic or return; else what it does wrong."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return "never waits for it"
    early = _BEFORE_WAIT.search(ptx, 0, wait)
    if early:
        return f"writes or ends before it waits for it ({early.group(1)})"
    return None


def disassemble(cubin: bytes) -> str | None:
    """The SASS of a cubin, from the nvdisasm inside Triton's wheel; None where the wheel has none."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        return None
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True, text=True, check=True).stdout


def longest_loop(sass: str) -> int:
    """Instructions from a label to the furthest branch back to it: the longest loop body in the SASS
    (the innermost one, where loops do not nest)."""
    instructions = 0
    labels: dict[str, int] = {}
    longest = 0
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = instructions
            continue
        if not re.search(r"/\*[0-9a-f]{4,}\*/", line):  # an instruction's address: /*0a30*/, /*10a30*/
            continue
        instructions += 1
        branch = re.search(r"\bBRA\b.*?(\.L_x_\d+)", line)
        if branch and branch.group(1) in labels:
            longest = max(longest, instructions - labels[branch.group(1)])
    return longest


def parse_ptxas_report(report: str) -> tuple[int | None, int | None]:
    """(registers per thread, bytes of spill stores) from `ptxas -v`'s report of one kernel."""
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return (int(registers.group(1)) if registers else None), (int(spills.group(1)) if spills else None)


def _gpu_target(target: Target):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", target.capability, 32)


# The whole check.

def check(workloads: list[Workload], targets: list[Target], dtypes: tuple[str, ...],
          progress: Callable[[str], None] = lambda line: None,
          kernels: frozenset[str] | None = None, kv_dtypes: tuple[str, ...] = (),
          steps: list[list[int]] | None = None) -> list[Compiled]:
    """Every distinct specialization the workloads launch (of `kernels` alone, by name, unless None),
    compiled for each target (in a Triton cache of their own, so that every build runs ptxas and reports).
    The KV cache is in each compute dtype unless `kv_dtypes` names others; `steps`: see launch_workload."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as cache:
        previous, knobs.cache.dir = knobs.cache.dir, cache
        try:
            return _check(workloads, targets, dtypes, progress, kernels, kv_dtypes, steps)
        finally:
            knobs.cache.dir = previous


def _check(workloads: list[Workload], targets: list[Target], dtypes: tuple[str, ...],
           progress: Callable[[str], None], kernels: frozenset[str] | None,
           kv_dtypes: tuple[str, ...], steps: list[list[int]] | None) -> list[Compiled]:
    from candelabra.backends.cuda.backend import FP8_CAPABILITY

    results: list[Compiled] = []
    for target in targets:
        found: dict[str, tuple[Launch, Specialization, list[str]]] = {}
        fp8 = target.capability >= FP8_CAPABILITY[0] * 10 + FP8_CAPABILITY[1]
        with recording_launches(target) as launches:
            for workload in workloads:
                for dtype in dtypes:
                    start = len(launches)
                    caches = tuple(kv for kv in kv_dtypes if kv != "fp8" or fp8) if kv_dtypes else (dtype,)
                    launch_workload(workload, dtype, kv_dtypes=caches, steps=steps, gpus=target.gpus)
                    for launch in launches[start:]:
                        if kernels is not None and launch.name not in kernels:
                            continue
                        spec = specialization(launch, target)
                        entry = found.setdefault(spec.identity(launch.name), (launch, spec, []))
                        if workload.label not in entry[2]:
                            entry[2].append(workload.label)
        progress(f"{target.name}: {len(found)} specializations")
        for number, (launch, spec, models) in enumerate(found.values(), 1):
            compiled = compile_launch(launch, spec, target)
            compiled.models = models
            results.append(compiled)
            progress(f"{target.name} {number}/{len(found)} {compiled.kernel} {compiled.variant}: "
                     f"{compiled.seconds:.1f} s{' ' + compiled.error if compiled.error else ''}")
    return results


HEADERS = ("kernel", "variant", "target", "registers", "spilled B", "shared B", "mma", "loop instructions",
           "models")


def table_rows(results: list[Compiled]) -> list[list[str]]:
    return [[r.kernel, r.variant, r.target, _or_dash(r.registers), _or_dash(r.spilled), _or_dash(r.shared), r.mma,
             _per_unit(r), ", ".join(r.models)] for r in sorted(results, key=lambda r: (r.kernel, r.target, r.variant))]


def _per_unit(result: Compiled) -> str:
    budget = result.budget
    return "-" if result.per_unit is None or budget is None else f"{result.per_unit:.2f} a {budget.unit}"


SUMMARY_HEADERS = ("kernel", "target", "variants", "registers", "most spilled B", "most shared B", "mma",
                   "most loop instructions")


def summary_rows(results: list[Compiled]) -> list[list[str]]:
    """Per kernel and target: how many variants, their registers (least to most), the most any spilled
    and the most shared memory any needs, the matrix instructions seen, and where a budget applies, the
    most loop instructions a unit any variant under it issues."""
    grouped: dict[tuple[str, str], list[Compiled]] = {}
    for result in results:
        grouped.setdefault((result.kernel, result.target), []).append(result)
    rows = []
    for (kernel, target), group in sorted(grouped.items()):
        registers = [r.registers for r in group if r.registers is not None]
        rows.append([kernel, target, str(len(group)),
                     f"{min(registers)}-{max(registers)}" if registers else "-",
                     str(max((r.spilled or 0) for r in group)), str(max((r.shared or 0) for r in group)),
                     ", ".join(sorted({r.mma for r in group})),
                     _per_unit(max((r for r in group if r.per_unit is not None), key=lambda r: r.per_unit,
                                   default=group[0]))])
    return rows


def markdown_table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def workloads_from(paths: list[Path]) -> list[Workload]:
    """A workload per config.json (a file, or a folder holding one per model)."""
    files: list[Path] = []
    for path in paths:
        files += sorted(path.glob("*/config.json")) + sorted(path.glob("*.json")) if path.is_dir() else [path]
    configs = [(file.parent.name if file.name == "config.json" else file.stem,
                json.loads(file.read_text(encoding="utf-8"))) for file in files]
    return [Workload.from_hf_config(label, config) for label, config in configs]


def main(argv: list[str] | None = None) -> int:
    from candelabra.core.text_table import format_table

    parser = argparse.ArgumentParser(prog="python -m candelabra.backends.cuda.compile_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--target", nargs="+", choices=sorted(TARGETS), default=["sm_90a", "sm_80"])
    parser.add_argument("--config", nargs="+", type=Path, default=[DEFAULT_CONFIGS],
                        help="config.json files, or folders of them (default: bench/configs)")
    parser.add_argument("--dtype", nargs="+", choices=("bfloat16", "float16", "float32"),
                        default=["bfloat16", "float16", "float32"])
    parser.add_argument("--kv-dtype", nargs="+", choices=KV_DTYPES, default=[],
                        help="KV cache dtypes to launch attention and the cache write at (default: the compute "
                             "dtype); fp8 only for sm_89 and later")
    parser.add_argument("--json", type=Path, help="also write every result as JSON")
    parser.add_argument("--markdown", type=Path, help="also write the summary and every variant as Markdown tables")
    parser.add_argument("--quiet", action="store_true", help="no line per compile")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results = check(workloads_from(args.config), [TARGETS[name] for name in args.target], tuple(args.dtype),
                    progress=(lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr,
                                                                                      flush=True)),
                    kv_dtypes=tuple(args.kv_dtype))
    print(format_table(HEADERS, table_rows(results)))
    print(format_table(SUMMARY_HEADERS, summary_rows(results)))
    failures = [(r, problem) for r in results for problem in r.problems]
    print(f"{len(results)} specializations compiled in {time.perf_counter() - started:.0f} s; "
          f"{len(failures)} problems")
    for result, problem in failures:
        print(f"FAIL {result.kernel} [{result.variant}] on {result.target}: {problem}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n", encoding="utf-8")
    if args.markdown:
        args.markdown.write_text(f"{markdown_table(SUMMARY_HEADERS, summary_rows(results))}\n\n"
                                 f"{markdown_table(HEADERS, table_rows(results))}\n", encoding="utf-8")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
