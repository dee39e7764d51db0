"""The conformance oracle: a naive float64 reference for every op in `candelabra.core.contract.ops.Ops`.

Each function follows the op's docstring literally, in plain numpy with Python loops where they
make the math easier to check. It is deliberately slow and simple, and shares no code with any
backend (or with `candelabra.core.models.rope`), so that a bug in a backend cannot hide in the oracle.
Inputs are numpy arrays; everything is computed in float64 and returned as float64 (ints as int64).
"""

from __future__ import annotations

import math

import numpy as np

from candelabra.core.contract.kv_cache import KV_SCALE_BYTES
from candelabra.core.contract.step_metadata import SamplingMetadata


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def embedding(ids, table, scale=None):
    out = _f64(table)[np.asarray(ids, dtype=np.int64)]
    if scale is not None:
        out = out * float(scale)
    return out


def gather_rows(x, rows):
    return _f64(x)[np.asarray(rows, dtype=np.int64)]


def linear(x, weight, bias=None):
    out = _f64(x) @ _f64(weight).T
    if bias is not None:
        out = out + _f64(bias)
    return out


def rms_norm(x, weight, eps, weight_offset=0.0):
    x = _f64(x)
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(mean_square + eps) * (weight_offset + _f64(weight))


def add_rms_norm(x, residual, weight, eps, weight_offset=0.0, round_sum=lambda a: a):
    s = _f64(round_sum(_f64(x) + _f64(residual)))
    return rms_norm(s, weight, eps, weight_offset), s


def layer_norm(x, weight, bias, eps):
    x = _f64(x)
    mean = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True)
    out = (x - mean) / np.sqrt(var + eps) * _f64(weight)
    if bias is not None:
        out = out + _f64(bias)
    return out


def _rope_frequencies(rotary_dim, base, scaling):
    """The rotary_dim/2 frequencies and the attention factor, per Hugging Face's rope_scaling."""
    kind = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    half = rotary_dim // 2
    plain = [base ** (-2 * i / rotary_dim) for i in range(half)]

    if kind == "default":
        return plain, 1.0

    if kind == "linear":
        return [f / scaling["factor"] for f in plain], 1.0

    if kind == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        low_freq_wavelength = context / low_freq_factor
        high_freq_wavelength = context / high_freq_factor
        freqs = []
        for f in plain:
            wavelength = 2 * math.pi / f
            if wavelength < high_freq_wavelength:
                freqs.append(f)
            elif wavelength > low_freq_wavelength:
                freqs.append(f / factor)
            else:
                smooth = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
                freqs.append((1 - smooth) * f / factor + smooth * f)
        return freqs, 1.0

    if kind == "yarn":
        factor = scaling["factor"]
        context = scaling["original_max_position_embeddings"]
        beta_fast = scaling.get("beta_fast", 32)
        beta_slow = scaling.get("beta_slow", 1)

        def correction_dim(rotations):
            return rotary_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), rotary_dim - 1)
        if low == high:
            high += 0.001
        freqs = []
        for i, f in enumerate(plain):
            ramp = (i - low) / (high - low)
            if ramp < 0:
                ramp = 0.0
            elif ramp > 1:
                ramp = 1.0
            # ramp 0: keep f (extrapolation); ramp 1: f / factor (interpolation).
            freqs.append(f / factor * ramp + f * (1 - ramp))

        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        return freqs, float(attention_factor)

    raise ValueError(f"unknown rope_type {kind!r}")


def _rotate(x, positions, rotary_dim, freqs, attention_factor, style):
    out = x.copy()
    half = rotary_dim // 2
    for i in range(half):
        angle = positions * freqs[i]
        c = (np.cos(angle) * attention_factor)[:, None]
        s = (np.sin(angle) * attention_factor)[:, None]
        ia, ib = (i, i + half) if style == "neox" else (2 * i, 2 * i + 1)
        a, b = x[:, :, ia], x[:, :, ib]
        out[:, :, ia] = a * c - b * s
        out[:, :, ib] = b * c + a * s
    return out


def rotary(q, k, positions, rotary_dim, base, style, scaling=None):
    if style not in ("neox", "gptj"):
        raise ValueError(f"unknown rotary style {style!r}")
    freqs, attention_factor = _rope_frequencies(rotary_dim, base, scaling)
    positions = np.asarray(positions, dtype=np.int64)
    return (
        _rotate(_f64(q), positions, rotary_dim, freqs, attention_factor, style),
        _rotate(_f64(k), positions, rotary_dim, freqs, attention_factor, style),
    )


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _silu(a):
    with np.errstate(over="ignore"):
        return a / (1 + np.exp(-a))


