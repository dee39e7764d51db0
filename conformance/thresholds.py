"""The limits the suite holds a backend to, as `candelabra conformance --thresholds` prints them and
docs/backend-contract.md shows them (a test keeps the two the same)."""

from __future__ import annotations

import math

from candelabra.conformance.compare import (
    MODEL_NMSE_THRESHOLDS,
    MOE_MODEL_NMSE_THRESHOLDS,
    NMSE_THRESHOLDS,
    OP_NMSE_MEASURED,
    OP_NMSE_THRESHOLDS,
    QUANTIZED_KV_CODE_SLACK,
    QUANTIZED_KV_MODEL_NMSE_THRESHOLDS,
    QUANTIZED_KV_NMSE_THRESHOLDS,
    QUANTIZED_KV_SCALE_RTOL,
    QUANTIZED_NMSE_THRESHOLDS,
    ROUNDED_ACTIVATIONS_MODEL_NMSE_THRESHOLD,
    ROUNDING_FLIP_SHARE,
)
from candelabra.conformance.engine_cases import (
    GREEDY_TIE_MARGINS,
    LOW_PRECISION_PROMPT_LOGPROB_TOLERANCE,
    PROMPT_LOGPROB_TOLERANCE,
)
from candelabra.conformance.expert_ties import NUDGE_UNITS, NUDGES
from candelabra.core.text_table import format_table

DTYPES = ("float32", "float16", "bfloat16")

# Ops whose float outputs are compared by NMSE; the rest of the ops level compares exactly (cache
# writes, gathers, block copies and swaps, chosen token ids, ranks).
NMSE_OPS = ("embedding", "linear", "rms_norm", "add_rms_norm", "layer_norm", "rotary", "rotary_and_write_kv",
            "silu_and_mul", "gelu_and_mul", "gelu", "gated_linear", "rms_norm_linear", "rms_norm_gated_mlp",
            "paged_attention", "rotary_and_paged_attention", "softcap",
            "softmax", "sample", "token_logprobs", "route_experts", "moe_experts", "per_head_linear",
            "paged_latent_attention", "array_subset")
EXACT_OPS = ("memory", "gather_rows", "write_kv", "copy_blocks", "swap_out", "swap_in", "allocate_kv_cache")


def _basis(op: str) -> str:
    measured = OP_NMSE_MEASURED.get(op)
    if measured is None:
        return "general limit of the dtype"
    seen = ", ".join(f"{dtype} {value:.2g}" for dtype, value in measured.items())
    return f"worst seen on torch and metal: {seen}"


def threshold_table() -> str:
    """Every limit, with what it rests on, as plain text."""
    ops = format_table(
        ("op", *DTYPES, "basis"),
        [(op, *(f"{OP_NMSE_THRESHOLDS.get(op, {}).get(d, NMSE_THRESHOLDS[d]):.0e}" for d in DTYPES), _basis(op))
         for op in NMSE_OPS])
    quantized = format_table(("linear on a quantized weight", "NMSE limit"),
                             [(fmt, f"{limit:.0e}") for fmt, limit in QUANTIZED_NMSE_THRESHOLDS.items()])
    kv_cache = format_table(
        ("quantized KV cache", "rows' NMSE limit", "models level: logits' NMSE limit"),
        [(kv, f"{QUANTIZED_KV_NMSE_THRESHOLDS[kv]:.0e}", f"{QUANTIZED_KV_MODEL_NMSE_THRESHOLDS[kv]:.0e}")
         for kv in QUANTIZED_KV_NMSE_THRESHOLDS])
    models = format_table(("models level: logits against transformers", "NMSE limit", "mixture of experts"),
                          [(dtype, f"{MODEL_NMSE_THRESHOLDS[dtype]:.0e}", f"{MOE_MODEL_NMSE_THRESHOLDS[dtype]:.0e}")
                           for dtype in DTYPES])
    return "\n\n".join([
        "ops level: NMSE of each float output against the float64 oracle's result rounded once to the output's "
        f"dtype.\nAt float16 and bfloat16 an output also passes when up to {ROUNDING_FLIP_SHARE:.0%} of its "
        "elements are one unit in the last place off and the rest meet the limit.",
        ops,
        f"Compared exactly: {', '.join(EXACT_OPS)}; and sample's token ids (a draw near a boundary may take "
        "either neighbour) and token_logprobs' ranks.",
        quantized,
        "A quantized KV cache's rows as write_kv leaves them: each scale within a relative "
        f"{QUANTIZED_KV_SCALE_RTOL:.0e} of max|row| / the largest code (127 for int8, 448 for fp8), each code "
        f"the nearest to value / scale give or take {QUANTIZED_KV_CODE_SLACK:.0e} of it, every other row "
        "unchanged. rotary_and_write_kv's keys, dequantized, within the rows' limit of the rotated keys; "
        "attention reads the dequantized rows, within its own limits. The models level's quantized-cache cases "
        "hold the logits to the larger of the dtype's limit and the cache's.",
        kv_cache,
        models,
        "A mixture of experts' logits are compared at the prompt positions where transformers' routers do not choose "
        f"within the dtype's rounding of a tie, or a quantized KV cache's where it rounds more (int8: 2^-8 of a row's "
        f"largest value; their input nudged by up to {NUDGE_UNITS} such units changes no choice in {NUDGES} draws); "
        "at the others a correct backend may choose other experts. For the "
        "same reason its greedy tokens may part from transformers' where transformers' newest position routes so.",
        "Where a backend says its kernels round x to int8 before a quantized product (Backend.activation_rounding, "
        "which the user allows), the models level's quantized checkpoints (GGUF, GPTQ and AWQ, --isq) hold their "
        f"logits to the larger of the dtype's limit and {ROUNDED_ACTIVATIONS_MODEL_NMSE_THRESHOLD:.0e}, look for "
        "expert ties at 2^-8 as for an int8 cache, and report greedy tokens without requiring them; so does the "
        "parallel level, comparing shards with the whole model.",
        "engine level: a request's greedy tokens among others (arriving at random steps, prefilled in chunks, read "
        "from the prefix cache, preempted by recompute or swap, scheduled ahead) equal the ones it gets alone on the "
        "same backend, over a quantized KV cache alone at that cache dtype; its prompt logprobs lie within "
        f"{PROMPT_LOGPROB_TOLERANCE['float32']:.0e} of its lone ones in float32, "
        f"{LOW_PRECISION_PROMPT_LOGPROB_TOLERANCE} in float16 and bfloat16. Its tokens may part only on a tie: where "
        "the lone run's best logprob led the batch's pick by at most "
        + ", ".join(f"{_power_of_two(margin)} in {dtype}" for dtype, margin in GREEDY_TIE_MARGINS.items())
        + ", or the backend alone picks it within that margin reading the tokens so far as one prompt, or, on the "
        "tiny DeepSeek-V3, where the position that picked it routes within the dtype's rounding of an expert tie "
        "as above (transformers' model of the checkpoint is asked: without torch installed such a parting fails).",
    ])


def _power_of_two(value: float) -> str:
    return f"2^{math.log2(value):.0f}"
