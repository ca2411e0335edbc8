"""The sizes a caller controls and the checks both front doors (gRPC Router, OpenAI HTTP) make
on them before doing any work: counts first (they cost nothing to read), then the bytes of each
string, then tokenizing. Every refusal is a RouterError naming the field and the setting."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.errors import RouterError


@dataclass(slots=True)
class RequestLimits:
    """Sizes a caller controls, checked before any work is done for them."""

    max_prompt_bytes: int = field(default=1 << 20, metadata={
        "help": "largest text prompt (or chat messages, every string counted) in UTF-8 bytes, checked before "
                "tokenizing"})
    max_request_id_chars: int = field(default=256, metadata={"help": "longest request_id"})
    max_stop_token_ids: int = field(default=256, metadata={"help": "most stop_token_ids in one request"})
    max_stop_bytes: int = field(default=256, metadata={
        "help": "longest stop string in UTF-8 bytes (at most 4 of them, as OpenAI)"})
    max_http_body_bytes: int = field(default=8 << 20, metadata={
        "help": "largest HTTP request body, refused (413) while it is read, before parsing"})
    http_body_timeout_s: float = field(default=30.0, metadata={
        "help": "an HTTP request body must arrive within this long (408 otherwise)"})
    max_choices: int = field(default=64, metadata={
        "help": "most choices (prompts x n) in one HTTP request, checked before any prompt is tokenized"})
    max_chat_messages: int = field(default=2048, metadata={
        "help": "most messages in one chat request (OpenAI's limit)"})
    max_pending_requests: int = field(default=1024, metadata={
        "help": "most requests being received, parsed and tokenized at once, over gRPC and HTTP together (before "
                "the admission queue, which --max-queued-requests caps); one more is refused (429 / "
                "RESOURCE_EXHAUSTED)"})

    def __post_init__(self) -> None:
        for name in ("max_prompt_bytes", "max_request_id_chars", "max_stop_token_ids", "max_stop_bytes",
                     "max_http_body_bytes", "max_choices", "max_chat_messages", "max_pending_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.http_body_timeout_s > 0:
            raise ValueError(f"http_body_timeout_s must be > 0, got {self.http_body_timeout_s}")


def invalid(field_name: str, message: str) -> RouterError:
    return RouterError("INVALID_ARGUMENT", message, field=field_name)


def check_count(n: int, field_name: str, limit: int, setting: str, what: str = "entries") -> None:
    if n > limit:
        raise invalid(field_name, f"{field_name} has {n} {what}; the limit is {limit} ({setting})")


def utf8_size(text: str, field_name: str, limit: int, setting: str = "max_prompt_bytes") -> int:
    """UTF-8 bytes of text, refused over limit (too_large: HTTP 413) or when it is not Unicode a
    client could have sent (a lone surrogate, as JSON's "\\ud800" decodes to)."""
    if len(text) > limit:   # every character is at least one byte: no need to encode it
        raise RouterError("INVALID_ARGUMENT", f"{field_name} has more than {limit} bytes ({setting})",
                          field=field_name, too_large=True)
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:
        raise invalid(field_name, f"{field_name} is not valid Unicode: a lone surrogate at character "
                                  f"{exc.start}") from None
    if size > limit:
        raise RouterError("INVALID_ARGUMENT", f"{field_name} has {size} bytes; the limit is {limit} ({setting})",
                          field=field_name, too_large=True)
    return size
