"""`pdserve chat`: an interactive chat in the terminal, as `ollama run` gives.

The conversation is kept as chat messages; each turn renders it through the model's chat template
(the tokenizer's ``apply_chat_template``, as the HTTP API's /v1/chat/completions does) and streams
the reply to stdout as its tokens come. With ``--router HOST:PORT`` the turns go to a running
router over gRPC, all with the conversation's ``session_id``, so each turn goes back to the decode
worker that holds the KV of the earlier ones (services/router/routes.py, SessionTable); without it
the engine runs in this process and its prefix cache reuses the earlier turns' KV.

On a terminal it shows a ``>>> `` prompt; otherwise each line of stdin is a user turn and stdout
holds only the replies, one newline after each (``printf 'Hi\\n/exit\\n' | pdserve chat``).
Importing this module imports neither torch, transformers nor grpc: the handler does."""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import sys
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator, TextIO

from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.services.cli.parser import add_engine_args, model_dir
from pdserve.services.cli.usage_errors import RuntimeFailure, UsageError
from pdserve.services.common.config_flags import given
from pdserve.services.common.topology import ENGINE_FIXED
from pdserve.services.deployment.progress import Progress

DEFAULT_MAX_TOKENS = 512
DEFAULT_TEMPERATURE = 0.8     # ollama's default; 0: greedy
CONNECT_TIMEOUT_S = 2.0       # an unreachable router fails this soon (as `generate --router`)
PROMPT = ">>> "
MULTILINE = '"""'             # a turn of several lines: between two of these (as ollama)
# gRPC codes that fail one turn (the conversation goes on); any other ends the chat.
TURN_CODES = ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "OUT_OF_RANGE", "DEADLINE_EXCEEDED")
HELP = f"""Available commands:
  /clear    start a new conversation (the --system message stays)
  /exit     end the chat (also /bye, or Ctrl-D)
  /help     this help (also /?)
A turn of several lines: begin it with {MULTILINE} and end it with {MULTILINE}."""


class TurnFailed(Exception):
    """One turn could not be answered; the conversation goes on without it."""


@dataclass
class Conversation:
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []


