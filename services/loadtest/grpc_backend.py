"""The load generator's client for the router's gRPC API: one streamed Generate per request, timed
on this client (TTFT: first token-carrying message; one ITL gap per later token-carrying message;
e2el: the final message), with the router's own Timings and cached prompt tokens from the final
message. A request of a session (SampleRequest.session_id) carries it in GenerateRequest.session_id."""
from __future__ import annotations

import time

from pdserve.services.client import AsyncClient
from pdserve.services.loadtest.datasets import SampleRequest
from pdserve.services.loadtest.metrics import SERVER_TIMINGS
from pdserve.services.loadtest.results import RequestResult, Sampling, settle


async def send_request(client, req: SampleRequest, request_id: str, sampling: Sampling, bench_start: float
                       ) -> RequestResult:
    import grpc

    res = RequestResult(prompt_len=max(req.prompt_len, 0), kind=req.kind)
    st = time.perf_counter()
    res.start_time = st - bench_start
    last_token = st
    finished = False
    try:
        async for msg in client.generate_stream(req.prompt, request_id=request_id, priority=req.priority,
                                                user=req.user, session_id=req.session_id,
                                                max_tokens=req.expected_output_len, **sampling.kwargs()):
            now = time.perf_counter()
            if finished:     # nothing follows the final message; ignore anything that would
                continue
            if msg.token_ids:
                if res.output_len == 0:
                    res.ttft = now - st
                else:
                    res.itl.append(now - last_token)
                last_token = now
                res.output_len += len(msg.token_ids)
                res.token_ids.extend(msg.token_ids)
            if msg.finished:
                finished = True
                res.latency = now - st
                res.finish_reason = msg.finish_reason
                t = msg.timings
                res.server_timings = {k: getattr(t, k) for k in SERVER_TIMINGS}
                res.prefill_route, res.decode_cached_tokens, res.kv_bytes = (t.prefill_route, t.decode_cached_tokens,
                                                                             t.kv_bytes)
                res.kv_wire_bytes = t.kv_wire_bytes
                res.cached_tokens = msg.usage.cached_tokens if msg.HasField("usage") else None
                if req.prompt_len < 0:
                    res.prompt_len = msg.usage.prompt_tokens
    except grpc.aio.AioRpcError as exc:
        res.error = f"{exc.code().name}: {exc.details()}"
        res.error_s = time.perf_counter() - st
        hint = next((v for k, v in exc.trailing_metadata() or () if k == "retry-after-ms"), None)
        res.retry_after_s = int(hint) / 1e3 if hint is not None and str(hint).isdigit() else None
        return res
    except Exception as exc:  # noqa: BLE001 - a benchmark records, it does not crash
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    return settle(res, finished, "stream ended without a finished message")


class GrpcBackend:
    """The router's gRPC API, as the OpenAI backend's interface: send(req, id, sampling, start)."""

    def __init__(self, address: str, timeout: float | None) -> None:
        self.client = AsyncClient(address, timeout=timeout)

    async def send(self, req: SampleRequest, request_id: str, sampling: Sampling, bench_start: float):
        return await send_request(self.client, req, request_id, sampling, bench_start)

    async def __aenter__(self) -> "GrpcBackend":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()

