"""Level 2 of conformance: every architecture against transformers on torch, in float32.

For each family a tiny checkpoint with fresh random weights is made with transformers (a few
layers, hidden size 64, grouped-query attention where the family uses it, a sliding window
shorter than the prompt), saved as safetensors and loaded by candelabra. GGUF cases write such
models as llama.cpp would, in several tensor types, and compare with transformers running the
same quantized-then-dequantized weights; GPTQ and AWQ cases pack random 4-bit codes in each
layout by hand (quantized_checkpoints) and compare with transformers on the dequantized weights;
in-situ quantization cases load a dense checkpoint with `--isq` and compare with transformers running
the weights our quantizers made. The backend's logits for every prompt position must match
transformers' within the float32 NMSE threshold, and 16 greedy tokens decoded through the paged cache
must be transformers' tokens.

In float16 or bfloat16 (`--dtype`) transformers still runs in float32, on the weights rounded to
that dtype, so what is measured is the backend's arithmetic: logits within a per-dtype threshold,
and greedy tokens the same up to the first step whose two best logits lie closer than that
dtype's rounding can tell apart.

A backend without an op a case's family needs (the MoE ops for Mixtral and Qwen3-MoE) reports that
case "not supported", not failed.
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from dataclasses import dataclass, field

import numpy as np

from candelabra.conformance.compare import (
    MODEL_NMSE_THRESHOLDS,
    MOE_MODEL_NMSE_THRESHOLDS,
    QUANTIZED_KV_MODEL_NMSE_THRESHOLDS,
    ROUNDED_ACTIVATIONS_MODEL_NMSE_THRESHOLD,
    nmse,
    round_to,
)
from candelabra.conformance.expert_ties import coarsest, positions_near_expert_ties
from candelabra.conformance.harness import NOT_SUPPORTED
from candelabra.conformance.quantized_checkpoints import Int4Layout, write_int4_checkpoint
from candelabra.core.contract.backend import Backend
from candelabra.core.contract.ops import OpNotSupported
from candelabra.core.contract.step_metadata import StepMetadata
from candelabra.core.worker.model_runner import ModelRunner

VOCAB, PROMPT_TOKENS, GREEDY_TOKENS, BLOCK_SIZE = 211, 21, 16, 16
# A greedy step is a tie, not a failure, when transformers' two best logits are this close, relative
# to the larger of 1 and the best logit, in each compute dtype.
GREEDY_TIE_MARGINS = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_LONGROPE = {
    "max_position_embeddings": 256, "original_max_position_embeddings": 24,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 10 for i in range(8)],
                     "long_factor": [2.0 + i / 4 for i in range(8)]}}
_DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                 n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                 moe_intermediate_size=32, first_k_dense_replace=1)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}


@dataclass(frozen=True)
class ModelCase:
    name: str
    config_class: str  # a transformers configuration class
    settings: dict = field(default_factory=dict)
    prompt_tokens: int = PROMPT_TOKENS
    tensor_parallel: bool = True  # whether the parallel level runs it
    routes_experts: bool = False  # a mixture of experts, held to MOE_MODEL_NMSE_THRESHOLDS
    # A quantized KV cache ("int8", "fp8") the case runs over, where the backend declares it: the logits then
    # carry the cache's error too (QUANTIZED_KV_MODEL_NMSE_THRESHOLDS), and greedy tokens are reported, not
    # required, since that error may tip a close pair of logits.
    kv_cache_dtype: str | None = None


_QWEN3_MOE = {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
              "mlp_only_layers": [1], "norm_topk_prob": False}

MODEL_CASES = [
    ModelCase("llama", "LlamaConfig"),
    ModelCase("llama3.1-rope", "LlamaConfig", {"rope_scaling": _LLAMA3}),
    ModelCase("llama-linear-rope", "LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ModelCase("mistral-sliding-window", "MistralConfig", {"sliding_window": 7}),
    ModelCase("qwen2", "Qwen2Config"),
    ModelCase("qwen2-yarn", "Qwen2Config", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 64}}),
    ModelCase("qwen3", "Qwen3Config", {"head_dim": 32}),
    ModelCase("gemma", "GemmaConfig", {"head_dim": 16, "num_key_value_heads": 1}),
    ModelCase("gemma2", "Gemma2Config", {"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 24,
                                         "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    ModelCase("gemma3", "Gemma3TextConfig", {"head_dim": 16, "sliding_window": 5, "query_pre_attn_scalar": 16,
                                             "layer_types": ["sliding_attention", "sliding_attention",
                                                             "full_attention"]}),
    ModelCase("phi3-longrope", "Phi3Config", _LONGROPE),
    # A prompt past original_max_position_embeddings: every position rotates with the long factors.
    ModelCase("phi3-longrope-long-prompt", "Phi3Config", _LONGROPE, prompt_tokens=30),
    ModelCase("phi2", "PhiConfig", {"num_key_value_heads": 4, "partial_rotary_factor": 0.5}),
    ModelCase("stablelm", "StableLmConfig", {"num_key_value_heads": 4, "use_qkv_bias": True}),
    ModelCase("stablelm-parallel", "StableLmConfig", {"num_key_value_heads": 4, "use_parallel_residual": True}),
    ModelCase("glm4", "Glm4Config", {"head_dim": 16}),
    # 8 experts, 2 a token (at TP=2 each rank holds 4); Mixtral renormalizes their weights, this
    # Qwen3-MoE does not, and keeps a dense MLP in its middle layer.
    ModelCase("mixtral", "MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 7},
              routes_experts=True),
    ModelCase("qwen3-moe", "Qwen3MoeConfig", _QWEN3_MOE, routes_experts=True),
    # Latent attention (no q bottleneck in V2, as in V2-Lite; one in V3), a dense first layer, a shared
    # expert, and routing by groups: 8 experts in 4 groups of which 2 are kept, 2 experts a token. V2
    # with yarn and DeepSeek's mscale; V3 with its sigmoid scores and a random correction bias.
    ModelCase("deepseek-v2", "DeepseekV2Config", {
        **_DEEPSEEK, "q_lora_rank": None, "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}},
        routes_experts=True),
    ModelCase("deepseek-v3", "DeepseekV3Config", {**_DEEPSEEK, "q_lora_rank": 24, "norm_topk_prob": True},
              routes_experts=True),
    # The logit error an int8 KV cache adds: a cache of key and value heads, and a latent cache.
    ModelCase("qwen2-kv-int8", "Qwen2Config", tensor_parallel=False, kv_cache_dtype="int8"),
    ModelCase("deepseek-v3-kv-int8", "DeepseekV3Config", {**_DEEPSEEK, "q_lora_rank": 24, "norm_topk_prob": True},
              tensor_parallel=False, routes_experts=True, kv_cache_dtype="int8"),
]


# GGUF architectures and tensor types for the quantized cases (K-quants cannot be made in Python;
# the default model's Q4_K and Q6_K tensors cover them). The MoE families' experts are in a float type,
# an int8 one and an int4 one; DeepSeek's (its two cases between them writing kv_b_proj whole and split)
# in a float type and an int8 one.
GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma3")
GGUF_TYPES = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
GGUF_MOE_ARCHITECTURES = ("mixtral", "qwen3moe")
GGUF_MOE_TYPES = ("F16", "Q8_0", "Q4_0")
GGUF_DEEPSEEK_ARCHITECTURES = ("deepseek-v2", "deepseek-v3")
GGUF_DEEPSEEK_TYPES = ("F16", "Q8_0")


@dataclass(frozen=True)
class GGUFModelCase:
    """A tiny model written as llama.cpp writes GGUF, 2-D weights (and experts) in `ggml_type`, checked
    against transformers running the same weights quantized and dequantized by gguf. `others` stores some
    projections in other types, as llama.cpp's mixed quantizations (Q4_K_M) do: (transformers' projection
    name, GGML type) pairs."""

    arch: str  # a case of gguf_models.CASES
    ggml_type: str
    others: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return "-".join([f"gguf-{self.arch}-{self.ggml_type.lower()}",
                         *(f"{projection}-{kind.lower()}" for projection, kind in self.others)])

    def type_of(self, parameter: str) -> str:
        """The GGML type the case stores transformers' 2-D parameter `parameter` in."""
        return next((kind for projection, kind in self.others if f".{projection}." in parameter), self.ggml_type)

    @property
    def routes_experts(self) -> bool:
        return self.arch in GGUF_MOE_ARCHITECTURES + GGUF_DEEPSEEK_ARCHITECTURES