def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The conversation through the model's chat template, then tokenized (the template adds the
    special tokens), as the HTTP API renders /v1/chat/completions."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - the template's own message (jinja2: roles must alternate, ...)
        raise TurnFailed(f"the chat template failed on this conversation: {exc}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def require_chat_template(tokenizer, model: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"chat needs an instruct model with a chat template, and {model} has none (tokenizer_config"
                         f".json chat_template or chat_template.jinja); `pdserve generate` completes plain prompts")


class LocalBackend:
    """The engine in this process: one request per turn, stepped here and detokenized as it comes."""

    def __init__(self, llm, sampling: dict) -> None:
        self.llm, self.engine, self.sampling = llm, llm.engine, sampling
        self.max_model_len = llm.engine.max_model_len
        self.usage: dict[str, float] = {}
        self._ids = itertools.count()

    def new_session(self) -> None:
        """Nothing to forget: the prefix cache matches whatever the next prompt shares."""

    def turn(self, ids: list[int], max_tokens: int) -> Iterator[str]:
        from pdserve.services.api.detokenizer import IncrementalDetokenizer   # lazy: transformers only when this runs
        rid = f"chat-{next(self._ids)}"
        try:
            self.engine.add_request(rid, ids, SamplingParams(**self.sampling, max_tokens=max_tokens))
        except ValueError as exc:
            raise TurnFailed(str(exc)) from None
        detok = IncrementalDetokenizer(self.llm.tokenizer)
        done, completion = False, 0
        try:
            while not done and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    completion += len(out.new_token_ids)
                    text = detok.add(out.new_token_ids, final=out.finished)
                    if out.finished:
                        done = True
                        self.usage = {"finish_reason": out.finish_reason, "prompt_tokens": len(ids),
                                      "cached_tokens": out.num_cached_tokens, "completion_tokens": completion}
                    if text:
                        yield text
        finally:
            if not done:   # interrupted (Ctrl-C): its blocks go back
                self.engine.abort(rid)


class RouterBackend:
    """A running router over gRPC: every turn of a conversation carries its session_id."""

    def __init__(self, client, sampling: dict, max_model_len: int, router_error: Callable[[str, object], str]) -> None:
        self.client, self.sampling, self.max_model_len = client, sampling, max_model_len
        self.router_error = router_error
        self.usage: dict[str, float] = {}
        self.new_session()

    def new_session(self) -> None:
        self.session_id = uuid.uuid4().hex

    def turn(self, ids: list[int], max_tokens: int) -> Iterator[str]:
        import grpc   # lazy: grpc only when this runs
        rid, done = uuid.uuid4().hex, False
        try:
            for msg in self.client.generate_stream(ids, request_id=rid, max_tokens=max_tokens,
                                                   session_id=self.session_id, **self.sampling):
                if msg.finished:
                    done = True
                    self.usage = {"finish_reason": msg.finish_reason, "prompt_tokens": msg.usage.prompt_tokens,
                                  "cached_tokens": msg.usage.cached_tokens,
                                  "completion_tokens": msg.usage.completion_tokens,
                                  "ttft_ms": round(msg.timings.ttft_ms, 1)}
                if msg.text:
                    yield msg.text
            done = True
        except grpc.RpcError as exc:
            done = True
            line = self.router_error(self.client.address, exc)
            if exc.code().name in TURN_CODES:
                raise TurnFailed(line) from None
            raise RuntimeFailure(line) from None
        finally:
            if not done:   # interrupted (Ctrl-C): the router stops generating it
                with contextlib.suppress(grpc.RpcError):
                    self.client.abort(rid)


def _turns(stdin: TextIO, interactive: bool, say: Callable[[str], None]) -> Iterator[str]:
    """The user's input, a turn (or a command) at a time; a turn of several lines between two
    triple quotes is one. Ends at EOF (Ctrl-D)."""
    def read(prompt: str) -> str | None:
        if interactive:
            try:
                return input(prompt)
            except EOFError:
                print(file=sys.stdout)
                return None
        line = stdin.readline()
        return line.rstrip("\n") if line else None

    while True:
        try:
            line = read(PROMPT)
            if line is None:
                return
            if line.lstrip().startswith(MULTILINE):
                parts = [line.lstrip()[len(MULTILINE):]]
                while not parts[-1].rstrip().endswith(MULTILINE):
                    more = read("... ")
                    if more is None:
                        break
                    parts.append(more)
                else:
                    parts[-1] = parts[-1].rstrip()[:-len(MULTILINE)]
                line = "\n".join(parts)
        except KeyboardInterrupt:   # at the prompt: what was typed is dropped, as a shell does
            if not interactive:
                raise
            print(file=sys.stdout)
            say("(/exit or Ctrl-D ends the chat)")
            continue
        yield line.strip()


def run_chat(backend, tokenizer, conversation: Conversation, max_tokens: int, stdin: TextIO, stdout: TextIO,
             interactive: bool, verbose: bool = False) -> int:
    """The chat loop. Exit code: 0, or 1 where a turn failed and stdin is not a terminal (a script
    sees it)."""
    def say(text: str) -> None:   # not a reply: on stdout only on a terminal (piped stdout holds replies only)
        print(text, file=stdout if interactive else sys.stderr, flush=True)

    if interactive:
        say("Send a message (/help for help, /exit or Ctrl-D to quit)")
    failed = False
    for text in _turns(stdin, interactive, say):
        if not text:
            continue
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/exit", "/bye"):
                break
            if command == "/clear":
                conversation.clear()
                backend.new_session()
                say("Cleared the conversation.")
            elif command in ("/help", "/?"):
                say(HELP)
            else:
                say(f"Unknown command {command!r}: /help lists them.")
            continue
        conversation.messages.append({"role": "user", "content": text})
        reply: list[str] = []
        try:
            ids = render(tokenizer, conversation.messages)
            room = backend.max_model_len - len(ids)
            if room < 1:
                raise TurnFailed(f"the conversation has {len(ids)} tokens, the model's max_model_len is "
                                 f"{backend.max_model_len}: /clear starts a new one")
            with contextlib.closing(backend.turn(ids, min(max_tokens, room))) as stream:
                for delta in stream:
                    stdout.write(delta)
                    stdout.flush()
                    reply.append(delta)
        except TurnFailed as exc:
            conversation.messages.pop()
            if reply:
                stdout.write("\n")
                stdout.flush()
            print(f"pdserve: error: {exc}", file=sys.stderr, flush=True)
            failed = True
            continue
        except KeyboardInterrupt:   # Ctrl-C during a reply: it stops, and is not kept
            if not interactive:
                raise
            conversation.messages.pop()
            stdout.write("\n")
            say("(reply interrupted)")
            continue
        stdout.write("\n\n" if interactive else "\n")
        stdout.flush()
        conversation.messages.append({"role": "assistant", "content": "".join(reply)})
        if verbose and backend.usage:
            print("[" + " ".join(f"{k}={v}" for k, v in backend.usage.items()) + "]", file=sys.stderr, flush=True)
    return 1 if failed and not interactive else 0


def cmd_chat(args: argparse.Namespace, router_error: Callable[[str, object], str]) -> int:
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k),
                                  ("seed", args.sampling_seed)) if v is not None}
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    interactive = sys.stdin.isatty()
    conversation = Conversation(args.system)
    if args.router:
        from pdserve.services.client import Client   # lazy: grpc only when this runs
        import grpc   # lazy: grpc only when this runs

        with Client(args.router, api_key=args.api_key, connect_timeout=CONNECT_TIMEOUT_S) as client:
            try:
                info = client.model_info()
            except grpc.RpcError as exc:
                raise RuntimeFailure(router_error(args.router, exc)) from None
            model = _router_model(args, info.model_name)
            tokenizer = load_tokenizer(model)
            require_chat_template(tokenizer, model)
            backend = RouterBackend(client, sampling, info.max_model_len, router_error)
            return run_chat(backend, tokenizer, conversation, args.max_tokens, sys.stdin, sys.stdout, interactive,
                            args.verbose)
    from pdserve.engine import LLM   # lazy: the engine (torch) only for an offline chat
    model = model_dir(args)
    tokenizer = load_tokenizer(model)
    require_chat_template(tokenizer, model)   # before the weights load
    with Progress().step(f"loading {model}"):
        llm = LLM(model, **given(args, EngineConfig, ENGINE_FIXED))
    with llm:
        return run_chat(LocalBackend(llm, sampling), llm.tokenizer, conversation, args.max_tokens, sys.stdin,
                        sys.stdout, interactive, args.verbose)


