"""Stop strings over a stream of text pieces: a stop may end inside a token or span several.

Text that could still turn out to be the start of a stop string is held back until it is known
not to be; the stop string itself is never released."""

from __future__ import annotations


class StopStrings:
    """Owns one request's generated text and how much of it was released."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._text = ""
        self._sent = 0  # characters released

    def push(self, piece: str) -> tuple[str, bool]:
        """The text now safe to release, and whether a stop string was completed (the text
        released is then everything before it, and the request ends)."""
        self._text += piece
        found = [i for i in (self._text.find(s, self._sent) for s in self.stops) if i >= 0]
        if found:
            out, self._sent = self._text[self._sent:min(found)], len(self._text)
            return out, True
        # A stop cannot begin before `_sent`: what was released had no suffix that starts one.
        keep = self._held(self._text)
        out = self._text[self._sent:len(self._text) - keep]
        self._sent = len(self._text) - keep
        return out, False

    def flush(self) -> str:
        """What was held back, once the stream ended without completing a stop."""
        out, self._sent = self._text[self._sent:], len(self._text)
        return out

    def _held(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text) - self._sent), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