# A mixed quantization, as Q4_K_M files mix them: q and k in one format and v in another, gate and up apart too,
# so that both fused projections join parts of two formats.
GGUF_MIXED_CASE = GGUFModelCase("qwen2", "Q5_0", (("v_proj", "Q8_0"), ("up_proj", "Q4_0")))
GGUF_MODEL_CASES = [GGUFModelCase(arch, kind) for arch in GGUF_ARCHITECTURES for kind in GGUF_TYPES] + [
    GGUF_MIXED_CASE] + [
    GGUFModelCase(arch, kind) for arch in GGUF_MOE_ARCHITECTURES for kind in GGUF_MOE_TYPES] + [
    GGUFModelCase(arch, kind) for arch in GGUF_DEEPSEEK_ARCHITECTURES for kind in GGUF_DEEPSEEK_TYPES]


# Hidden and intermediate sizes that 4-bit groups of 128 divide; two layers, for CI's time.
_INT4_SHAPES = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}


@dataclass(frozen=True)
class Int4ModelCase:
    """A tiny model whose linear weights are random 4-bit codes packed as a GPTQ or AWQ checkpoint
    packs them (see quantized_checkpoints), checked against transformers running the dequantized
    weights."""

    name: str
    config_class: str
    layout: Int4Layout
    settings: dict = field(default_factory=lambda: dict(_INT4_SHAPES))
    prompt_tokens: int = PROMPT_TOKENS
    tensor_parallel: bool = False
    routes_experts: bool = False


