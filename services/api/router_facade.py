"""What the OpenAI HTTP server asks of the router, and nothing more.

The HTTP API (http_server.py) is a second front door beside the gRPC API: it shares the
router's request front, its gate on requests being received, its generation core and its
metrics, and reaches them only through ``RouterFacade``. ``RouterServicerFacade``
(grpc_router.py) implements it over the gRPC router's servicer; a test may hand the HTTP
server any object with these members."""
from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, ContextManager, Protocol, Sequence

from pdserve.engine import SamplingParams
from pdserve.services.api.request_front import FrontRequest, TokenizeRequest, ValidatedRequest
from pdserve.services.api.request_limits import RequestLimits
from pdserve.services.router.generation_state import Chunk, Generation
from pdserve.services.router.slo import ServiceClass

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from transformers import PreTrainedTokenizerBase


class RouterFacade(Protocol):
    @property
    def serving(self) -> bool:
        """Every role the router needs has a healthy worker, and it is not draining (/health)."""

    @property
    def draining(self) -> bool:
        """The router is shutting down: new requests are refused."""

    @property
    def max_model_len(self) -> int:
        """The longest sequence every worker takes."""

    @property
    def limits(self) -> RequestLimits:
        """Caps on what a request may ask (body size and time, prompt size, ...)."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The served model's tokenizer (detokenizing, logprob token texts)."""

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """The router's Prometheus registry (/metrics)."""

    def receiving(self) -> ContextManager[None]:
        """Hold one of the places for requests being received and tokenized, over both doors;
        raises RouterError (RESOURCE_EXHAUSTED) when none is left."""

    async def prepare(self, request: FrontRequest) -> ValidatedRequest:
        """The request front: limits, tokenizing, chat template, validation; raises InvalidRequest."""

    async def tokenize(self, request: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        """/tokenize through the request front: its limits, its chat template; raises InvalidRequest."""

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """/detokenize through the request front: its length and vocabulary checks; raises InvalidRequest."""

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams, service: ServiceClass
                 ) -> AsyncIterator[tuple[Chunk, Generation]]:
        """Run one request through admission, placement and migration; leaving early aborts it."""

    def observe_tokens(self, gen: Generation, n: int, now: float) -> None:
        """n tokens of gen reached the client at now (time.perf_counter): TTFT, ITL, token counts."""

    def observe_finish(self, gen: Generation, prompt_tokens: int, completion_tokens: int, now: float) -> None:
        """gen finished at now: success, prompt tokens, latency, TPOT, KV transfer time."""

    def request_started(self) -> None:
        """One more request is running."""

    def request_ended(self, finished: bool) -> None:
        """A running request ended; finished: with a finish reason (else it counts as a failure)."""

    def request_refused(self) -> None:
        """A request failed before it ran (refused, invalid, no worker)."""
