"""The op interface: everything a model graph computes, defined once for every backend.

Model graphs hold backend tensors (numpy arrays, torch tensors, mx.arrays) and may use only this
subset of array methods on them directly; the conformance suite checks each backend honours it:

    x.shape                   a tuple of ints
    x.reshape(d0, d1, ...)    same element count; at most one -1
    x[i], x[a:b], x[:, a:b], x[..., a:b]    basic indexing with ints and slices
    x + y, x * y              elementwise, y a tensor of the same shape and dtype or a Python float;
                              the result keeps x's dtype

Everything heavier is an op below. Shared conventions:

* T is the number of tokens in the step, B the number of sequences (or logit rows).
* Float tensors are in the backend's compute dtype ("float32", "float16", "bfloat16"); integer
  metadata is int32. Low-precision inputs are computed in at least float32 internally and the
  result is rounded to the input dtype once, at the end, unless an op says otherwise.
* Ops are functional: they return new tensors and leave their inputs unchanged, except
  `write_kv`, which returns the updated cache (a backend may update it in place and return the
  same object; the caller must use the returned value either way).
* Nothing here synchronises with the host or has a data-dependent output shape, so a backend can
  capture a whole decode step in a graph or evaluate it lazily. That binds what an op returns, not
  how it computes it: an op may use boolean masks or host-side indexing inside where its backend
  neither captures nor compiles steps (the numpy backend does), at the price of never doing so.
* A backend that cannot run an op (at all, or for some argument) raises `OpNotSupported`; the
  base class raises it for every op a backend does not override.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

Tensor = Any
RotaryStyle = Literal["neox", "gptj"]
GeluApproximation = Literal["none", "tanh"]
# A gated MLP's activation: silu_and_mul's, or gelu_and_mul's in its erf or tanh form.
GatedActivation = Literal["silu", "gelu", "gelu_tanh"]
GATED_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu", "gelu_tanh")
ExpertScoring = Literal["softmax", "sigmoid"]
GroupScoring = Literal["max", "top2_sum"]

OP_NAMES: tuple[str, ...] = (
    "embedding",
    "gather_rows",
    "linear",
    "rms_norm",
    "add_rms_norm",
    "layer_norm",
    "rotary",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu",
    "gated_linear",
    "rms_norm_linear",
    "rms_norm_gated_mlp",
    "write_kv",
    "rotary_and_write_kv",
    "paged_attention",
    "rotary_and_paged_attention",
    "softcap",
    "softmax",
    "sample",
    "token_logprobs",
    "route_experts",
    "moe_experts",
    "per_head_linear",
    "paged_latent_attention",
)


# Ops whose default implementation runs other ops in turn, which a backend may fuse.
FUSED_OPS: dict[str, tuple[str, ...]] = {"rotary_and_write_kv": ("rotary", "write_kv"),
                                         "gated_linear": ("silu_and_mul", "gelu_and_mul", "linear"),
                                         "rms_norm_linear": ("rms_norm", "add_rms_norm", "linear"),
                                         "rms_norm_gated_mlp": ("rms_norm_linear", "gated_linear"),
                                         "rotary_and_paged_attention": ("rotary_and_write_kv", "paged_attention")}


class OpNotSupported(NotImplementedError):
    """Raised by a backend for an op, or an op argument, that it does not implement."""

    def __init__(self, backend: str, op: str, detail: str = "") -> None:
        self.backend, self.op = backend, op
        super().__init__(f"backend {backend!r} does not support {op}" + (f": {detail}" if detail else ""))


class KVCache(NamedTuple):
    """One layer's paged cache: `key` and `value`, each [num_blocks, block_size, num_kv_heads,
    head_dim]. Slot s is row `s % block_size` of block `s // block_size`.

    A latent cache (multi-head latent attention, see `Ops.paged_latent_attention`) has one KV head:
    `key` holds each token's rotary key [.., 1, P] and `value` its compressed latent [.., 1, R]."""

    key: Tensor
    value: Tensor


class SampleResult(NamedTuple):
    """What `Ops.sample` returns, as backend tensors.

    token_ids[B] int32; logprobs[B] float32 (of the chosen tokens); top_token_ids[B, K] int32 and
    top_logprobs[B, K] float32 with K = num_top_logprobs, most probable first. With K = 0 the two
    top tensors still come back, of shape [B, 0].
    """

    token_ids: Tensor
    logprobs: Tensor
    top_token_ids: Tensor
    top_logprobs: Tensor


