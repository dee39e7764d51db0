"""Structured output through llguidance: a request's `StructuredOutput` compiled against the
served tokenizer into a grammar, and per sample a matcher that follows the tokens generated so
far and says which tokens may come next, as the bitmask `SamplingMetadata.allowed_token_mask`
carries.

Compiling checks the grammar (an invalid JSON schema, regex or grammar is refused with the
grammar engine's reason) but builds nothing large: llguidance computes each mask lazily from the
grammar and the token trie, in tens of microseconds per token.
"""

from __future__ import annotations

import json
import logging
import threading

import numpy as np

from candelabra.core.contract.step_metadata import token_mask_words
from candelabra.core.requests.sampling_params import StructuredOutput

log = logging.getLogger("candelabra")

# JSON as models write it: ", " between items and ": " after keys, with no other whitespace, so
# that a model cannot pad its output with endless spaces or newlines.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(ValueError):
    """A structured output that cannot be compiled: the message says why."""


class GrammarCompiler:
    """Compiles structured outputs for one tokenizer. The token trie llguidance needs (about a
    second for a 150k-token vocabulary) is built on first use and then shared."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self._ll_tokenizer = None

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _build_ll_tokenizer(self.tokenizer, self.vocab_size)
            return self._ll_tokenizer

    def warm_up(self) -> None:
        """Build the token trie now (a server does it beside its start-up), so that the first
        request with a structured output does not wait for it."""
        try:
            self.ll_tokenizer  # noqa: B018 - built on first access
        except StructuredOutputError as exc:
            log.warning("%s", exc)

    def compile(self, spec: StructuredOutput) -> Grammar:
        import llguidance
        from llguidance.gbnf_to_lark import GbnfToLarkError

        try:
            grammar = _grammar_text(spec)
        except (TypeError, ValueError, GbnfToLarkError) as exc:
            raise StructuredOutputError(f"invalid {spec.kind}: {exc}") from exc
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if problem:
            raise StructuredOutputError(f"invalid {spec.kind}: {' '.join(problem.split())}")
        return Grammar(grammar, self.ll_tokenizer, token_mask_words(self.vocab_size), self.tokenizer.eos_token_ids)


class Grammar:
    """A compiled structured output; `matcher()` starts one sample's walk through it."""

    def __init__(self, text: str, ll_tokenizer, mask_words: int, end_token_ids: frozenset[int]) -> None:
        self.text, self.ll_tokenizer, self.mask_words = text, ll_tokenizer, mask_words
        self.end_token_ids = end_token_ids

    def matcher(self) -> GrammarMatcher:
        import llguidance

        return GrammarMatcher(llguidance.LLMatcher(self.ll_tokenizer, self.text), self.mask_words,
                              token_mask_words(self.ll_tokenizer.vocab_size), self.end_token_ids)


class GrammarMatcher:
    """One sample's place in its grammar: the tokens it may take next, and the tokens it took."""

    def __init__(self, matcher, mask_words: int, grammar_words: int, end_token_ids: frozenset[int]) -> None:
        self._matcher, self.mask_words, self._grammar_words = matcher, mask_words, grammar_words
        self.end_token_ids = end_token_ids  # the tokens the grammar allows once its text may end

    def allowed_token_mask(self, out: np.ndarray) -> None:
        """Write the next token's allowed-token bitmask into the int32 row `out` of
        `mask_words` words (the model's vocabulary)."""
        from llguidance.numpy import fill_next_token_bitmask

        if self._grammar_words == self.mask_words:
            fill_next_token_bitmask(self._matcher, out[None, :], 0)
            return
        # The tokenizer knows tokens past the model's vocabulary: they can never be sampled.
        full = np.zeros((1, self._grammar_words), dtype=np.int32)
        fill_next_token_bitmask(self._matcher, full, 0)
        out[:] = full[0, : self.mask_words]

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False when the grammar does not allow it (the matcher is then
        in error and allows nothing more)."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def finished(self) -> bool:
        """The grammar is complete and its end token taken, or it failed: nothing may follow."""
        return self._matcher.is_stopped() or self._matcher.is_error()

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def copy(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy(), self.mask_words, self._grammar_words, self.end_token_ids)


def _build_ll_tokenizer(tokenizer, vocab_size: int):
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer.hf_tokenizer, n_vocab=max(vocab_size, tokenizer.vocab_size),
                                            eos_token=sorted(tokenizer.eos_token_ids) or None)
    except Exception as exc:  # noqa: BLE001 - llguidance raises plain exceptions for tokenizers it cannot read
        raise StructuredOutputError(f"structured output is not available for this model's tokenizer: {exc}") from exc


def _grammar_text(spec: StructuredOutput) -> str:
    import llguidance

    kind = spec.kind
    if kind == "json_schema":
        schema = spec.json_schema if isinstance(spec.json_schema, dict) else {}
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_LAYOUT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(_choice_lark(spec.choice))
    return llguidance.LLMatcher.grammar_from_lark(_lark_text(spec.grammar))


def _choice_lark(choices: tuple[str, ...]) -> str:
    return "start: " + " | ".join(json.dumps(choice) for choice in choices)


def _lark_text(grammar: str) -> str:
    """Lark as it is, or GBNF (llama.cpp's `root ::= ...`) converted."""
    from llguidance.gbnf_to_lark import any_to_lark

    return any_to_lark(grammar)
