"""Log lines a caller cannot forge: control characters in a message (a request id, a prompt
fragment in an error) are escaped, so a client cannot start a fake log line, rewrite the
terminal, or hide text from whoever reads the log. A traceback keeps its line breaks."""
from __future__ import annotations

import logging
import re

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# C0 and C1 controls, DEL, and the invisible formatting characters that reorder or break lines.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_TRACEBACK_CONTROLS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """text with every control character written as a Python escape (\\n, \\x1b: \\x0a, \\x1b)."""
    return _CONTROLS.sub(_escape, text)


class EscapingFormatter(logging.Formatter):
    """logging.Formatter whose messages (and exception text, but for its line breaks) have their
    control characters escaped."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return _TRACEBACK_CONTROLS.sub(_escape, super().formatException(ei))


def configure(level: str) -> None:
    """The root logger at level, to stderr, through EscapingFormatter."""
    handler = logging.StreamHandler()
    handler.setFormatter(EscapingFormatter(LOG_FORMAT))
    logging.basicConfig(level=getattr(logging, level), handlers=[handler])
