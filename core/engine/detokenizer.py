"""Turning generated token ids into text one token at a time, for streaming.

Decoding the whole output after every token costs time proportional to its length, so only a
short window of recent tokens is decoded: the window runs from `_prefix` to the end, and the
tokens from `_prefix` to `_read` are ones whose text was already emitted. The new text is what
decoding the window adds to decoding its emitted part. Decoding a window rather than the new
token alone keeps what depends on neighbours right: spaces that SentencePiece-style decoders
drop from a sequence's first token, and characters whose UTF-8 bytes span several tokens.

The window starts a few tokens back into the prompt, so the first generated token is decoded
as a continuation: a completion of "The capital of France is" reads " Paris", not "Paris".
"""

from __future__ import annotations

from collections.abc import Sequence

from candelabra.core.engine.tokenizer import Tokenizer

# Enough prompt tokens for a decoder to see that the output does not start a sequence.
PROMPT_CONTEXT_TOKENS = 5
# What a decoder writes for bytes that do not (yet) form a whole UTF-8 character.
REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._tokens = [int(token) for token in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        if self._decode(self._tokens).endswith(REPLACEMENT_CHARACTER):
            # The prompt ends inside a character, whose bytes the output would otherwise complete.
            self._tokens = []
        self._prefix = 0
        self._read = len(self._tokens)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int) -> str:
        """The text that `token_id` adds to the output; "" while it ends inside a character."""
        self._tokens.append(int(token_id))
        emitted = self._decode(self._tokens[self._prefix:self._read])
        window = self._decode(self._tokens[self._prefix:])
        if len(window) <= len(emitted):
            if self._is_skipped(token_id):
                # It adds nothing now or later; keeping it would only widen the window.
                self._tokens.pop()
            return ""
        if window.endswith(REPLACEMENT_CHARACTER):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return self._emit(window[len(emitted):])

    def flush(self) -> str:
        """What is still held back at the end of generation, an unfinished character included."""
        emitted = self._decode(self._tokens[self._prefix:self._read])
        window = self._decode(self._tokens[self._prefix:])
        self._prefix = self._read = len(self._tokens)
        return self._emit(window[len(emitted):])

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _is_skipped(self, token_id: int) -> bool:
        """A special token that decoding leaves out."""
        return (self._skip_special_tokens and self._decode([token_id]) == ""
                and self._tokenizer.decode([token_id], skip_special_tokens=False) != "")