class TokenLogprobs(NamedTuple):
    """What `Ops.token_logprobs` returns, as backend tensors.

    logprobs[N] float32 (of the given tokens); ranks[N] int32 (1 for the most likely);
    top_token_ids[N, K] int32 and top_logprobs[N, K] float32 with K = num_top, most probable first;
    [N, 0] when num_top is 0.
    """

    logprobs: Tensor
    ranks: Tensor
    top_token_ids: Tensor
    top_logprobs: Tensor


class Ops:
    """The ops of one backend. Subclasses override what they implement."""

    backend_name = "unnamed"

    def supports(self, op: str) -> bool:
        """Whether this backend implements `op` at all (it may still refuse some arguments). A fused
        op is supported when the backend fuses it or implements every op its default runs."""
        if op not in OP_NAMES:
            raise ValueError(f"unknown op {op!r}")
        if getattr(type(self), op) is not getattr(Ops, op):
            return True
        return op in FUSED_OPS and all(self.supports(part) for part in FUSED_OPS[op])

    def _unsupported(self, op: str) -> OpNotSupported:
        return OpNotSupported(self.backend_name, op)

    def embedding(self, ids: Tensor, table: Tensor, scale: float | None = None) -> Tensor:
        """Rows of `table` [V, H] at `ids` [T] (int32, each in [0, V)): out[t] = table[ids[t]].

        `table` is what `Backend.upload_weight` returned for the embedding role (always handed
        over dense). With `scale`, each row is then multiplied by it (Gemma scales by sqrt(H)).
        Returns [T, H] in the table's dtype.
        """
        raise self._unsupported("embedding")

    def gather_rows(self, x: Tensor, rows: Tensor) -> Tensor:
        """Rows of activations x [T, H] at `rows` [N] (int32, each in [0, T), repeats and any
        order allowed): out[n] = x[rows[n]], exactly. Returns [N, H] in x's dtype.

        This picks rows of an op's output (the hidden states whose logits are needed, the logits
        rows a batch samples from); `embedding` only ever reads an uploaded table.
        """
        raise self._unsupported("gather_rows")

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ W.T (+ bias): x [..., K], W [N, K], bias [N] -> [..., N].

        `weight` is what `Backend.upload_weight` returned for a linear or lm_head role, and W its
        values: the dense array handed over, or the `QuantizedTensor`'s `dequantize()`. `bias` is
        what it returned for the bias role. Products are accumulated in at least float32 (a native
        bfloat16 or float16 matmul that accumulates in float32 and rounds once meets this); with a
        quantized weight a backend may first round x to 8-bit integers with one scale per block of
        32 values along K (256 for the K formats), as llama.cpp's kernels do; the conformance
        thresholds per format allow that much and no more.
        """
        raise self._unsupported("linear")

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, weight_offset: float = 0.0) -> Tensor:
        """Root-mean-square norm over the last axis: x [..., H], weight [H] -> [..., H].

        y = x / sqrt(mean(x**2, last axis) + eps) * (weight_offset + weight), in float32.
        Gemma stores w - 1 and passes weight_offset=1.
        """
        raise self._unsupported("rms_norm")

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float, weight_offset: float = 0.0
    ) -> tuple[Tensor, Tensor]:
        """Fused residual add and norm: returns (rms_norm(s, weight, eps, weight_offset), s) with
        s = x + residual rounded to the input dtype, and the norm computed from that rounded s.
        """
        raise self._unsupported("add_rms_norm")

    def layer_norm(self, x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
        """Layer norm over the last axis: x [..., H], weight and bias [H] -> [..., H].

        y = (x - mean) / sqrt(var + eps) * weight (+ bias), var the biased (1/H) variance.
        """
        raise self._unsupported("layer_norm")

    def rotary(
        self,
        q: Tensor,
        k: Tensor,
        positions: Tensor,
        cos_sin: Tensor,
        style: RotaryStyle = "neox",
    ) -> tuple[Tensor, Tensor]:
        """Rotary position embedding of q [T, Hq, D] and k [T, Hk, D] at `positions` [T] int32.

        `cos_sin` [max_positions, R] float32 is a table (see `candelabra.core.models.rope`): row p holds
        cos(p * f_i) in columns [0, R/2) and sin(p * f_i) in [R/2, R), i = 0 .. R/2-1, already
        carrying any scaling (linear, llama3, yarn and its attention factor). The first R <= D
        features of each head rotate (partial rotary when R < D); the rest pass through. With
        c, s the cos and sin of pair i at the token's position, each pair (a, b) becomes
        (a*c - b*s, b*c + a*s), where pair i is
            neox: (x[i], x[i + R/2])      gptj: (x[2i], x[2i + 1]).
        Returns the rotated (q, k) in their input dtype.
        """
        raise self._unsupported("rotary")

    def silu_and_mul(self, x: Tensor) -> Tensor:
        """Gated SiLU: x [..., 2I] -> silu(x[..., :I]) * x[..., I:], silu(a) = a / (1 + exp(-a))."""
        raise self._unsupported("silu_and_mul")

    def gelu_and_mul(self, x: Tensor, approximate: GeluApproximation = "none") -> Tensor:
        """Gated GELU: x [..., 2I] -> gelu(x[..., :I], approximate) * x[..., I:]."""
        raise self._unsupported("gelu_and_mul")

    def gelu(self, x: Tensor, approximate: GeluApproximation = "none") -> Tensor:
        """GELU, elementwise. "none": x/2 * (1 + erf(x / sqrt(2))); "tanh":
        x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x**3)))."""
        raise self._unsupported("gelu")

    def gated_linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None,
                     activation: GatedActivation = "silu") -> Tensor:
        """A gated MLP's down projection: `linear(gated, weight, bias)` of gated = `silu_and_mul(x)`
        (activation "silu") or `gelu_and_mul(x, "none")` ("gelu") or `gelu_and_mul(x, "tanh")`
        ("gelu_tanh"), for x [..., 2I] and a linear weight W [N, I] -> [..., N]. A backend may fuse
        the two and may or may not round the gated values to x's dtype before the product (this
        default runs the two ops in turn, so it does)."""
        if activation == "silu":
            gated = self.silu_and_mul(x)
        elif activation in ("gelu", "gelu_tanh"):
            gated = self.gelu_and_mul(x, "tanh" if activation == "gelu_tanh" else "none")
        else:
            raise ValueError(f"unknown gated activation {activation!r}; expected one of {GATED_ACTIVATIONS}")
        return self.linear(gated, weight, bias)

    def rms_norm_linear(self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
                        bias: Tensor | None = None, weight_offset: float = 0.0) -> tuple[Tensor, Tensor]:
        """A pre-norm's first projection: (`linear(normed, weight, bias)`, s) for (normed, s) =
        `add_rms_norm(x, residual, norm_weight, eps, weight_offset)`, or normed = `rms_norm(x, ...)` and
        s = x itself with `residual` None. x [..., H], W [N, H] -> ([..., N], [..., H]). A backend may fuse
        the norm into the product and may or may not round the normalised values to x's dtype before it
        (this default runs the ops in turn, so it does); s is rounded as `add_rms_norm`'s is."""
        if residual is None:
            normed, joined = self.rms_norm(x, norm_weight, eps, weight_offset), x
        else:
            normed, joined = self.add_rms_norm(x, residual, norm_weight, eps, weight_offset)
        return self.linear(normed, weight, bias), joined

    def rms_norm_gated_mlp(self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                           gate_up: Tensor, down: Tensor, gate_up_bias: Tensor | None = None,
                           down_bias: Tensor | None = None, weight_offset: float = 0.0,
                           activation: GatedActivation = "silu") -> tuple[Tensor, Tensor]:
        """A pre-norm and the gated MLP reading it: (`gated_linear(projected, down, down_bias, activation)`, s)
        for (projected, s) = `rms_norm_linear(x, residual, norm_weight, eps, gate_up, gate_up_bias,
        weight_offset)`. `gate_up` [2I, H] holds the gate's I rows, then the up's; `down` [N, I].
        x [..., H] -> ([..., N], [..., H]). A backend may fuse any of it, and may or may not round the normalised
        values, the gate and up products and the gated values to x's dtype (this default runs the two ops in
        turn)."""
        projected, joined = self.rms_norm_linear(x, residual, norm_weight, eps, gate_up, gate_up_bias, weight_offset)
        return self.gated_linear(projected, down, down_bias, activation), joined

    def write_kv(self, cache: KVCache, key: Tensor, value: Tensor, slot_mapping: Tensor) -> KVCache:
        """Store each token's key [T, Hk, D] and value [T, Hk, Dv] in the cache at its slot (Dv is D
        except in a latent cache, where the key is the rotary part and the value the latent).

        Token t goes to slot `slot_mapping[t]` (int32 [T]); a slot of -1 writes nothing. Slots
        are distinct. Every other slot keeps its contents. Returns the updated cache.
        """
        raise self._unsupported("write_kv")

    def rotary_and_write_kv(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        positions: Tensor,
        cos_sin: Tensor,
        cache: KVCache,
        slot_mapping: Tensor,
        style: RotaryStyle = "neox",
    ) -> tuple[Tensor, KVCache]:
        """`rotary` of q and k, then `write_kv` of the rotated k with v: returns (rotated q, the
        updated cache). The rotated keys go to the cache only, so a backend may fuse the two and
        write them rounded once, to the cache's dtype; this default runs the two ops in turn."""
        q, k = self.rotary(q, k, positions, cos_sin, style)
        return q, self.write_kv(cache, k, v, slot_mapping)

    def rotary_and_paged_attention(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin: Tensor,
                                   cache: KVCache, slot_mapping: Tensor, step: Any, scale: float,
                                   sliding_window: int | None = None, logit_softcap: float | None = None,
                                   style: RotaryStyle = "neox") -> tuple[Tensor, KVCache]:
        """`rotary_and_write_kv`, then `paged_attention` of the rotated q: returns (the attention's output
        [T, Hq, D], the updated cache). A backend may fuse the two (rotating q as its attention loads it, say,
        and writing each token's key and value before reading the cache); this default runs them in turn."""
        q, cache = self.rotary_and_write_kv(q, k, v, positions, cos_sin, cache, slot_mapping, style)
        return self.paged_attention(q, cache, step, scale, sliding_window, logit_softcap), cache

    def paged_attention(
        self,
        q: Tensor,
        cache: KVCache,
        step: Any,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> Tensor:
        """Causal attention of the step's queries over the paged cache: q [T, Hq, D] -> [T, Hq, D].

        `step` is the backend's prepared `StepMetadata` (`Backend.prepare_step`); the cache must
        already hold this step's keys and values (`write_kv` first). For sequence b, its j-th
        key/value is at slot `block_tables[b, j // block_size] * block_size + j % block_size`,
        j < seq_lens[b]. Its query token at position p (see StepMetadata) attends to the keys j
        with j <= p and, given `sliding_window` W, also j > p - W (W keys in all, itself
        included). Query head h reads KV head h // (Hq / Hk) (grouped-query attention).

            s_j = scale * (q . k_j);  with `logit_softcap` c: s_j = c * tanh(s_j / c)
            out = sum_j softmax(s)_j * v_j

        Slots the step does not cover (other sequences' blocks, the tail of a last block, the
        padding of block_tables) may hold anything, NaN included, and must not affect the output.
        """
        raise self._unsupported("paged_attention")

    def softcap(self, x: Tensor, cap: float) -> Tensor:
        """Soft-capping, elementwise: cap * tanh(x / cap)."""
        raise self._unsupported("softcap")

    def softmax(self, x: Tensor) -> Tensor:
        """Softmax over the last axis, exp(x - max) / sum(exp(x - max)): finite for any finite x."""
        raise self._unsupported("softmax")

    def sample(self, logits: Tensor, params: Any) -> SampleResult:
        """Choose one token per row of logits [B, V], given the backend's prepared
        `SamplingMetadata` (`Backend.prepare_sampling`). In float32 at least, per row:

        1. x = logits + logit bias (each (id, value) pair adds value to x[id]; pairs add up).
        2. Repetition penalty r: for every distinct id in penalty_tokens, x[id] = x[id] / r if
           x[id] > 0 else x[id] * r.
        3. With c[id] the count of id in output_tokens: x[id] -= frequency_penalty * c[id] +
           presence_penalty * (c[id] > 0).
        4. Tokens that allowed_token_mask excludes (when it is not None) get x[id] = -inf.
           logprobs = log_softmax(x). The result carries logprobs[chosen] and the
           num_top_logprobs highest logprobs with their ids, highest first (equal logprobs in
           any order).
        5. temperature 0: chosen = argmax(x), the lowest id among equal maxima. Otherwise
           p = softmax(x / temperature), and a token stays a candidate only if it passes each
           enabled filter, applied in turn to the candidates left by the previous one:
           top_k: p is among the top_k largest (ties at the k-th value all stay);
           top_p: the summed probability of the candidates more probable than it is < top_p
                  times the candidates' total;
           min_p: p >= min_p * max(p).
           With q the candidates' probabilities normalised to sum 1 and taken in increasing id
           order, chosen = the first candidate whose cumulative q exceeds uniform (the last
           candidate if rounding leaves none).
        """
        raise self._unsupported("sample")

    def token_logprobs(self, logits: Tensor, token_ids: Tensor, num_top: int) -> TokenLogprobs:
        """How likely each row's given token is: logits [N, V] and token_ids [N] (int32, each in
        [0, V)), scored as they are (no bias, penalty or temperature). In float32 at least, per
        row n, with logprobs = log_softmax(logits[n]) = logits[n] - log(sum(exp(logits[n]))):

            logprobs[n] = logprobs[token_ids[n]]
            ranks[n] = 1 + the number of ids whose logprob is strictly greater than it
            top_token_ids[n], top_logprobs[n]: the num_top highest logprobs and their ids,
                highest first (equal logprobs in any order); num_top <= V.

        This scores a prompt: the logits of each prompt token against the token after it.
        """
        raise self._unsupported("token_logprobs")

    def route_experts(
        self,
        router_logits: Tensor,
        top_k: int,
        scoring: ExpertScoring = "softmax",
        renormalize: bool = True,
        scale: float = 1.0,
        num_groups: int = 1,
        top_groups: int = 1,
        group_scoring: GroupScoring = "max",
        correction_bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Choose each token's top_k experts of a mixture-of-experts layer: router_logits [T, E] (the
        router `linear`'s output) -> (weights [T, top_k] float32, expert_ids [T, top_k] int32).
        In float32 at least, per row:

        1. scores = softmax(router_logits) ("softmax") or sigmoid(router_logits) ("sigmoid").
        2. choice = scores + correction_bias (float32 [E]) when given, else scores: the bias only
           steers the choice, the weights come from the unbiased scores.
        3. With num_groups > 1, the E experts form num_groups consecutive groups of E / num_groups.
           A group scores the max of its choice values (group_scoring "max") or the sum of its two
           largest ("top2_sum"); only the top_groups best groups stay, and the other groups'
           experts cannot be chosen (their choice is -inf).
        4. expert_ids = the top_k experts by choice, best first (ties: the lower expert id first,
           and in step 3 the lower group).
        5. weights = scores[expert_ids]; with `renormalize`, divided by their sum (plus 1e-20);
           then times `scale`.

        Mixtral: softmax, renormalize. Qwen3-MoE: softmax, renormalize = norm_topk_prob.
        DeepSeek-V2: softmax, groups by "max", renormalize = norm_topk_prob, scale =
        routed_scaling_factor. DeepSeek-V3: sigmoid, correction_bias = e_score_correction_bias,
        groups by "top2_sum", renormalize = norm_topk_prob, scale = routed_scaling_factor.
        Arguments that cannot route (see `check_routing`) raise ValueError.
        """
        raise self._unsupported("route_experts")

    def moe_experts(self, x: Tensor, weights: Tensor, expert_ids: Tensor, gate_up: Tensor, down: Tensor,
                    first_expert: int = 0) -> Tensor:
        """The routed experts' gated SiLU MLPs, summed by weight: x [T, H] -> [T, H].

        `weights` [T, K] float32 and `expert_ids` [T, K] int32 are what `route_experts` returned;
        `gate_up` and `down` what `Backend.upload_weight` returned for the experts role, of
        values [E, 2I, H] (the gate rows, then the up rows) and [E, H, I]: the layer's experts
        first_expert .. first_expert + E - 1 (all of them where first_expert is 0 and E the
        router's count; a tensor-parallel rank holds its share). Experts it took still quantized
        multiply as `linear`'s quantized weights do. With e = expert_ids[t, j] - first_expert,
        gate[e] = gate_up[e, :I] and up[e] = gate_up[e, I:]:

            out[t] = sum over j with 0 <= e < E of
                     weights[t, j] * (down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])))

        A pick of an expert the weights do not hold adds nothing (it is another rank's, and the
        ranks' outputs summed are the whole layer's). Products are accumulated in at least
        float32. Each expert's activation (the silu product) is rounded to x's dtype before
        `down`, as a dense MLP's is by `silu_and_mul`; the weighted sum over experts is in float32
        and rounded to x's dtype once, at the end. How a backend gets there (a loop over the
        experts used, tokens sorted by expert, a grouped matmul) is its own choice.
        """
        raise self._unsupported("moe_experts")

    def per_head_linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """One matrix per head: x [T, N, In], weight [N, Out, In] -> [T, N, Out], with
        out[t, n] = weight[n] @ x[t, n]. `weight` is what `Backend.upload_weight` returned for role
        PER_HEAD. Multi-head latent attention folds its key and value up-projections into the query and
        the output with it."""
        raise self._unsupported("per_head_linear")

    def paged_latent_attention(self, q_latent: Tensor, q_rope: Tensor, cache: KVCache, step: Any,
                               scale: float) -> Tensor:
        """Causal attention over a latent cache (multi-head latent attention, DeepSeek V2/V3, in the
        form that folds the key and value up-projections into the query and the output):
        q_latent [T, H, R] and q_rope [T, H, P] -> [T, H, R].

        The cache has one KV head: `cache.value` [.., 1, R] holds each key's compressed latent c_j,
        `cache.key` [.., 1, P] its rotary part r_j, written by `write_kv` (or `rotary_and_write_kv`)
        with the latent as the value. Which keys a query sees is as in `paged_attention` (causal, no
        window), and every query head reads the one KV head:

            s_j = scale * (q_latent . c_j + q_rope . r_j)
            out = sum_j softmax(s)_j * c_j

        Slots the step does not cover may hold anything, NaN included, as in `paged_attention`.
        """
        raise self._unsupported("paged_latent_attention")


def check_routing(num_experts: int, top_k: int, scoring: str, num_groups: int, top_groups: int,
                  group_scoring: str) -> None:
    """Raise ValueError, saying why, for `route_experts` arguments that cannot pick top_k experts."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown expert scoring {scoring!r}; expected 'softmax' or 'sigmoid'")
    if group_scoring not in ("max", "top2_sum"):
        raise ValueError(f"unknown group scoring {group_scoring!r}; expected 'max' or 'top2_sum'")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not form {num_groups} groups of equal size")
    if not 1 <= top_groups <= num_groups:
        raise ValueError(f"top_groups {top_groups} must be between 1 and num_groups {num_groups}")
    group_size = num_experts // num_groups
    if num_groups > 1 and group_scoring == "top2_sum" and group_size < 2:
        raise ValueError(f"'top2_sum' scores a group by its two best experts; groups of {group_size} have one")
    choosable = top_groups * group_size if num_groups > 1 else num_experts
    if not 1 <= top_k <= choosable:
        raise ValueError(f"top_k {top_k} must be between 1 and the {choosable} experts that can be chosen")


