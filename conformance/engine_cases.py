"""Level 3 of conformance: the engine gives every request exactly the tokens it gets alone.

A tiny random Qwen2-style checkpoint (written directly with safetensors, with a word-level
tokenizer, so this level needs no torch) runs on the backend under test. Greedy outputs must be
identical whether a request runs alone or among others arriving at random steps, with chunked
prefill on and off, on prefix-cache hits and misses, and after forced preemption by recompute
and by swap; n > 1 samples under a fixed seed must reproduce. Every case ends with all blocks free.
Greedy tokens may part from the lone ones only on a tie: where the lone run's best token led the
batch's pick by at most two rounding steps of the compute dtype (GREEDY_TIE_MARGINS), as a batch's other
summation order can move a logit by one, or where the batch's pick is what the backend alone picks, within
that margin, reading the request's tokens so far as one prompt (preemption by recompute and a prefix-cache
hit read them so, where the lone run decoded them one by one), or where the position that picked it routes
within the dtype's rounding of an expert tie (asked of transformers' model of the checkpoint, where torch is
installed: expert_ties.py), as a mixture-of-experts layer routing a token at such a tie can part the two
paths by more than a rounding step; the case passes and its detail names the request and step.

The cases named "...-kv-int8" run two of the checks again with every engine keeping an int8 KV cache
(where the backend declares one): a quantized cache changes the tokens from the float cache's, but a
request must still get the same tokens alone and among others, and after its blocks went to the host
and back.

The cases named "moe-..." run the first five checks again on a tiny DeepSeek-V3 checkpoint: a step's
tokens go to different experts (routed by groups, with a shared expert) and every expert runs on
whichever of them chose it, and the KV cache is a latent cache, whose blocks the prefix cache shares and
preemption recomputes or swaps out and back. A backend without the MoE or latent attention ops reports
them "not supported".
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from candelabra.conformance.expert_ties import CheckpointExpertTies, coarsest
from candelabra.conformance.harness import NOT_SUPPORTED
from candelabra.core.contract.backend import Backend
from candelabra.core.contract.ops import OpNotSupported

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 160, 64, 2, 4, 2, 16, 128
# The MoE checkpoint's sparse layer: 4 experts (2 a rank at TP=2) in 2 groups, 2 a token from the best group,
# of this many intermediate features, and a shared expert; its latent attention's widths.
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_INTERMEDIATE = 4, 2, 64
Q_RANK, LATENT_RANK, NOPE_DIM, ROPE_DIM, VALUE_DIM = 24, 32, 16, 8, 16
BLOCK_SIZE, MAX_TOKENS = 16, 12


@dataclass(frozen=True)
class EngineCase:
    check: str  # what runs (`_run_case`)
    description: str
    moe: bool = False  # on the DeepSeek-V3 checkpoint rather than the Qwen2 one
    # A quantized KV cache every engine of the case keeps, where the backend declares it: tokens are
    # compared with the same engine's alone at that cache dtype.
    kv_cache_dtype: str | None = None

    @property
    def name(self) -> str:
        name = f"moe-{self.check}" if self.moe else self.check
        return f"{name}-kv-{self.kv_cache_dtype}" if self.kv_cache_dtype else name


ENGINE_CASES = [
    EngineCase("staggered-arrivals", "requests arriving at random steps, alone vs together"),
    EngineCase("chunked-prefill", "prefill in chunks of 5 tokens vs whole"),
    EngineCase("prefix-cache", "a prompt sharing a cached prefix vs no cache"),
    EngineCase("preempt-recompute", "a KV cache too small for all, preempting by recompute"),
    EngineCase("preempt-swap", "a KV cache too small for all, preempting by swapping to host"),
    EngineCase("parallel-samples", "n = 3 seeded samples, twice"),
    EngineCase("prompt-logprobs", "prompts scored chunked, batched and after a cached run vs whole and alone"),
    EngineCase("scheduled-ahead", "each step launched before the last one's tokens are known: staggered requests "
                                  "ending on stop tokens and strings, with penalties, and preempted, vs alone"),
    EngineCase("staggered-arrivals", "MoE: requests arriving at random steps, alone vs together", moe=True),
    EngineCase("chunked-prefill", "MoE: prefill in chunks of 5 tokens vs whole", moe=True),
    EngineCase("prefix-cache", "MoE: a prompt sharing a cached prefix vs no cache", moe=True),
    EngineCase("preempt-recompute", "MoE: a KV cache too small for all, preempting by recompute", moe=True),
    EngineCase("preempt-swap", "MoE: latent cache blocks swapped to host and back", moe=True),
    EngineCase("staggered-arrivals", "int8 KV cache: requests arriving at random steps, alone vs together",
               kv_cache_dtype="int8"),
    EngineCase("preempt-swap", "int8 KV cache: its blocks swapped to host and back", kv_cache_dtype="int8"),
]

# How far a prompt token's logprob may move between a batched, chunked step and the prompt alone:
# float32 sums in another order, or a low-precision dtype's rounding of the hidden states.
PROMPT_LOGPROB_TOLERANCE = {"float32": 1e-3}
LOW_PRECISION_PROMPT_LOGPROB_TOLERANCE = 0.1
# A request's greedy tokens may part from its lone ones where the lone run's two best logprobs were this
# close: two rounding steps of the compute dtype at the tiny models' logits (8 to 16), which a batch's
# other summation order can move by one (seen in bfloat16 on torch's MoE experts).
GREEDY_TIE_MARGINS = {"float32": 2.0**-19, "float16": 2.0**-6, "bfloat16": 2.0**-3}


@dataclass
class EngineResult:
    case: str
    status: str
    detail: str
    seed: int
    message: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def write_tiny_checkpoint(folder: Path, seed: int, moe: bool = False) -> None:
    """A random Qwen2ForCausalLM (GQA, qkv biases), or with `moe` a DeepseekV3ForCausalLM (latent
    attention, a dense first layer, then EXPERTS routed experts and a shared one), and a word-level
    tokenizer ("w0" .. "w159")."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)

    def weight(*shape, scale=0.15):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {"model.embed_tokens.weight": weight(VOCAB, HIDDEN, scale=1.0), "model.norm.weight": 1 + weight(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        if moe:
            tensors |= _latent_attention(f"{p}.self_attn", weight)
        else:
            for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                tensors[f"{p}.self_attn.{name}_proj.weight"] = weight(rows * HEAD_DIM, HIDDEN)
                tensors[f"{p}.self_attn.{name}_proj.bias"] = weight(rows * HEAD_DIM)
            tensors[f"{p}.self_attn.o_proj.weight"] = weight(HIDDEN, HEADS * HEAD_DIM)
        if moe and i > 0:
            tensors[f"{p}.mlp.gate.weight"] = weight(EXPERTS, HIDDEN, scale=0.5)
            tensors[f"{p}.mlp.gate.e_score_correction_bias"] = weight(EXPERTS, scale=0.1)
            for e in range(EXPERTS):
                tensors |= _gated_mlp(f"{p}.mlp.experts.{e}", EXPERT_INTERMEDIATE, weight)
            tensors |= _gated_mlp(f"{p}.mlp.shared_experts", EXPERT_INTERMEDIATE, weight)
        else:
            tensors |= _gated_mlp(f"{p}.mlp", INTERMEDIATE, weight)
        tensors[f"{p}.input_layernorm.weight"] = 1 + weight(HIDDEN)
        tensors[f"{p}.post_attention_layernorm.weight"] = 1 + weight(HIDDEN)
    tensors["lm_head.weight"] = weight(VOCAB, HIDDEN, scale=0.5)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        # No model_type: transformers would pick Qwen's tokenizer class from it and replace the
        # word-level splitting with Qwen's.
        "architectures": ["DeepseekV3ForCausalLM" if moe else "Qwen2ForCausalLM"], "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "eos_token_id": 1,
    }
    if moe:
        config |= {"num_key_value_heads": HEADS, "n_routed_experts": EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
                   "moe_intermediate_size": EXPERT_INTERMEDIATE, "n_shared_experts": 1, "n_group": 2,
                   "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                   "first_k_dense_replace": 1, "q_lora_rank": Q_RANK, "kv_lora_rank": LATENT_RANK,
                   "qk_nope_head_dim": NOPE_DIM, "qk_rope_head_dim": ROPE_DIM, "v_head_dim": VALUE_DIM}
    (folder / "config.json").write_text(json.dumps(config))
    write_word_tokenizer(folder, VOCAB)


def _latent_attention(prefix: str, weight) -> dict[str, np.ndarray]:
    """DeepSeek's latent attention projections and norms under `prefix`, with a query bottleneck."""
    return {
        f"{prefix}.q_a_proj.weight": weight(Q_RANK, HIDDEN),
        f"{prefix}.q_a_layernorm.weight": 1 + weight(Q_RANK),
        f"{prefix}.q_b_proj.weight": weight(HEADS * (NOPE_DIM + ROPE_DIM), Q_RANK),
        f"{prefix}.kv_a_proj_with_mqa.weight": weight(LATENT_RANK + ROPE_DIM, HIDDEN),
        f"{prefix}.kv_a_layernorm.weight": 1 + weight(LATENT_RANK),
        f"{prefix}.kv_b_proj.weight": weight(HEADS * (NOPE_DIM + VALUE_DIM), LATENT_RANK),
        f"{prefix}.o_proj.weight": weight(HIDDEN, HEADS * VALUE_DIM),
    }


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` tokens into `folder`: "<unk>" (0), "<eos>" (1), then
    "w2", "w3", ... split on whitespace."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    raw = RawTokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)

def _gated_mlp(prefix: str, intermediate: int, weight) -> dict[str, np.ndarray]:
    """A gated MLP's projections under `prefix`, drawn gate, up, down."""
    shapes = (("gate_proj", (intermediate, HIDDEN)), ("up_proj", (intermediate, HIDDEN)),
              ("down_proj", (HIDDEN, intermediate)))
    return {f"{prefix}.{name}.weight": weight(*shape) for name, shape in shapes}


class _Harness:
    """Fresh engines over one loaded model, and requests run to completion on them."""

    kv_cache_dtype: str | None = None  # the caches' dtype, when not the model's
    expert_ties: CheckpointExpertTies | None = None  # for a model that routes experts

    def __init__(self, backend: Backend, folder: Path, dtype: str) -> None:
        from candelabra.core.engine.tokenizer import Tokenizer
        from candelabra.core.loading.model import load_model
        from candelabra.core.weights.safetensors import SafetensorsCheckpoint

        checkpoint = SafetensorsCheckpoint(folder)
        self.model = load_model(checkpoint, backend, dtype)
        self.tokenizer = Tokenizer.from_checkpoint(checkpoint)

    def engine(self, **options):
        from candelabra.core.engine.engine import EngineConfig, LLMEngine
        from candelabra.core.worker.model_runner import ModelRunner

        config = EngineConfig(**{"num_blocks": 64, "block_size": BLOCK_SIZE, "async_scheduling": False, **options})
        runner = ModelRunner(self.model, config.num_blocks, config.block_size, self.kv_cache_dtype)
        return LLMEngine(runner, self.tokenizer, config)

    def run(self, engine, prompts: list[list[int]], params, arrivals: list[int] | None = None) -> list:
        """Outputs per prompt; prompt i joins at step arrivals[i] (all at once by default)."""
        arrivals = arrivals or [0] * len(prompts)
        finished, step = {}, 0
        pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
        while pending or engine.has_unfinished_requests():
            while pending and arrivals[pending[0]] <= step:
                i = pending.pop(0)
                engine.add_request(f"r{i}", prompts[i], params)
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
            step += 1
            if step > 10_000:
                raise RuntimeError("the engine did not finish its requests")
        return [finished[f"r{i}"] for i in range(len(prompts))]

    def alone(self, prompts, params, **options) -> list:
        return [self.run(self.engine(**options), [p], params)[0] for p in prompts]

    def close(self) -> None:
        """Nothing to release for one process's engines."""


def _all_blocks_free(engine) -> str:
    blocks = engine.blocks
    if blocks.num_free_blocks != blocks.num_blocks or blocks.num_free_host_blocks != blocks.num_host_blocks:
        return (f"blocks leaked: {blocks.num_blocks - blocks.num_free_blocks} device and "
                f"{blocks.num_host_blocks - blocks.num_free_host_blocks} host blocks still held")
    return ""


def _late_stop_token(lone: list[list[list[int]]], earliest: int) -> int:
    """A token that ends some of the requests whose lone greedy tokens are `lone`, but none before its
    `earliest`-th token, so that they all grow; the one that ends a request soonest, else one never
    generated. A stop token the tiny model favours would end every request before the KV cache fills."""
    first_seen = {}
    for samples in lone:
        for position, token in enumerate(samples[0]):
            first_seen[token] = min(first_seen.get(token, position), position)
    late = {token: position for token, position in first_seen.items() if position >= earliest}
    if late:
        return min(late, key=lambda token: (late[token], token))
    return next(token for token in range(2, VOCAB) if token not in first_seen)


def _tokens(outputs) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def run_engine_case(backend, case: EngineCase, seed: int, dtype: str = "float32", make_harness=None) -> EngineResult:
    """`case` on `backend` (an instance); `make_harness(backend, folder, dtype)` may build the engines
    another way (the parallel level passes a backend class and a tensor-parallel harness). A MoE case
    on a backend without the MoE ops, or a case over a KV cache dtype it does not declare, is "not
    supported"."""
    if case.kv_cache_dtype and case.kv_cache_dtype not in backend.kv_cache_dtypes(dtype):
        return EngineResult(case.name, NOT_SUPPORTED, "", seed, f"backend {backend.name!r} keeps no "
                            f"{case.kv_cache_dtype} KV cache in {dtype} (kv_cache_dtypes)")
    with tempfile.TemporaryDirectory() as folder:
        write_tiny_checkpoint(Path(folder), seed, case.moe)
        try:
            h = (make_harness or _Harness)(backend, Path(folder), dtype)
            h.kv_cache_dtype = case.kv_cache_dtype  # every engine the case makes
        except OpNotSupported as exc:
            return EngineResult(case.name, NOT_SUPPORTED, "", seed, str(exc))
        if case.moe:
            h.expert_ties = CheckpointExpertTies(Path(folder), dtype, coarsest(dtype, case.kv_cache_dtype))
        try:
            return _run_case(h, case, seed)
        finally:
            h.close()


def _run_case(h: _Harness, case: EngineCase, seed: int) -> EngineResult:
    from candelabra.core.requests.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [rng.integers(2, VOCAB, int(n)).tolist() for n in rng.integers(3, 60, 6)]
    problems, detail, ties = [], "", []

    if case.check == "staggered-arrivals":
        engine = h.engine()
        together = h.run(engine, prompts, greedy, arrivals=sorted(rng.integers(0, 15, len(prompts)).tolist()))
        problems.append(_differ_but_for_ties(h, together, prompts, greedy, ties))
        detail = f"{len(prompts)} requests"
    elif case.check == "chunked-prefill":
        engine = h.engine(prefill_chunk_size=5, max_num_batched_tokens=24)
        chunked = h.run(engine, prompts, greedy)
        problems.append(_differ_but_for_ties(h, chunked, prompts, greedy, ties, prefill_chunk_size=0,
                                             max_num_batched_tokens=512))
        detail = f"{engine.stats['steps']} steps chunked"
    elif case.check == "prefix-cache":
        shared = rng.integers(2, VOCAB, 3 * BLOCK_SIZE + 5).tolist()
        first, second = shared + [7, 8, 9], shared + [11, 12]
        engine = h.engine(enable_prefix_caching=True)
        outputs = h.run(engine, [first], greedy) + h.run(engine, [second], greedy)
        problems.append(_differ_but_for_ties(h, outputs, [first, second], greedy, ties, enable_prefix_caching=False))
        hits = outputs[1].num_cached_tokens
        if hits < 3 * BLOCK_SIZE:
            problems.append(f"the second prompt reused {hits} cached tokens, expected {3 * BLOCK_SIZE}")
        detail = f"{hits} prompt tokens from the cache"
    elif case.check in ("preempt-recompute", "preempt-swap"):
        mode = case.check.split("-")[1]
        # Each request needs 5 blocks and 10 exist: most are preempted, some several times, and
        # their blocks are reused by others while they wait.
        long_prompts = [rng.integers(2, VOCAB, 40).tolist() for _ in range(8)]
        longer = SamplingParams(temperature=0, max_tokens=3 * MAX_TOKENS, ignore_eos=True)
        engine = h.engine(num_blocks=10, num_host_blocks=40 if mode == "swap" else 0, preemption=mode)
        together = h.run(engine, long_prompts, longer)
        problems.append(_differ_but_for_ties(h, together, long_prompts, longer, ties))
        count = engine.scheduler.num_preemptions[mode]
        if not count:
            problems.append(f"no preemption by {mode} happened")
        detail = f"{count} preemptions by {mode}"
    elif case.check == "parallel-samples":
        seed = int(rng.integers(2**31))
        sampled = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)
        single = SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)
        first_run = _tokens(h.run(engine := h.engine(), prompts[:2], sampled))
        problems.append(_differ(first_run, _tokens(h.run(h.engine(), prompts[:2], sampled))))
        if all(len({tuple(t) for t in samples}) == 1 for samples in first_run):
            problems.append("the n samples of a request are all identical")
        # Sample 0 draws from the request's own seed, as an n = 1 request with that seed does.
        problems.append(_differ([s[:1] for s in first_run], _tokens(h.run(h.engine(), prompts[:2], single))))
        # Greedy samples share the prompt's blocks copy-on-write and must all be the lone greedy output.
        greedy_three = SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        shared = h.run(h.engine(), prompts[:3], greedy_three)
        problems.append(_differ_but_for_ties(h, shared, prompts[:3], greedy, ties))
        detail = "3 samples per request"
    elif case.check == "scheduled-ahead":
        # Requests end on a token or a string the step after theirs has already been launched for, and that
        # step's token for them is dropped; penalties make a step wait for the tokens before it.
        stops = sorted(rng.choice(np.arange(2, VOCAB), 12, replace=False).tolist())
        stopping = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=stops[:6],
                                  stop=[f" w{token}" for token in stops[6:]])
        penalised = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3,
                                   frequency_penalty=0.5)
        steps = 0
        for params in (stopping, penalised):
            engine = h.engine(async_scheduling=True)
            ahead = h.run(engine, prompts, params, arrivals=sorted(rng.integers(0, 15, len(prompts)).tolist()))
            problems.append(_differ_but_for_ties(h, ahead, prompts, params, ties))
            problems.append(_all_blocks_free(engine))
            steps += engine.stats["steps"]
        long_prompts = [rng.integers(2, VOCAB, 40).tolist() for _ in range(8)]
        unstopped = SamplingParams(temperature=0, max_tokens=3 * MAX_TOKENS, ignore_eos=True)
        late = _late_stop_token(_tokens(h.alone(long_prompts, unstopped)), earliest=MAX_TOKENS)
        longer = replace(unstopped, stop_token_ids=[late])
        engine = h.engine(async_scheduling=True, num_blocks=10, preemption="recompute")
        preempted = h.run(engine, long_prompts, longer)
        problems.append(_differ_but_for_ties(h, preempted, long_prompts, longer, ties))
        preemptions = engine.scheduler.num_preemptions["recompute"]
        if not preemptions:
            problems.append("no preemption happened")
        stopped = sum(o.outputs[0].finish_reason == "stop" for o in preempted)
        detail = (f"{steps + engine.stats['steps']} steps scheduled ahead, {preemptions} preemptions, "
                  f"{stopped} of the {len(preempted)} requests it crowded ended on the stop token")
    elif case.check == "prompt-logprobs":
        scored = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
        engine = h.engine(prefill_chunk_size=5, max_num_batched_tokens=24)
        h.run(engine, prompts[:2], greedy)  # their blocks are in the prefix cache now
        together = h.run(engine, prompts, scored)
        alone = h.alone(prompts, scored, prefill_chunk_size=0, max_num_batched_tokens=512)
        tolerance = PROMPT_LOGPROB_TOLERANCE.get(h.model.dtype, LOW_PRECISION_PROMPT_LOGPROB_TOLERANCE)
        problems += [_prompt_logprobs_differ(i, got, expected, tolerance)
                     for i, (got, expected) in enumerate(zip(together, alone))]
        detail = f"{sum(len(p) - 1 for p in prompts)} prompt tokens scored"
    else:
        raise ValueError(f"unknown engine check {case.check!r}")

    problems.append(_all_blocks_free(engine))
    problems = [p for p in problems if p]
    if ties:
        detail += f"; parted on a tie: {', '.join(ties)}"
    return EngineResult(case.name, "failed" if problems else "passed", detail, seed, "; ".join(problems))


def _prompt_logprobs_differ(index: int, got, expected, tolerance: float) -> str:
    """Whether request `index` has one score per prompt token past the first, each holding the token
    and two more likely ones, at the logprobs it gets alone."""
    prompt, entries = got.prompt_token_ids, got.prompt_logprobs
    if entries is None or len(entries) != len(prompt) or entries[0] is not None:
        return f"request {index}: {len(entries or [])} prompt logprobs for a prompt of {len(prompt)} tokens"
    for position in range(1, len(prompt)):
        token, entry, reference = prompt[position], entries[position], expected.prompt_logprobs[position]
        if token not in entry or len(entry) not in (2, 3):
            return f"request {index}, prompt token {position}: scores {sorted(entry)} miss it or the top 2"
        if abs(entry[token].logprob - reference[token].logprob) > tolerance:
            return (f"request {index}, prompt token {position}: logprob {entry[token].logprob:.5f}, "
                    f"alone {reference[token].logprob:.5f}")
    return ""


def _differ(got: list, expected: list) -> str:
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return f"request {i} got tokens {a}, alone it gets {b}"
    return ""


def _differ_but_for_ties(h: _Harness, got: list, prompts: list, params, ties: list[str], **alone_options) -> str:
    """Whether any request's greedy samples in `got` differ from its tokens alone (`prompts` run one by
    one with `params` on engines made with `alone_options`). A sample that parts from them on a tie
    (`parting_tie`) is noted in `ties` rather than failed."""
    alone = h.alone(prompts, params, **alone_options)
    margin = GREEDY_TIE_MARGINS[h.model.dtype]
    for i, (samples, lone) in enumerate(zip(_tokens(got), _tokens(alone))):
        for sample in samples:
            if sample == lone[0]:
                continue
            step = parting_tie(h, prompts[i], params, sample, lone[0], margin, alone_options)
            if step is None:
                return f"request {i} got tokens {samples}, alone it gets {lone}"
            ties.append(f"request {i} at token {step}")
    return ""


def parting_tie(h: _Harness, prompt: list[int], params, got: list[int], expected: list[int], margin: float,
                alone_options: dict) -> int | None:
    """The step where greedy tokens `got` first part from `expected`, the prompt's tokens alone, when
    `got`'s token there was within `margin` of the best logprob of the lone run, scored again, or of the
    prompt and `got`'s tokens before it read as one prompt (`prefix_read_agrees`), or when the position
    that chose it routes at an expert tie (where the harness's model routes experts and torch is here to
    ask transformers); None when they part otherwise, or the lone run does not repeat itself."""
    step = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if step is None:
        return None
    scored = h.alone([prompt], replace(params, logprobs=2), **alone_options)[0].outputs[0]
    if scored.token_ids != expected:
        return None
    if _within_margin(dict(scored.logprobs[step].top), got[step], margin):
        return step
    if prefix_read_agrees(h, prompt, params, got, step, margin, alone_options):
        return step
    # The tiny MoE checkpoint's one sparse layer is its last, after that layer's attention: a token's experts
    # change its own logits and never a cache entry, so only the position that picked the token can part them.
    return step if h.expert_ties and h.expert_ties.newest_at_tie(prompt + got[:step]) else None


def prefix_read_agrees(h: _Harness, prompt: list[int], params, got: list[int], step: int, margin: float,
                       alone_options: dict) -> bool:
    """Whether greedy token `got[step]` is within `margin` of the best logprob where the backend alone reads
    the prompt and got[:step] as one prompt. Never where penalties weigh the tokens generated, which read
    as a prompt they would not be."""
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        return False
    first = replace(params, max_tokens=1, min_tokens=0, logprobs=2)
    read = h.alone([prompt + got[:step]], first, **alone_options)[0].outputs[0]
    return _within_margin(dict(read.logprobs[0].top), got[step], margin)


def _within_margin(top: dict[int, float], token: int, margin: float) -> bool:
    return token in top and max(top.values()) - top[token] <= margin