def _router_model(args: argparse.Namespace, served: str) -> str:
    """The checkpoint whose tokenizer renders the chat: --model, else the router's own model
    directory when it is one on this machine."""
    if args.model:
        return model_dir(args)
    if served and os.path.isdir(served):
        return served
    raise UsageError(f"the router serves {served or 'a model'}, which is no directory here: pass --model DIR, its "
                     f"checkpoint (chat renders the conversation with the model's chat template)")


def add_chat_args(p: argparse.ArgumentParser, router_error: Callable[[str, object], str]) -> None:
    """`pdserve chat`'s flags. router_error: one line for a failed call to the router (commands.py's)."""
    p.add_argument("--router", default=None, metavar="HOST:PORT",
                   help="a running router's address (default: none, chat offline in this process)")
    p.add_argument("--api-key", default=None,
                   help="the router's API key (default: $PDSERVE_API_KEY; argv is visible to other local users)")
    p.add_argument("--system", default=None, metavar="TEXT", help="the conversation's system message")
    p.add_argument("--verbose", action="store_true",
                   help="after each reply, its token counts (cached: prompt tokens whose KV was reused) on stderr")
    add_engine_args(p, exclude=("seed",))   # --seed is each reply's, below (offline and through a router)
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="tokens of one reply at most (fewer where the context ends sooner)")
    g.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="0: greedy")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: none, i.e. 1.0)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default: none, all)")
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None, metavar="N",
                   help="sampling seed of every reply (default: none, the engine's)")
    p.set_defaults(func=functools.partial(cmd_chat, router_error=router_error))
