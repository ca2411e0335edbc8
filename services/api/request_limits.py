"""The sizes a caller controls and the checks both front doors (gRPC Router, OpenAI HTTP) make
on them before doing any work: counts first (they cost nothing to read), then the bytes of each
string, then tokenizing. Every refusal is an InvalidRequest (a ValueError) naming the field and
the setting; each door maps it to its protocol (gRPC INVALID_ARGUMENT, HTTP 400 or 413)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.settings import setting


@dataclass(slots=True)
class RequestLimits:
    """Sizes a caller controls, checked before any work is done for them."""

    max_prompt_bytes: int = setting(1 << 20, "largest text prompt (or chat messages, every string counted) in "
                                             "UTF-8 bytes, checked before tokenizing")
    max_request_id_chars: int = setting(256, "longest request_id")
    max_stop_token_ids: int = setting(256, "most stop_token_ids in one request")
    max_stop_bytes: int = setting(256, "longest stop string in UTF-8 bytes (at most 4 of them, as OpenAI)")
    max_http_body_bytes: int = setting(8 << 20, "largest HTTP request body, refused (413) while it is read, "
                                                "before parsing")
    http_body_timeout_s: float = setting(30.0, "an HTTP request body must arrive within this long (408 otherwise)")
    max_choices: int = setting(64, "most choices (prompts x n) in one HTTP request, checked before any prompt is "
                                   "tokenized")
    max_chat_messages: int = setting(2048, "most messages in one chat request (OpenAI's limit)")
    max_pending_requests: int = setting(1024, "most requests being received, parsed and tokenized at once, over "
                                              "gRPC and HTTP together (before the admission queue, which "
                                              "--max-queued-requests caps); one more is refused (429 / "
                                              "RESOURCE_EXHAUSTED)")

    def __post_init__(self) -> None:
        small = [name for name in self.__dataclass_fields__ if name.startswith("max_") and getattr(self, name) < 1]
        if small:
            raise ValueError(f"{small[0]} must be >= 1, got {getattr(self, small[0])}")
        if not self.http_body_timeout_s > 0:
            raise ValueError(f"http_body_timeout_s must be > 0, got {self.http_body_timeout_s}")


class InvalidRequest(ValueError):
    """A request refused before any work for it: ``message`` names the field and the limit;
    ``field`` is that field (HTTP's ``param``); ``too_large``: a size limit (HTTP 413); ``code``:
    HTTP's error code (gRPC answers INVALID_ARGUMENT with the message)."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None,
                 too_large: bool = False) -> None:
        super().__init__(message)
        self.message, self.field, self.code, self.too_large = message, field, code, too_large


def check_count(n: int, field_name: str, limit: int, setting: str, what: str = "entries") -> None:
    if n > limit:
        raise InvalidRequest(f"{field_name} has {n} {what}; the limit is {limit} ({setting})", field_name)


def utf8_size(text: str, field_name: str, limit: int, setting: str = "max_prompt_bytes") -> int:
    """UTF-8 bytes of text, refused over limit (too_large: HTTP 413) or when it is not Unicode a
    client could have sent (a lone surrogate, as JSON's "\\ud800" decodes to)."""
    if len(text) > limit:   # every character is at least one byte: no need to encode it
        raise InvalidRequest(f"{field_name} has more than {limit} bytes ({setting})", field_name,
                             "request_too_large", too_large=True)
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{field_name} is not valid Unicode: a lone surrogate at character {exc.start}",
                             field_name, "invalid_argument") from None
    if size > limit:
        raise InvalidRequest(f"{field_name} has {size} bytes; the limit is {limit} ({setting})", field_name,
                             "request_too_large", too_large=True)
    return size
