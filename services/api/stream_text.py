"""Text that arrives in pieces: how much of a piece's end must be held back because it may be the
start of a tag a stream parser looks for (services/api/reasoning.py, tool_parsers.py)."""
from __future__ import annotations


def partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of text that is a proper beginning of one of tags."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best
