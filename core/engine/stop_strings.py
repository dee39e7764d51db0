"""Stop strings on streamed text: emit what cannot become part of a stop string, hold back what
still might, and end at the first stop string that completes.

"First" means the one that completes first as the text grows, as generation would have stopped
at that token; of two completing at the same character, the longer. That makes the result the
same however the text is split into feeds.

Each stop string is followed by a Knuth-Morris-Pratt matcher, which remembers how much of the
stop string the text so far ends with: each character costs constant time (amortized) per
stop string, whatever the lengths of the text and of the stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence


class _StopStringProgress:
    """How long a beginning of `stop` the text fed so far ends with."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.matched_length = 0
        # fallback[i]: the longest proper beginning of stop[:i + 1] that also ends it.
        self._fallback = [0] * len(stop)
        length = 0
        for i in range(1, len(stop)):
            while length and stop[i] != stop[length]:
                length = self._fallback[length - 1]
            if stop[i] == stop[length]:
                length += 1
            self._fallback[i] = length

    def advance(self, character: str) -> bool:
        """Takes the next character; whether the stop string is now complete."""
        length = self.matched_length
        while length and character != self.stop[length]:
            length = self._fallback[length - 1]
        if character == self.stop[length]:
            length += 1
        self.matched_length = length
        return length == len(self.stop)


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]) -> None:
        self._progress = [_StopStringProgress(s) for s in dict.fromkeys(stop) if s]
        self._held = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str) -> tuple[str, bool]:
        """(the text safe to emit now, whether a stop string completed). After a stop, nothing
        more is emitted."""
        if self.stopped:
            return "", True
        if not self._progress:
            return text, False
        pending = self._held + text
        for end, character in enumerate(text, start=len(self._held) + 1):
            completed = [p.stop for p in self._progress if p.advance(character)]
            if completed:
                self.matched = max(completed, key=len)
                self._held = ""
                return pending[:end - len(self.matched)], True
        # Every stop string that may still complete begins within the held text.
        held = max(p.matched_length for p in self._progress)
        self._held = pending[len(pending) - held:]
        return pending[:len(pending) - held], False

    def finish(self) -> str:
        """The held-back text, for when generation ends for another reason (EOS, length)."""
        held, self._held = self._held, ""
        return held
