"""WorkerInfoServicer.SetRole in process (the refusals a real worker rarely shows): an RPC in
flight or a draining worker refuses; a switch relabels the worker's metrics and wakes status
watchers; a role's gate refuses the other role's calls UNAVAILABLE."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.engine import EngineConfig
from pdserve.v1 import worker_pb2
from pdserve.services.workers.worker_metrics import WorkerMetrics
from pdserve.services.workers.async_engine import AsyncEngine
from pdserve.services.workers.lifecycle import WorkerState
from pdserve.services.workers.roles import RoleGate, RoleSides
from pdserve.services.workers.options import WorkerOptions
from pdserve.services.workers.worker_process import WorkerInfoServicer

KW = dict(dtype="float32", block_size=8, num_kv_blocks=16, max_model_len=128)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Context:
    """What the servicers use of grpc.aio.ServicerContext: abort raises."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def run(model: str, body) -> None:
    async def main() -> None:
        config = EngineConfig(model=model, role="prefill", **KW)
        metrics = WorkerMetrics("prefill", "w", model_name="m")
        aengine = AsyncEngine(config, on_step=metrics.on_step)
        metrics.attach(aengine.engine)
        aengine.start()
        state = WorkerState("prefill")
        sides = RoleSides(aengine, state, metrics, WorkerOptions())
        info = WorkerInfoServicer(aengine, "w", state, sides=sides, metrics=metrics)
        try:
            await body(info, sides, metrics)
        finally:
            await sides.close()
            aengine.stop()
    asyncio.run(main())


async def set_role(info: WorkerInfoServicer, role: int) -> worker_pb2.WorkerStatus:
    return await info.SetRole(worker_pb2.SetRoleRequest(role=role), Context())


def test_an_rpc_in_flight_or_a_drain_refuses_and_a_switch_relabels(tiny_qwen3: str) -> None:
    async def body(info: WorkerInfoServicer, sides: RoleSides, metrics: WorkerMetrics) -> None:
        with info.state.track():   # say, a Decode stream between admission and its first token
            with pytest.raises(Aborted) as err:
                await set_role(info, worker_pb2.WORKER_ROLE_DECODE)
        assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION and "1 RPC(s) in flight" in err.value.details
        info.state.draining = True
        with pytest.raises(Aborted) as err:
            await set_role(info, worker_pb2.WORKER_ROLE_DECODE)
        assert err.value.code is grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details
        info.state.draining = False
        assert info.role == "prefill" and sides.listener is None

        woken = asyncio.ensure_future(info.aengine.wait_status_change(5.0))
        await asyncio.sleep(0)   # one turn of the loop, no clock: the watcher is registered by its first step
        status = await set_role(info, worker_pb2.WORKER_ROLE_DECODE)
        await asyncio.wait_for(woken, 1.0)   # status watchers were told
        assert status.role == worker_pb2.WORKER_ROLE_DECODE and info.aengine.config.role == "decode"
        assert sides.listener is not None and metrics.labels["role"] == "decode"
        assert metrics.registry.get_sample_value("pdserve:num_requests_running", metrics.labels) == 0

        gate = RoleGate(worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"], "prefill", info.state, sides)
        with pytest.raises(Aborted) as err:
            async for _ in gate.Prefill(worker_pb2.PrefillRequest(request_id="x"), Context()):
                pass
        assert err.value.code is grpc.StatusCode.UNAVAILABLE and "decode worker now" in err.value.details
    run(tiny_qwen3, body)
