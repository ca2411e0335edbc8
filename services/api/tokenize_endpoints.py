"""vLLM's ``/tokenize`` and ``/detokenize`` on the OpenAI HTTP API (``vllm bench serve`` calls them
to check its tokenizer against the server's).

They go through what the generation endpoints go through: the guard on the request's head
(API key, Host, Content-Type: http_connections.RequestGuard), the body's cap and deadline, the
model names, the gate on requests being received, and the request front (its prompt limits, its
tokenizer thread, its chat template), so that the tokens of a prompt here are the tokens a
completion (or, with messages, a chat completion) of it is given. Fields, as vLLM's:

* ``POST /tokenize`` ``{"model"?, "prompt": str, "add_special_tokens"?: true, "return_token_strs"?}``
  or ``{"model"?, "messages": [...], "add_generation_prompt"?: true, "continue_final_message"?:
  false, "add_special_tokens"?: false, "return_token_strs"?, "chat_template_kwargs"?, "tools"?}``
  answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` null unless asked).
* ``POST /detokenize`` ``{"model"?, "tokens": [int]}`` answers ``{"prompt": text}`` (special
  tokens included); at most max_model_len ids, each in the vocabulary.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.services.api.openai_protocol import (ClientGone, HTTPError, http_error, int_list, parse_body, read_json,
    typed_field, until_disconnect)
from pdserve.services.api.request_front import TokenizeRequest
from pdserve.services.api.request_limits import InvalidRequest, RequestLimits
from pdserve.services.api.router_facade import RouterFacade
from pdserve.services.router.errors import RouterError

log = logging.getLogger(__name__)

# The fields parse_body checks for each kind of /tokenize body, as it checks them for generation.
PROMPT_FIELDS = ("model", "prompt")
CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "chat_template_kwargs", "tools")


def parse_tokenize(body: dict, default_model: str, limits: RequestLimits) -> tuple[str, TokenizeRequest]:
    """(model, request) from a /tokenize body: a prompt, or messages; raises HTTPError naming the field."""
    chat = body.get("messages") is not None
    if chat and body.get("prompt") is not None:
        raise HTTPError(400, "give either prompt or messages, not both", "prompt")
    if not chat and body.get("prompt") is not None and not isinstance(body["prompt"], str):
        raise HTTPError(400, "prompt must be a string", "prompt")
    parsed = parse_body({k: body[k] for k in (CHAT_FIELDS if chat else PROMPT_FIELDS) if k in body}, chat,
                        default_model, limits)
    strs = typed_field(body, "return_token_strs", bool, False)
    if not chat:
        return parsed.model, TokenizeRequest(prompt=parsed.prompts[0].text, return_token_strs=strs,
                                             add_special_tokens=typed_field(body, "add_special_tokens", bool, True))
    continue_final = typed_field(body, "continue_final_message", bool, False)
    generation_prompt = typed_field(body, "add_generation_prompt", bool, not continue_final)
    if continue_final and generation_prompt:
        raise HTTPError(400, "continue_final_message and add_generation_prompt cannot both be true",
                        "continue_final_message")
    return parsed.model, TokenizeRequest(messages=parsed.messages, add_generation_prompt=generation_prompt,
                                         continue_final_message=continue_final, tools=parsed.tools,
                                         template_kwargs=parsed.template_kwargs, return_token_strs=strs,
                                         add_special_tokens=typed_field(body, "add_special_tokens", bool, False))


def parse_detokenize(body: dict, default_model: str, max_tokens: int) -> tuple[str, list[int]]:
    """(model, token ids) from a /detokenize body; at most max_tokens ids (max_model_len), counted
    before they are looked at."""
    model = typed_field(body, "model", str, default_model)
    if body.get("tokens") is None:
        raise HTTPError(400, "tokens is required", "tokens")
    return model, int_list(body["tokens"], "tokens", max_tokens)


class TokenizeEndpoints:
    """The two handlers. check_model: the generation endpoints' check (404 for an unknown name)."""

    def __init__(self, router: RouterFacade, served_model_name: str, check_model: Callable[[str], None],
                 max_body_bytes: int) -> None:
        self.router = router
        self.served_model_name = served_model_name
        self.check_model = check_model
        self.max_body_bytes = max_body_bytes

    def add_routes(self, app: FastAPI) -> None:
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])

    async def tokenize(self, request: Request) -> Response:
        async def answer(body: dict) -> dict[str, Any]:
            model, tokenize = parse_tokenize(body, self.served_model_name, self.router.limits)
            self.check_model(model)
            ids, strs = await self.router.tokenize(tokenize)
            return {"count": len(ids), "max_model_len": self.router.max_model_len, "tokens": ids, "token_strs": strs}
        return await self._answer(request, answer)

    async def detokenize(self, request: Request) -> Response:
        async def answer(body: dict) -> dict[str, Any]:
            model, ids = parse_detokenize(body, self.served_model_name, self.router.max_model_len)
            self.check_model(model)
            return {"prompt": await self.router.detokenize(ids)}
        return await self._answer(request, answer)

    async def _answer(self, request: Request, answer: Callable[[dict], Awaitable[dict[str, Any]]]) -> Response:
        """The body read (capped, within its deadline) and answered while holding a place among the
        requests being received; refusals in OpenAI's error shape."""
        request_id = "tokenize-" + uuid.uuid4().hex
        try:
            limits = self.router.limits
            with self.router.receiving():
                body = await read_json(request, self.max_body_bytes, limits.http_body_timeout_s)
                return JSONResponse(await until_disconnect(request, answer(body)))
        except (RouterError, HTTPError, InvalidRequest) as exc:
            return http_error(exc, request_id).response()
        except ClientGone:
            return Response(status_code=499)
        except Exception:  # noqa: BLE001 - a bug: the client gets no internal text, the log gets it all
            log.exception("request %s failed", request_id)
            return HTTPError(500, f"internal error (request id {request_id})", code="internal_error").response()