def check_experts_shapes(x: Tensor, weights: Tensor, expert_ids: Tensor, gate_up: Tensor, down: Tensor,
                         first_expert: int = 0) -> None:
    """Raise ValueError, naming the shapes, where `moe_experts` arguments do not fit together (or
    first_expert is negative)."""
    if first_expert < 0:
        raise ValueError(f"moe_experts' first_expert is the layer's index of the first expert held; got {first_expert}")
    shapes = {name: tuple(value.shape) for name, value in
              (("x", x), ("weights", weights), ("expert_ids", expert_ids), ("gate_up", gate_up), ("down", down))}
    tokens, hidden = shapes["x"] if len(shapes["x"]) == 2 else (None, None)
    fits = (
        hidden is not None and len(shapes["gate_up"]) == 3 and len(shapes["down"]) == 3
        and shapes["weights"] == shapes["expert_ids"] and len(shapes["weights"]) == 2
        and shapes["weights"][0] == tokens
        and shapes["gate_up"][0] == shapes["down"][0] and shapes["gate_up"][2] == hidden
        and shapes["down"][1] == hidden and shapes["gate_up"][1] == 2 * shapes["down"][2]
    )
    if not fits:
        described = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"moe_experts takes x [T, H], weights and expert_ids [T, K], gate_up [E, 2I, H] and "
                         f"down [E, H, I]; got {described}")
