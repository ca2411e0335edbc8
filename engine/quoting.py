"""How an error message quotes a caller's value: a short prefix of its repr, never the whole
value (a 1 MB field must not come back in the error, nor fill the log)."""
from __future__ import annotations

MAX_QUOTED_CHARS = 48      # of one quoted value
MAX_MESSAGE_CHARS = 512    # of a whole error message a client reads


def quoted(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """repr(value), cut to its first limit characters (marked with "...") when longer. A huge int
    is not turned into digits first (its repr alone can be costly)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, (str, bytes, bytearray)) and len(value) > limit:
        value = value[:limit]
        return repr(value) + "..."
    if isinstance(value, (list, tuple, dict, set)) and len(value) > limit:
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def capped(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """message, cut to limit characters: the last line of defence for a message that quotes a value."""
    return message if len(message) <= limit else message[:limit] + "... (cut)"