INT4_MODEL_CASES = [
    Int4ModelCase("gptq-llama-v2-sym-g128", "LlamaConfig", Int4Layout("gptq", 128, sym=True)),
    # act-order: q, k and v share one shuffled g_idx, gate and up another; AutoGPTQ's quantize_config.json
    Int4ModelCase("gptq-qwen2-v1-act-order-g32", "Qwen2Config",
                  Int4Layout("gptq", 32, desc_act=True, v1=True, config_file=True)),
    # one group a row: groups of 128 and 256 repeating its scale and zero
    Int4ModelCase("gptq-llama-v1-sym-per-row", "LlamaConfig", Int4Layout("gptq", -1, sym=True, v1=True)),
    Int4ModelCase("awq-qwen2-g64", "Qwen2Config", Int4Layout("awq", 64)),
    # a mixture of experts packed one linear per expert and projection, as the Hub's GPTQ MoE checkpoints are
    Int4ModelCase("gptq-qwen3-moe-g32", "Qwen3MoeConfig", Int4Layout("gptq", 32, sym=True),
                  {**_QWEN3_MOE, "moe_intermediate_size": 64}, routes_experts=True),
]


# In-situ quantization (--isq): a dense Qwen2 whose in_features are 256 (whole Q4_K super-blocks) but
# for the MLP's down projection, 288, which falls back to Q8_0. One case, for CI's time: the quantizers'
# own tests cover every format.
ISQ_MODEL = ModelCase("qwen2-isq", "Qwen2Config", {"hidden_size": 256, "intermediate_size": 288})


@dataclass(frozen=True)
class ISQModelCase:
    """A dense tiny model saved as safetensors and loaded with its linear weights quantized to `format`
    (an --isq name) at load, checked against transformers running the weights as quantized and
    dequantized."""

    format: str
    base: ModelCase = ISQ_MODEL
    prompt_tokens: int = PROMPT_TOKENS
    tensor_parallel: bool = False
    routes_experts: bool = False

    @property
    def name(self) -> str:
        return f"isq-{self.base.config_class.removesuffix('Config').lower()}-{self.format}"


ISQ_MODEL_CASES = [ISQModelCase("q4k")]