def gelu(x, approximate="none"):
    x = _f64(x)
    if approximate == "none":
        return x / 2 * (1 + _erf(x / math.sqrt(2)))
    if approximate == "tanh":
        return x / 2 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    raise ValueError(f"unknown gelu approximation {approximate!r}")


def silu_and_mul(x):
    x = _f64(x)
    half = x.shape[-1] // 2
    return _silu(x[..., :half]) * x[..., half:]


def gelu_and_mul(x, approximate="none"):
    x = _f64(x)
    half = x.shape[-1] // 2
    return gelu(x[..., :half], approximate) * x[..., half:]


def softcap(x, cap):
    return cap * np.tanh(_f64(x) / cap)


def softmax(x):
    x = _f64(x)
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def write_kv(key_cache, value_cache, key, value, slot_mapping):
    new_key, new_value = np.array(key_cache, dtype=np.float64), np.array(value_cache, dtype=np.float64)
    block_size = new_key.shape[1]
    for t, slot in enumerate(np.asarray(slot_mapping, dtype=np.int64)):
        if slot == -1:
            continue
        new_key[slot // block_size, slot % block_size] = key[t]
        new_value[slot // block_size, slot % block_size] = value[t]
    return new_key, new_value


def kv_rows(stored, kv_dtype):
    """A quantized cache's stored rows [..., D + 4] (kv_cache.py's layout) -> (their codes' values, their
    scales [..., 1]), float64: the rows hold codes * scales."""
    raw = np.ascontiguousarray(stored).view(np.uint8)
    scales = raw[..., -KV_SCALE_BYTES:].copy().view("<f4").astype(np.float64)
    codes = raw[..., :-KV_SCALE_BYTES]
    values = codes.view(np.int8).astype(np.float64) if kv_dtype == "int8" else _E4M3FN[codes]
    return values, scales


def nearest_kv_codes(x, kv_dtype):
    """The code values nearest each of `x` (value / scale): whole numbers in -127..127 (int8), or finite
    e4m3fn values (fp8)."""
    if kv_dtype == "int8":
        return np.clip(np.rint(x), -127, 127)
    grid = np.unique(_E4M3FN[np.isfinite(_E4M3FN)])
    above = np.clip(np.searchsorted(grid, x), 1, len(grid) - 1)
    low, high = grid[above - 1], grid[above]
    return np.where(np.abs(high - x) < np.abs(x - low), high, low)


def _e4m3fn(bits):
    """float8 e4m3fn: a sign bit, 4 exponent bits biased by 7 (0: subnormal), 3 mantissa bits; 0x7f and
    0xff are NaN and there are no infinities."""
    sign = -1.0 if bits & 0x80 else 1.0
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


_E4M3FN = np.array([_e4m3fn(bits) for bits in range(256)])


def dequantized_kv(stored, kv_dtype):
    values, scales = kv_rows(stored, kv_dtype)
    return values * scales


def paged_attention(
    q,
    key_cache,
    value_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    scale,
    sliding_window=None,
    logit_softcap=None,
):
    q = _f64(q)
    num_heads, num_kv_heads = q.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = key_cache.shape[1]
    out = np.zeros((*q.shape[:2], value_cache.shape[3]))

    for b in range(len(seq_lens)):
        seq_len = int(seq_lens[b])
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        query_len = end - start

        # Gather this sequence's keys and values into contiguous [seq_len, Hk, D] arrays.
        keys = np.empty((seq_len, num_kv_heads, key_cache.shape[3]))
        values = np.empty((seq_len, num_kv_heads, value_cache.shape[3]))
        for j in range(seq_len):
            block = int(block_tables[b, j // block_size])
            keys[j] = key_cache[block, j % block_size]
            values[j] = value_cache[block, j % block_size]

        j = np.arange(seq_len)
        allowed = np.zeros((query_len, seq_len), dtype=bool)
        for i in range(query_len):
            p = seq_len - query_len + i
            allowed[i] = (j <= p) & (sliding_window is None or j > p - sliding_window)

        for h in range(num_heads):
            kv_head = h // group
            scores = scale * (q[start:end, h] @ keys[:, kv_head].T)
            if logit_softcap is not None:
                scores = logit_softcap * np.tanh(scores / logit_softcap)
            scores = np.where(allowed, scores, -np.inf)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            weights = weights / weights.sum(axis=1, keepdims=True)
            out[start:end, h] = weights @ values[:, kv_head]
    return out


def _log_softmax(x):
    shifted = x - np.max(x)
    return shifted - math.log(np.sum(np.exp(shifted)))


def _sample_row(x, meta: SamplingMetadata, row):
    vocab = x.shape[0]

    # 1. Logit bias.
    for token, value in zip(meta.bias_token_ids[row], meta.bias_values[row]):
        if token != -1:
            x[token] += float(value)

    # 2. Repetition penalty over distinct ids.
    r = float(meta.repetition_penalty[row])
    for token in set(int(t) for t in meta.penalty_tokens[row] if t != -1):
        x[token] = x[token] / r if x[token] > 0 else x[token] * r

    # 3. Frequency and presence penalties.
    counts = {}
    for token in meta.output_tokens[row]:
        if token != -1:
            counts[int(token)] = counts.get(int(token), 0) + 1
    for token, count in counts.items():
        x[token] -= float(meta.frequency_penalty[row]) * count + float(meta.presence_penalty[row])

    # 4. The allowed tokens, then log-probabilities.
    if meta.allowed_token_mask is not None:
        words = meta.allowed_token_mask[row]
        for token in range(vocab):
            if not (int(words[token // 32]) >> (token % 32)) & 1:
                x[token] = -np.inf
    logprobs = _log_softmax(x)

    # 5. Choice.
    candidates = np.zeros(vocab, dtype=bool)
    cdf_low, cdf_high = np.zeros(vocab), np.zeros(vocab)
    temperature = float(meta.temperature[row])
    if temperature == 0:
        chosen = int(np.argmax(x))  # first maximum: the lowest id
        candidates[chosen] = True
        cdf_high[chosen] = 1.0
        return chosen, logprobs, candidates, cdf_low, cdf_high

    p = softmax(x / temperature)
    candidates[:] = True

    top_k = int(meta.top_k[row])
    if 0 < top_k < vocab:
        kth_largest = np.sort(p[candidates])[::-1][top_k - 1]
        candidates &= p >= kth_largest

    top_p = float(meta.top_p[row])
    if top_p < 1:
        ids = np.nonzero(candidates)[0]
        probs = p[ids]
        total = probs.sum()
        descending = np.argsort(-probs, kind="stable")
        sorted_probs = probs[descending]
        sum_before = np.concatenate([[0.0], np.cumsum(sorted_probs)[:-1]])
        # The first position of each value among equals: the sum of strictly more probable ones.
        first_of_value = np.searchsorted(-sorted_probs, -sorted_probs, side="left")
        more_probable = sum_before[first_of_value]
        keep = more_probable < top_p * total
        candidates[ids[descending[~keep]]] = False

    min_p = float(meta.min_p[row])
    if min_p > 0:
        candidates &= p >= min_p * p[candidates].max()

    ids = np.nonzero(candidates)[0]
    q = p[ids] / p[ids].sum()
    cumulative = np.cumsum(q)
    low = np.concatenate([[0.0], cumulative[:-1]])
    high = cumulative.copy()
    high[-1] = 1.0  # the last candidate also takes whatever rounding leaves
    cdf_low[ids], cdf_high[ids] = low, high

    u = float(meta.uniform[row])
    chosen = int(ids[-1])
    for i, token in enumerate(ids):
        if cumulative[i] > u:
            chosen = int(token)
            break
    return chosen, logprobs, candidates, cdf_low, cdf_high


def sample(logits, meta: SamplingMetadata):
    logits = _f64(logits)
    rows, vocab = logits.shape
    k = meta.num_top_logprobs
    result = {
        "token_ids": np.zeros(rows, dtype=np.int64),
        "logprobs": np.zeros(rows),
        "top_token_ids": np.zeros((rows, k), dtype=np.int64),
        "top_logprobs": np.zeros((rows, k)),
        "all_logprobs": np.zeros((rows, vocab)),
        "candidates": np.zeros((rows, vocab), dtype=bool),
        "cdf_low": np.zeros((rows, vocab)),
        "cdf_high": np.zeros((rows, vocab)),
    }
    for row in range(rows):
        chosen, logprobs, candidates, cdf_low, cdf_high = _sample_row(logits[row].copy(), meta, row)
        top = np.argsort(-logprobs, kind="stable")[:k]  # ties: lowest id first
        result["token_ids"][row] = chosen
        result["logprobs"][row] = logprobs[chosen]
        result["top_token_ids"][row] = top
        result["top_logprobs"][row] = logprobs[top]
        result["all_logprobs"][row] = logprobs
        result["candidates"][row] = candidates
        result["cdf_low"][row] = cdf_low
        result["cdf_high"][row] = cdf_high
    return result


def token_logprobs(logits, token_ids, num_top: int):
    """Each row's log-softmax, read at its token: the logprob, its rank, and the top num_top."""
    logits = _f64(logits)
    result = {"logprobs": [], "ranks": [], "top_token_ids": [], "top_logprobs": [], "all_logprobs": []}
    for row, token in zip(logits, np.asarray(token_ids, dtype=np.int64)):
        logprobs = row - row.max() - math.log(np.sum(np.exp(row - row.max())))
        top = np.argsort(-logprobs, kind="stable")[:num_top]
        result["logprobs"].append(logprobs[token])
        result["ranks"].append(1 + int(np.sum(logprobs > logprobs[token])))
        result["top_token_ids"].append(top)
        result["top_logprobs"].append(logprobs[top])
        result["all_logprobs"].append(logprobs)
    return {name: np.array(values).reshape(len(logits), -1) if name.startswith("top") else np.array(values)
            for name, values in result.items()}


def route_experts(router_logits, top_k, scoring="softmax", renormalize=True, scale=1.0, num_groups=1,
                  top_groups=1, group_scoring="max", correction_bias=None):
    """(weights [T, top_k], expert_ids [T, top_k]), one row at a time, ties to the lower id."""
    logits = _f64(router_logits)
    tokens, num_experts = logits.shape
    group_size = num_experts // num_groups
    weights, expert_ids = np.zeros((tokens, top_k)), np.zeros((tokens, top_k), dtype=np.int64)
    for t in range(tokens):
        if scoring == "softmax":
            scores = softmax(logits[t])
        elif scoring == "sigmoid":
            scores = 1 / (1 + np.exp(-logits[t]))
        else:
            raise ValueError(f"unknown expert scoring {scoring!r}")
        choice = scores + _f64(correction_bias) if correction_bias is not None else scores.copy()
        if num_groups > 1:
            group_scores = []
            for g in range(num_groups):
                members = sorted(choice[g * group_size:(g + 1) * group_size], reverse=True)
                group_scores.append(members[0] if group_scoring == "max" else members[0] + members[1])
            kept = sorted(range(num_groups), key=lambda g: (-group_scores[g], g))[:top_groups]
            for g in range(num_groups):
                if g not in kept:
                    choice[g * group_size:(g + 1) * group_size] = -np.inf
        chosen = sorted(range(num_experts), key=lambda e: (-choice[e], e))[:top_k]
        picked = scores[chosen]
        if renormalize:
            picked = picked / (picked.sum() + 1e-20)
        weights[t], expert_ids[t] = picked * scale, chosen
    return weights, expert_ids


def per_head_linear(x, weight):
    return np.einsum("tni,noi->tno", _f64(x), _f64(weight))


def paged_latent_attention(q_latent, q_rope, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale):
    """Attention whose keys are each token's latent (the value cache) followed by its rotary key (the
    key cache), and whose values are the latents: `paged_attention` on those."""
    keys = np.concatenate([_f64(value_cache), _f64(key_cache)], axis=-1)
    queries = np.concatenate([_f64(q_latent), _f64(q_rope)], axis=-1)
    return paged_attention(queries, keys, _f64(value_cache), query_start_loc, seq_lens, block_tables, scale)


def moe_experts(x, weights, expert_ids, gate_up, down, round_activation=lambda a: a, first_expert=0):
    """Each token's experts one by one, skipping those outside the weights' experts first_expert ..;
    `round_activation` rounds each expert's activation to the compute dtype before `down`, as the op
    says."""
    x, gate_up, down = _f64(x), _f64(gate_up), _f64(down)
    intermediate = down.shape[2]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, expert in zip(_f64(weights[t]), np.asarray(expert_ids[t], dtype=np.int64)):
            e = expert - first_expert
            if not 0 <= e < gate_up.shape[0]:
                continue
            gate, up = gate_up[e, :intermediate] @ x[t], gate_up[e, intermediate:] @ x[t]
            activation = _f64(round_activation(_silu(gate) * up))
            out[t] += weight * (down[e] @ activation)
    return out
