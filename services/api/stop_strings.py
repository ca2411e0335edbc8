"""Stop strings matched in streamed text, across token boundaries (the OpenAI API's ``stop``)."""
from __future__ import annotations


class StopMatcher:
    """Finds stop strings in streamed text, across token boundaries. Text that could be the
    start of a stop string is held back until it is known not to be one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""

    def _held(self, buf: str) -> int:
        """Length of the longest end of buf that begins a stop string."""
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), held, -1):
                if buf.endswith(s[:k]):
                    held = k
                    break
        return held

    def add(self, text: str, final: bool, check: bool = True) -> tuple[str, bool]:
        """(text safe to send, whether a stop string ended it). check=False: no stop yet (min_tokens)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        if check:
            hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
            if hits:
                self.pending = ""
                return buf[:min(hits)], True
        if final:
            self.pending = ""
            return buf, False
        cut = len(buf) - self._held(buf)
        self.pending = buf[cut:]
        return buf[:cut], False