@dataclass
class ModelResult:
    case: str
    architecture: str
    status: str
    nmse: float | None
    greedy: str  # "16/16", or how far it matched and why it stopped
    seed: int
    message: str = ""
    tied_positions: int = 0  # prompt positions left out of the NMSE, routed within rounding of an expert tie
    activations: str | None = None  # what the backend may round x to before quantized products ("int8"), if it said

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def config_json(case: ModelCase) -> dict:
    """`case`'s config.json, as transformers writes it for a model of the case's family."""
    import transformers

    config = getattr(transformers, case.config_class)(**(_COMMON | case.settings))
    record = config.to_dict()
    record["architectures"] = [transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__]
    return record


def make_reference(case: ModelCase | Int4ModelCase, seed: int):
    """A transformers model of `case`'s family with fresh random weights, in float32, attending in plain
    eager math: a fused attention may leave out what the family defines (transformers 5.17 gave Gemma-2
    its SDPA path, which drops the attention logits' soft-cap)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    config = getattr(transformers, case.config_class)(**(_COMMON | case.settings))
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # larger than the default init, so logits spread and greedy rarely ties
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.15)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's, zeros as transformers makes it
                buffer.uniform_(-0.1, 0.1)
    return model.eval()


@contextlib.contextmanager
def quiet_reference():
    """No grad, and none of transformers' notices about its own API (deprecated arguments), which are
    not the backend's doing and would bury the suite's report."""
    import torch

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def reference_logits(model, token_ids: np.ndarray) -> np.ndarray:
    import torch

    with quiet_reference():
        return model(torch.tensor(token_ids, dtype=torch.long)[None]).logits[0].double().numpy()


class _IncrementalReference:
    """transformers decoding with its own KV cache, one token at a time, as its generate() does
    (a cached key keeps the rotation it was written with, as in candelabra's paged cache). With
    `tie_dtype` it also notes whether the newest position routes within that dtype's rounding of an
    expert tie (expert_ties.py), where a correct backend may reach other logits; `prompt_at_tie`, where
    the caller has asked that of the prompt already, answers it for the prompt's last position."""

    def __init__(self, model, prompt: np.ndarray, tie_dtype: str | None = None,
                 prompt_at_tie: bool | None = None) -> None:
        import torch

        self.model, self.torch, self.tie_dtype = model, torch, tie_dtype
        self._run(lambda: model(torch.tensor(prompt, dtype=torch.long)[None], use_cache=True), len(prompt),
                  find_ties=prompt_at_tie is None)
        if prompt_at_tie is not None:
            self.newest_at_expert_tie = tie_dtype is not None and prompt_at_tie

    def feed(self, token: int) -> None:
        self._run(lambda: self.model(self.torch.tensor([[token]]), past_key_values=self.cache, use_cache=True), 1)

    def _run(self, forward, positions: int, find_ties: bool = True) -> None:
        with quiet_reference():
            if self.tie_dtype is None or not find_ties:
                output, tied = forward(), np.zeros(positions, dtype=bool)
            else:
                output, tied = positions_near_expert_ties(self.model, forward, positions, self.tie_dtype)
        self.cache, self.logits = output.past_key_values, output.logits[0, -1].double().numpy()
        self.newest_at_expert_tie = bool(tied[-1])


def _greedy_agreement(backend, runner, reference, prompt, first_token: int, blocks: list[int], dtype: str,
                      routes_experts: bool = False, prompt_at_tie: bool | None = None) -> str:
    """Decode one token per step through the paged cache while transformers, decoding with its
    own cache, picks the same token. Returns how many matched ("16/16" when all did), and where they
    parted, whether transformers' two best logits tied within the dtype's rounding or the position
    routed at an expert tie (`prompt_at_tie`: whether the prompt's last one does, where known)."""
    tokens, next_token = list(prompt), first_token
    expected_stream = _IncrementalReference(reference, prompt, dtype if routes_experts else None, prompt_at_tie)
    for step in range(GREEDY_TOKENS):
        expected_logits = expected_stream.logits
        if next_token != int(np.argmax(expected_logits)):
            second, best = np.sort(expected_logits)[-2:]
            if best - second <= GREEDY_TIE_MARGINS[dtype] * max(1.0, abs(best)):
                return f"{step}/{GREEDY_TOKENS}, then a tie"
            if expected_stream.newest_at_expert_tie:
                return f"{step}/{GREEDY_TOKENS}, then an expert tie"
            return f"{step}/{GREEDY_TOKENS}"
        tokens.append(next_token)
        expected_stream.feed(next_token)
        if step + 1 < GREEDY_TOKENS:
            decode = StepMetadata.build([1], [len(tokens)], [blocks], BLOCK_SIZE)
            next_token = int(np.argmax(backend.to_host(runner.logits(np.array([next_token]), decode))[0]))
    return f"{GREEDY_TOKENS}/{GREEDY_TOKENS}"


def quantized_checkpoint(case) -> bool:
    """Whether the case's linear weights reach the backend quantized (a GGUF file's F16 weights do not), so
    that a backend's activation rounding applies to them."""
    if isinstance(case, GGUFModelCase):
        return case.ggml_type not in ("F16", "F32") or bool(case.others)
    return isinstance(case, (Int4ModelCase, ISQModelCase))


def run_model_case(backend: Backend, case: ModelCase | GGUFModelCase | Int4ModelCase | ISQModelCase, seed: int,
                   dtype: str = "float32") -> ModelResult:
    from candelabra.core.loading.model import load_model
    from candelabra.core.weights.gguf import GGUFCheckpoint
    from candelabra.core.weights.safetensors import SafetensorsCheckpoint

    kv_dtype = getattr(case, "kv_cache_dtype", None)
    if kv_dtype is not None and kv_dtype not in backend.kv_cache_dtypes(dtype):
        return ModelResult(case.name, config_json(case)["architectures"][0], NOT_SUPPORTED, None, "", seed,
                           f"backend {backend.name!r} keeps no {kv_dtype} KV cache in {dtype} (kv_cache_dtypes)")
    with tempfile.TemporaryDirectory() as folder:
        if isinstance(case, GGUFModelCase):
            reference, path = _gguf_reference(case, seed, folder)
            checkpoint = GGUFCheckpoint(path)
            prompt_tokens, vocab = PROMPT_TOKENS, reference.config.vocab_size
        elif isinstance(case, Int4ModelCase):
            reference = make_reference(case, seed)
            checkpoint = SafetensorsCheckpoint(write_int4_checkpoint(reference, case.layout, folder, seed))
            prompt_tokens, vocab = case.prompt_tokens, VOCAB
        elif isinstance(case, ISQModelCase):
            reference, checkpoint = _isq_reference(case, seed, folder)
            prompt_tokens, vocab = case.prompt_tokens, VOCAB
        else:
            reference = make_reference(case, seed)
            reference.save_pretrained(folder)
            checkpoint = SafetensorsCheckpoint(folder)
            prompt_tokens, vocab = case.prompt_tokens, VOCAB
        with checkpoint:
            try:
                model = load_model(checkpoint, backend, dtype)
            except OpNotSupported as exc:
                return ModelResult(case.name, type(reference).__name__, NOT_SUPPORTED, None, "", seed, str(exc))
    prompt = np.random.default_rng(seed).integers(3, vocab, prompt_tokens)
    threshold = (MOE_MODEL_NMSE_THRESHOLDS if case.routes_experts else MODEL_NMSE_THRESHOLDS)[dtype]
    if kv_dtype is not None:
        threshold = max(threshold, QUANTIZED_KV_MODEL_NMSE_THRESHOLDS[kv_dtype])
    activations = backend.activation_rounding() if quantized_checkpoint(case) else None
    if activations is not None:
        threshold = max(threshold, ROUNDED_ACTIVATIONS_MODEL_NMSE_THRESHOLD)
    return _compare(backend, case.name, _rounded(reference, dtype), model, prompt, seed, dtype, threshold, kv_dtype,
                    case.routes_experts, activations)


def _rounded(reference, dtype: str):
    """`reference` with its weights as a model computing in `dtype` holds them, still in float32."""
    if dtype != "float32":
        import torch

        with torch.no_grad():
            for parameter in reference.parameters():
                parameter.copy_(torch.from_numpy(round_to(parameter.numpy(), dtype)))
    return reference


def _gguf_reference(case: GGUFModelCase, seed: int, folder: str):
    """The GGUF file of a fresh tiny model, and that model with the weights the file holds."""
    import torch
    from gguf import GGMLQuantizationType

    from candelabra.conformance.gguf_models import convert_to_gguf, quantized_by_converter, stored_parameter, tiny_model

    kind = GGMLQuantizationType[case.ggml_type]
    model = tiny_model(case.arch, seed)
    path = f"{folder}/{case.name}.gguf"
    others = {projection: GGMLQuantizationType[other] for projection, other in case.others}
    convert_to_gguf(model, case.arch, path, kind, others=others)
    with torch.no_grad():  # what the file stores: every 2-D weight and the experts through the quantizer
        for name, parameter in model.named_parameters():
            if quantized_by_converter(name, parameter.ndim):
                stored = stored_parameter(name, parameter.numpy(), GGMLQuantizationType[case.type_of(name)], case.arch)
                parameter.copy_(torch.from_numpy(stored))
    return model, path


def _isq_reference(case: ISQModelCase, seed: int, folder: str):
    """A fresh tiny model saved dense, its checkpoint quantized in situ, and the model with the
    weights that checkpoint hands over (quantized, then dequantized by gguf)."""
    import torch

    from candelabra.core.loading.in_situ import InSituQuantized
    from candelabra.core.weights.safetensors import SafetensorsCheckpoint

    model = make_reference(case.base, seed)
    model.save_pretrained(folder)
    checkpoint = InSituQuantized(SafetensorsCheckpoint(folder), case.format)
    with torch.no_grad():
        for name in checkpoint.tensor_names():
            if checkpoint.quantized_format(name) is not None:
                model.get_parameter(name).copy_(torch.from_numpy(checkpoint.load(name)))
    return model, checkpoint


def _compare(backend: Backend, name: str, reference, model, prompt: np.ndarray, seed: int, dtype: str,
             threshold: float, kv_dtype: str | None = None, routes_experts: bool = False,
             activations: str | None = None) -> ModelResult:
    """The model's logits over `prompt` and its greedy tokens against transformers'. A quantized KV cache
    (`kv_dtype`) or activations rounded before quantized products (`activations`) may tip a close pair of
    logits: greedy tokens are then reported, not required, and expert ties looked for at that rounding."""
    architecture = type(reference).__name__
    total = len(prompt) + GREEDY_TOKENS
    blocks = np.random.default_rng(seed + 1).permutation(2 * -(-total // BLOCK_SIZE)).tolist()
    runner = ModelRunner(model, num_blocks=len(blocks), block_size=BLOCK_SIZE, kv_cache_dtype=kv_dtype)

    prefill = StepMetadata.build([len(prompt)], [len(prompt)], [blocks], BLOCK_SIZE,
                                 logits_rows=np.arange(len(prompt)))
    logits = backend.to_host(runner.logits(prompt, prefill))
    if routes_experts:
        # an int8 cache or int8 activations move a router's input by more than float32 rounds it: look for ties
        # at the coarsest rounding
        expected, tied = positions_near_expert_ties(reference, lambda: reference_logits(reference, prompt),
                                                    len(prompt), coarsest(dtype, kv_dtype, activations))
    else:
        expected, tied = reference_logits(reference, prompt), np.zeros(len(prompt), dtype=bool)
    error = nmse(logits[~tied], expected[~tied])

    greedy = _greedy_agreement(backend, runner, reference, prompt, int(np.argmax(logits[-1])), blocks, dtype,
                               routes_experts, prompt_at_tie=bool(tied[-1]))
    passed_greedy = (greedy.startswith(f"{GREEDY_TOKENS}/") or greedy.endswith("tie") or kv_dtype is not None
                     or activations is not None)
    passed_nmse = error <= threshold
    problems = ([] if passed_nmse else [f"logits NMSE {error:.3g} > {threshold:.0e} ({dtype})"]) + (
        [] if passed_greedy else [f"greedy tokens diverged after {greedy}"])
    if 2 * tied.sum() > len(prompt):  # too few positions left to tell a backend's error from ties
        problems.append(f"{tied.sum()} of {len(prompt)} prompt positions route within rounding of an expert tie")
    return ModelResult(name, architecture, "passed" if not problems else "failed", error, greedy, seed,
                       "; ".join(problems), int(tied.sum()), activations)
