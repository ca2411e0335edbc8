"""The request front both doors share (the gRPC Router and the OpenAI HTTP API): a request in
protocol-free terms (a text or token-id prompt, or chat messages; sampling parameters) becomes a
validated, tokenized request for the Generator (services/router/generator.py).

Each door maps its own wire format to a FrontRequest (services/api/grpc_router.py from the proto,
services/api/openai_protocol.py from the JSON body, each after the counts and sizes it can check on
the wire) and maps the InvalidRequest raised here back (gRPC INVALID_ARGUMENT, HTTP 400/413 in
OpenAI's error shape). Order: the prompt's size, then tokenizing or chat rendering (on one
thread, off the event loop), then its length against max_model_len, then the engine's own rules
(engine.validation.validate_request). Every refusal names the field and the limit. The same
checks and the same thread serve vLLM's /tokenize and /detokenize (TokenizeRequest, tokenize,
detokenize): a prompt is tokenized there exactly as a generation request's would be."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import jinja2

from pdserve.engine import SamplingParams
from pdserve.engine.quoting import quoted
from pdserve.engine.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, StructuredOutputsParams
from pdserve.engine.structured.constraints import COMPILE_TIMEOUT_S, StructuredError, check_structured
from pdserve.engine.validation import validate_request
from pdserve.services.api.reasoning import reasoning_parser_for, start_for_prompt
from pdserve.services.api.request_limits import InvalidRequest, RequestLimits, check_count, utf8_size
from pdserve.services.api.tool_calls import Tool
from pdserve.services.api.tool_messages import messages_for_template, template_supports_tools
from pdserve.services.router.slo import ServiceClass

log = logging.getLogger(__name__)

MAX_BAD_WORD_BYTES = 256
MAX_BAD_WORD_STRINGS = MAX_BAD_WORDS // 2   # each becomes two token sequences (with and without a space)

# Fields the engine's validation messages start with (its first word names the field).
KNOWN_FIELDS = frozenset({"temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids", "min_tokens",
                          "prompt", "output", "request_id", "ignore_eos", "logprobs", "cache_salt",
                          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
                          "bad_words", "priority", "prompt_logprobs"})


def field_of_message(message: str) -> str | None:
    """The field a validation message is about (the engine's messages start with it)."""
    word = message.split(" ", 1)[0].strip(":(")
    if word in KNOWN_FIELDS:
        return word
    if message.startswith("prompt tokens") or message.startswith("prompt has"):
        return "prompt"
    if word.startswith("structured_outputs"):
        return "structured_outputs"
    return None


@dataclass(slots=True)
class Prompt:
    """One prompt: token ids, or text still to tokenize."""

    text: str | None = None
    token_ids: Sequence[int] | None = None


@dataclass(slots=True)
class FrontRequest:
    """One request as either door received it. prompt, or messages (chat: rendered by the
    model's chat template); max_tokens_given False on a chat request: it may generate to the end
    of the context."""

    request_id: str
    params: SamplingParams
    prompt: Prompt | None = None
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    max_tokens_given: bool = True
    skip_special_tokens: bool = True
    service: ServiceClass = dataclasses.field(default_factory=ServiceClass)
    bad_words: list[str] = dataclasses.field(default_factory=list)   # tokenized into params.bad_words_token_ids
    structured_field: str | None = None   # the field params.structured_outputs came from (an error's param)
    tools: list[Tool] = dataclasses.field(default_factory=list)      # chat: rendered by the template
    template_kwargs: dict = dataclasses.field(default_factory=dict)  # chat: chat_template_kwargs


@dataclass(slots=True)
class ValidatedRequest:
    """Ready for Generator.generate(request_id, prompt, params, service=service)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    skip_special_tokens: bool = True
    service: ServiceClass = dataclasses.field(default_factory=ServiceClass)
    reasoning_start: str | None = None   # chat with a thinking template: how the output starts (reasoning.py)


@dataclass(slots=True)
class TokenizeRequest:
    """vLLM's /tokenize: a text prompt, or chat messages rendered by the chat template (what a chat
    request's prompt would be). return_token_strs: the tokens' strings too."""

    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] = dataclasses.field(default_factory=list)
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    return_token_strs: bool = False


class RequestFront:
    """Checks, tokenizes and validates requests for one model. max_model_len: called per request
    (the workers report theirs); model_name: what a missing chat template's message calls it."""

    def __init__(self, tokenizer, vocab_size: int, limits: RequestLimits, max_model_len: Callable[[], int],
                 model_name: str = "this model") -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits
        self.max_model_len = max_model_len
        self.model_name = model_name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._structured = ThreadPoolExecutor(max_workers=1, thread_name_prefix="structured")

    def check_request_id(self, request_id: str) -> None:
        check_count(len(request_id), "request_id", self.limits.max_request_id_chars, "max_request_id_chars",
                    "characters")

    def check_stop_token_ids(self, n: int) -> None:
        check_count(n, "stop_token_ids", self.limits.max_stop_token_ids, "max_stop_token_ids")

    async def prepare(self, request: FrontRequest) -> ValidatedRequest:
        """The request tokenized and validated; raises InvalidRequest naming the field."""
        chat = request.messages is not None
        reasoning_start = None
        if chat:
            ids, text = await self.render_chat(request.messages, request.add_generation_prompt, request.tools,
                                               request.template_kwargs)
            if reasoning_parser_for(self.chat_template) is not None:
                reasoning_start = start_for_prompt(text, request.template_kwargs.get("enable_thinking"))
        elif request.prompt is not None:
            ids = await self.prompt_ids(request.prompt)
        else:
            raise InvalidRequest("input: give either text or token_ids", "input")
        max_len = self.max_model_len()
        params = dataclasses.replace(request.params, stop_token_ids=list(request.params.stop_token_ids))
        if chat and not request.max_tokens_given:   # chat's default: the rest of the context
            params.max_tokens = max(1, max_len - len(ids))
        if request.bad_words:
            params.bad_words_token_ids = await self._off_loop(self.bad_word_ids, request.bad_words)
        try:
            validate_request(ids, params, self.vocab_size, max_len)
        except ValueError as exc:
            msg = str(exc)
            raise InvalidRequest(msg, field_of_message(msg) or ("messages" if chat else None)) from None
        if params.structured_outputs is not None:
            await self._check_structured(params.structured_outputs, request.structured_field or "structured_outputs")
        return ValidatedRequest(request.request_id, ids, params, request.skip_special_tokens, request.service,
                                reasoning_start)

    def bad_word_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each word's tokens alone and after a space (as vLLM: a word mid-text is usually the
        latter), distinct, at most MAX_BAD_WORD_TOKENS each."""
        check_count(len(words), "bad_words", MAX_BAD_WORD_STRINGS, "MAX_BAD_WORDS / 2", "words")
        for word in words:
            if not word.strip():
                raise InvalidRequest("bad_words must not hold blank words", "bad_words")
            utf8_size(word, "bad_words", MAX_BAD_WORD_BYTES, "a word's limit")
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise InvalidRequest(f"bad_words has a word of {len(ids)} tokens; the limit is "
                                         f"{MAX_BAD_WORD_TOKENS}", "bad_words")
                if ids and ids not in out:
                    out.append(ids)
        return out

    async def tokenize(self, request: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        """The prompt's token ids (and their strings if asked), within the prompt limits."""
        if request.messages is not None:
            ids, _ = await self.render_chat(request.messages, request.add_generation_prompt, request.tools,
                                            request.template_kwargs, request.continue_final_message,
                                            request.add_special_tokens)
        elif request.prompt is not None:
            ids = await self.encode(request.prompt, "prompt", request.add_special_tokens)
        else:
            raise InvalidRequest("prompt: give either prompt or messages", "prompt")
        strs = await self._off_loop(self.tokenizer.convert_ids_to_tokens, ids) if request.return_token_strs else None
        return ids, strs

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (special tokens included), at most max_model_len of them, each in
        the vocabulary."""
        self._check_length(len(token_ids), "tokens")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"tokens has id {quoted(bad)}, outside the vocabulary of {self.vocab_size} tokens "
                                 f"(ids 0 to {self.vocab_size - 1})", "tokens")
        return await self._off_loop(self.tokenizer.decode, list(token_ids), skip_special_tokens=False)

    async def _check_structured(self, spec: StructuredOutputsParams, field: str) -> None:
        """The constraint parses (no vocabulary needed), on the structured-check thread, within
        COMPILE_TIMEOUT_S: a runaway check holds back only constrained requests."""
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(self._structured, check_structured, spec), COMPILE_TIMEOUT_S)
        except StructuredError as exc:
            raise InvalidRequest(str(exc), field) from None
        except asyncio.TimeoutError:
            raise InvalidRequest(f"{field} did not compile within {COMPILE_TIMEOUT_S:g} s", field) from None

    async def prompt_ids(self, prompt: Prompt) -> list[int]:
        if prompt.token_ids is not None:
            self._check_length(len(prompt.token_ids), "prompt")   # measured before it is copied
            return list(prompt.token_ids)
        return await self.encode(prompt.text, "prompt", add_special_tokens=True)

    async def encode(self, text: str, what: str, add_special_tokens: bool) -> list[int]:
        """Tokenize off the event loop, after checking the size limit."""
        utf8_size(text, what, self.limits.max_prompt_bytes)
        ids = await self._off_loop(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        self._check_length(len(ids), what)
        return ids

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: Sequence[Tool] = (),
                          template_kwargs: dict | None = None, continue_final_message: bool = False,
                          add_special_tokens: bool = False) -> tuple[list[int], str]:
        """The messages (and tools) through the model's chat template, then tokenized (the
        template adds the special tokens; add_special_tokens: the tokenizer's too): (token ids,
        the rendered text). continue_final_message: the last message left open (/tokenize only).
        The caller has counted every string of the messages, the tools and the template's kwargs."""
        template = self.chat_template
        if not template:
            raise InvalidRequest(f"model {self.model_name} has no chat template (tokenizer_config.json "
                                 f"chat_template or chat_template.jinja); use /v1/completions", "messages",
                                 "no_chat_template")
        messages, tools_kwarg = messages_for_template(messages, list(tools), template_supports_tools(template))
        kwargs = dict(template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            text = await self._off_loop(self.tokenizer.apply_chat_template, messages, tools=tools_kwarg,
                                        tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        except jinja2.TemplateError as exc:   # the template's own message (raise_exception: roles must alternate)
            raise InvalidRequest(f"chat template failed: {exc}", "messages") from None
        except Exception:  # noqa: BLE001 - the request's, but its text is internal
            log.warning("chat template failed", exc_info=True)
            raise InvalidRequest("chat template failed on these messages", "messages") from None
        return await self.encode(text, "messages", add_special_tokens=add_special_tokens), text

    def _check_length(self, n: int, what: str) -> None:
        max_len = self.max_model_len()
        if n > max_len:
            raise InvalidRequest(f"{what} has {n} tokens; max_model_len is {max_len}", what)

    async def _off_loop(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
