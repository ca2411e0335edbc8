"""A discrete-event simulation of a pdserve deployment that runs the real engine code.

Each simulated worker is a real ``LLMEngine`` (scheduler, block manager, KV connector, the
step's bookkeeping) whose runner prices a step with the step-cost model (engine/step_cost.py,
the profile's fits) instead of computing it:
``SimRunner.run`` returns the token a real forward would sample (one for every sequence whose
chunk reaches its last token, as ``ModelRunner.run``) and the step's duration. Time is
simulated; nothing sleeps. What the services add around the engine is modelled by the same
rules they follow, and the workers are placed by the router's own placement
(services/router/placement.py, ``Placement`` over a ``WorkerSet`` of the simulated workers, each
publishing a ``WorkerStatus`` read from its engine as a worker does, its learned step costs
included; the load policy, and the candidate's disaggregation mode):

* colocated: a request goes to the best of ``Placement.decode_routes`` (the fewest in-flight
  requests, then the most free blocks);
* disaggregated: requests wait in a FIFO admission queue until a decode worker, tried in the
  order of ``Placement.decode_routes`` among those whose free blocks hold the prompt
  (``Placement.fits``), takes it. Under conditional disaggregation a route the placement prices
  local (the decode worker's own prefill beats the prefill worker's queue and the transfer, by
  the costs the workers learned from their simulated steps) adds the whole request to that
  decode worker's engine, as the router's Generate on it does. A remote route reserves blocks
  for the whole sequence (``LLMEngine.reserve``, real headroom rules) unless the prefill worker
  is backlogged (``Placement.prefill_backlogged``); the prefill worker of
  ``Placement.pick_prefill`` (the fewest queued prompt tokens) computes it; after each step
  its newly finished blocks travel to the decode worker (one stream per request, a profiled
  time per block); the first token goes back at once; the decode worker admits the request
  once every block arrived (``KVConnector.mark_received``: no bytes move) and the Decode call
  came (``LLMEngine.admit``); the prefill worker's pinned blocks are released when the
  transfer ends, and the placement learns the transfer's exposed time.

Every engine's clock is the simulated one (``LLMEngine(clock=...)``): what it learns from its
steps (the costs it publishes, a decode worker's prompt chunk, the prompt order's speed) is what
a worker would learn from the same steps priced by the profile.

A worker's engine steps back to back while it has work; a request that arrives during a step
joins the next one, as on the engine thread. Workers that outnumber the cores they share
(``Candidate.shared_cores``: three workers on two cores) share them as the OS would, evenly
among those stepping at the moment: a step's priced time is its work at a whole core, and it
ends later while more workers than cores step beside it (``Simulation._reschedule``).

The CPU the services spend around the engine (the profile's ``serving`` costs: a worker's event
loop per token, per request and per KV block, the router per token on the core `pdserve up` pins
it to) runs on the same core as some worker's engine thread, so it lengthens that worker's next
step (``SimWorker.core_debt_s``). One simplification: ``LLMEngine.step`` applies a step's
results when it is scheduled (its duration is known only then), so blocks a step frees are
visible to reservations made during that step; outputs are delivered at the step's end.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, NoCapacity, RequestOutput
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import StepResult
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch, StepTrace
from pdserve.engine.step_cost import StepCostModel, StepSample, published_costs, step_features
from pdserve.services.loadtest.results import RequestResult
from pdserve.services.planner.cost_model import CostModel
from pdserve.services.router.config import DISAGGREGATION_MODES, GenerationOptions
from pdserve.services.router.placement import CostModel as RouteCosts
from pdserve.services.router.placement import Placement, Route
from pdserve.services.router.prefix_index import PrefixIndex
from pdserve.services.router.worker_pool import WorkerSet
from pdserve.v1 import worker_pb2

SIM_TOKEN = 2   # the token every simulated step samples: never EOS in pdserve's made models (ignore_eos anyway)


@dataclass(slots=True)
class Candidate:
    """One deployment to simulate: colocated_workers > 0, or prefill_workers + decode_workers."""

    colocated_workers: int = 0
    prefill_workers: int = 0
    decode_workers: int = 0
    max_num_batched_tokens: int | None = None   # None: each worker's engine default for its role
    schedule_policy: str = "auto"
    threads_per_worker: int = 1
    disaggregation: str = "always"   # the router's --disaggregation (xPyD only)
    prompt_order: str | None = None  # the workers' --prompt-order; None: the engine's default
    # The cores the workers share (several workers on one machine with fewer cores than their
    # threads: the ones stepping at once split them evenly); None: every worker has its own.
    shared_cores: int | None = None

    def __post_init__(self) -> None:
        if self.colocated_workers < 0 or self.prefill_workers < 0 or self.decode_workers < 0:
            raise ValueError("worker counts must be >= 0")
        if self.shared_cores is not None and self.shared_cores < 1:
            raise ValueError(f"shared_cores must be >= 1, got {self.shared_cores}")
        if not self.colocated_workers and (self.prefill_workers < 1 or self.decode_workers < 1):
            raise ValueError("a disaggregated candidate needs prefill_workers >= 1 and decode_workers >= 1")
        if self.disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation must be one of {DISAGGREGATION_MODES}, got {self.disaggregation!r}")

    @property
    def colocated(self) -> bool:
        return self.colocated_workers > 0

    @property
    def num_workers(self) -> int:
        return self.colocated_workers or self.prefill_workers + self.decode_workers

    @property
    def cores(self) -> int:
        return self.num_workers * self.threads_per_worker

    @property
    def name(self) -> str:
        shape = f"colocated x{self.colocated_workers}" if self.colocated else \
            f"{self.prefill_workers}P{self.decode_workers}D {self.disaggregation}"
        order = f", {self.prompt_order}" if self.prompt_order is not None else ""
        return f"{shape}, budget {self.max_num_batched_tokens or 'by role'}, {self.schedule_policy}{order}"

    def up_flags(self) -> str:
        """The `pdserve up` flags that deploy this candidate."""
        shape = (f"--colocated-workers {self.colocated_workers}" if self.colocated else
                 f"--prefill-workers {self.prefill_workers} --decode-workers {self.decode_workers} "
                 f"--disaggregation {self.disaggregation}")
        flags = f"{shape} --threads {self.threads_per_worker}"
        flags += f" --max-num-batched-tokens {self.max_num_batched_tokens}" if self.max_num_batched_tokens else ""
        flags += f" --schedule-policy {self.schedule_policy}" if self.schedule_policy != "auto" else ""
        return flags + (f" --prompt-order {self.prompt_order}" if self.prompt_order is not None else "")


@dataclass(slots=True)
class Overheads:
    """Costs outside the engine steps, in seconds. Latencies (router_s, token_s, handoff_s, the KV
    transfer) delay a request; CPU costs (the profile's ``serving``: a worker's event loop per
    token and per KV block, the router per token) take time from the core they run on, so they
    lengthen that worker's next step."""

    router_s: float = 0.002        # client -> router -> worker (tokenized ids, RPCs), once per request
    token_s: float = 0.0005        # a token's way back to the client
    handoff_s: float = 0.002       # disaggregated: first token -> the decode worker's Decode call
    kv_s_per_block: float | None = None   # None: the profile's
    serving_cpu: bool = True       # charge the profile's serving CPU costs to the workers' cores
    # The load generator's CPU per token when it runs on the deployment's machine (as in
    # bench/planner_accuracy.py, which measures it); 0: the clients run elsewhere.
    client_s_per_token: float = 0.0


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt: list[int]
    output_len: int
    send_time: float
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    # disaggregated hand-off
    decode: "SimWorker | None" = None
    prefill: "SimWorker | None" = None
    needed: frozenset[int] = frozenset()
    kv_free_at: float = 0.0
    first_token: int | None = None


class SimRunner:
    """Stands in for ModelRunner: samples where the real one would, and prices the step with the
    step-cost model (engine/step_cost.py)."""

    def __init__(self, cost: StepCostModel, num_kv_blocks: int, kv_bytes_per_block: int) -> None:
        self.cost = cost
        self.num_kv_blocks = num_kv_blocks
        self.kv_bytes_per_block = kv_bytes_per_block
        self.last: StepSample | None = None
        self.last_seconds = 0.0
        self.elapsed = 0.0   # the engine's clock: the priced time of every step run so far

    def run(self, batch: ScheduledBatch, stop_token_ids: Collection[int] = ()) -> StepResult:
        contexts = [s.num_computed_tokens for s in batch.seqs]
        self.last = step_features(contexts, batch.num_new_tokens, batch.num_decode_seqs)
        self.last_seconds = self.cost.step_seconds(self.last)
        self.elapsed += self.last_seconds
        return StepResult([SIM_TOKEN if s.num_computed_tokens + n >= s.num_tokens else None
                           for s, n in zip(batch.seqs, batch.num_new_tokens)], {})


@dataclass(slots=True)
class SimStep:
    start: float
    seconds: float
    trace: StepTrace


class SimWorker:
    """A simulated worker: its engine, and what the router's placement reads of a worker (the
    fields of a ``WorkerHandle`` that a ``WorkerSet`` member has; ``status`` as of ``publish``)."""

    healthy = True   # never draining, never lost

    def __init__(self, sim: "Simulation", name: str, config: EngineConfig, model_config: ModelConfig,
                 cost: CostModel, num_kv_blocks: int) -> None:
        self.sim = sim
        self.name = name
        self.address = name
        self.role = config.role
        self.runner = SimRunner(cost, num_kv_blocks, cost.kv_bytes_per_block)
        self.engine = LLMEngine(config, runner=self.runner, model_config=model_config,  # type: ignore[arg-type]
                                clock=lambda: self.runner.elapsed)
        self.export_s_per_block = cost.export_s_per_block if config.role == "prefill" else 0.0
        self.status: worker_pb2.WorkerStatus | None = None
        self.index = PrefixIndex()   # empty: the load policy routes without prefix keys
        self.busy = False
        self.inflight = 0            # requests placed here and not finished (the router's count)
        self.inflight_prompt_tokens = 0
        self.steps: list[SimStep] = []
        self.busy_seconds = 0.0
        # CPU seconds other threads on this worker's core owe (its event loop, a router pinned
        # beside it): they run while its next step does, so that step ends this much later;
        # what they owe is paid first out of the time the core then sits idle.
        self.core_debt_s = 0.0
        self.idle_since = 0.0
        self.step_left_s = 0.0     # the running step's work left, in seconds at a whole core
        self.step_share = 1.0      # the core share its end was scheduled at
        self.step_version = 0      # its end events carry this: one from before a reschedule is stale
        self.step_outputs: list[RequestOutput] = []

    @property
    def free_blocks(self) -> int:
        return self.engine.block_manager.num_free_blocks

    def publish(self) -> None:
        """The status a worker would send now: the part of WorkerInfoServicer.status that placement
        reads (its learned step costs price conditional disaggregation's routes), read as cheaply
        as the engine allows, since the simulation publishes before every placement."""
        engine = self.engine
        base_ms, ms_per_token, ms_per_seq = published_costs(engine.step_cost, engine.decode_step_cost)
        self.status = worker_pb2.WorkerStatus(
            num_total_blocks=engine.block_manager.num_blocks, num_free_blocks=self.free_blocks,
            num_running=len(engine.scheduler.running), num_waiting=len(engine.scheduler.waiting),
            num_queued_prompt_tokens=engine.scheduler.num_queued_prompt_tokens,
            block_size=engine.config.block_size, max_num_batched_tokens=engine.prompt_chunk_tokens(),
            step_base_ms=base_ms, step_ms_per_token=ms_per_token, decode_ms_per_seq=ms_per_seq)

    def kick(self) -> None:
        """Start a step now if idle with work (the engine thread wakes on new work)."""
        if self.busy or not self.engine.has_unfinished_requests():
            return
        self.core_debt_s = max(0.0, self.core_debt_s - (self.sim.now - self.idle_since))
        n = self.engine.num_steps
        outputs = self.engine.step()
        if self.engine.num_steps == n:
            return   # nothing schedulable (no blocks): a release or a finish kicks it again
        seconds = (self.runner.last_seconds + self.export_s_per_block * sum(len(o.ready_blocks) for o in outputs)
                   + self.core_debt_s)
        self.core_debt_s = 0.0
        self.steps.append(SimStep(self.sim.now, seconds, self.engine.trace[-1]))
        self.busy_seconds += seconds
        self.busy = True
        self.step_left_s, self.step_outputs = seconds, outputs
        self.schedule_end()

    def schedule_end(self) -> None:
        """(Re)schedule the running step's end at the rate the worker's core share now allows."""
        self.step_version += 1
        self.step_share = self.sim.core_share()
        self.sim.at(self.sim.now + self.step_left_s / self.step_share, self._end_step, self.step_version)

    def _end_step(self, version: int) -> None:
        if version != self.step_version:
            return   # rescheduled since
        outputs, self.step_outputs = self.step_outputs, []
        self.busy = False
        self.step_left_s = 0.0
        self.idle_since = self.sim.now
        for out in outputs:
            self.sim.on_output(self, out)
        self.kick()
        self.sim.on_change()


class Simulation:
    """One candidate deployment under one workload. ``run`` returns one RequestResult per request
    (the load generator's, so the metrics are computed by the same code as measurements)."""

    def __init__(self, cost: CostModel, candidate: Candidate, overheads: Overheads | None = None) -> None:
        self.cost = cost
        self.candidate = candidate
        self.overheads = overheads or Overheads()
        self.kv_s_per_block = (self.overheads.kv_s_per_block if self.overheads.kv_s_per_block is not None
                               else cost.kv_transfer_s_per_block)
        self.model_config = ModelConfig.from_dict(cost.model_config)
        self.now = 0.0
        self._events: list[tuple[float, int, Callable, tuple]] = []
        self._seq = itertools.count()
        self.requests: dict[str, SimRequest] = {}
        self.queue: list[SimRequest] = []      # disaggregated admission queue (FIFO)
        self.shared_threads = (candidate.shared_cores
                               if candidate.shared_cores is not None and candidate.cores > candidate.shared_cores
                               else None)     # None: no worker ever waits for a core
        eng = cost.engine
        num_blocks = int(eng.get("num_kv_blocks") or eng.get("resolved_num_kv_blocks") or 0)
        if num_blocks < 1:
            raise ValueError("the profile does not say how many KV blocks the engine has")
        base = {k: eng[k] for k in ("block_size", "max_num_seqs", "enable_prefix_caching", "max_model_len")
                if eng.get(k) is not None}
        base.update(num_kv_blocks=num_blocks, max_num_batched_tokens=candidate.max_num_batched_tokens,
                    device="cpu", seed=eng.get("seed", 0))
        model = str(eng.get("model", "simulated"))

        def worker(role: str, i: int) -> SimWorker:
            policy = candidate.schedule_policy if role == "both" else "auto"
            order = {} if candidate.prompt_order is None else {"prompt_order": candidate.prompt_order}
            config = EngineConfig(model=model, role=role, schedule_policy=policy, **order, **base)
            return SimWorker(self, f"{role}-{i}", config, self.model_config, cost, num_blocks)

        if candidate.colocated:
            self.colocated = [worker("both", i) for i in range(candidate.colocated_workers)]
            self.prefill, self.decode = [], []
        else:
            self.colocated = []
            self.prefill = [worker("prefill", i) for i in range(candidate.prefill_workers)]
            self.decode = [worker("decode", i) for i in range(candidate.decode_workers)]
        # The router's placement over the simulated workers: the load policy, the candidate's
        # disaggregation mode, the router's default weights.
        router = GenerationOptions()
        self.placement = Placement(WorkerSet(self.workers), routing="load", disaggregation=candidate.disaggregation,
                                   cost_model=RouteCosts(router.itl_weight, router.cache_affinity_weight))
        self.local_routes = 0   # requests prefilled on their decode worker
        sv = cost.serving
        on = self.overheads.serving_cpu
        self.worker_s_per_token = sv.worker_s_per_token if on else 0.0
        self.router_s_per_token = sv.router(candidate.colocated) if on else 0.0
        self.decode_s_per_block = sv.decode_s_per_block_received if on else 0.0
        self.decode_s_per_request = sv.decode_s_per_request if on else 0.0
        self.prefill_s_per_block = sv.prefill_s_per_block_sent if on else 0.0
        self.prefill_s_per_request = sv.prefill_s_per_request if on else 0.0
        # Where the router runs, as `pdserve up` pins it (Launcher._cores): beside the last decode
        # worker when disaggregated; on a spare core when colocated workers leave one (None: off
        # the workers' cores), else unpinned, beside whichever worker served the token.
        # A client on this machine is not pinned: the OS runs it where the router is not, a
        # prefill worker's core when disaggregated (the spare core when colocated leaves one).
        cores = int(cost.machine.get("cpu_count") or candidate.cores)
        self.router_core: SimWorker | None = None
        self.client_core: SimWorker | None = None
        self.router_spare = candidate.colocated and candidate.cores < cores
        if not candidate.colocated:
            self.router_core = self.decode[-1]
            self.client_core = self.prefill[0]

    def _charge_tokens(self, worker: SimWorker, n: int) -> None:
        """CPU time of n tokens leaving worker: its event loop, the router that streams them and a
        client on this machine that receives them."""
        worker.core_debt_s += n * self.worker_s_per_token
        if not self.router_spare:
            (self.router_core or worker).core_debt_s += n * self.router_s_per_token
            (self.client_core or worker).core_debt_s += n * self.overheads.client_s_per_token

    @property
    def workers(self) -> list[SimWorker]:
        return [*self.colocated, *self.prefill, *self.decode]

    # ---- events -----------------------------------------------------------------------
    def at(self, t: float, fn: Callable, *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def _stepping(self) -> list[SimWorker]:
        return [w for w in self.workers if w.busy]

    def core_share(self) -> float:
        """The fraction of a whole core each stepping worker's thread gets now."""
        if self.shared_threads is None:
            return 1.0
        demand = len(self._stepping()) * self.candidate.threads_per_worker
        return min(1.0, self.shared_threads / demand) if demand else 1.0

    def _advance(self, t: float) -> None:
        """Steps running until t did that much of their work at the current share."""
        if self.shared_threads is None or t <= self.now:
            return
        done = (t - self.now) * self.core_share()
        for w in self._stepping():
            w.step_left_s = max(0.0, w.step_left_s - done)

    def _reschedule(self) -> None:
        """After an event: a running step whose end was scheduled at another share than the one
        now (more or fewer workers step) has its end moved."""
        if self.shared_threads is None:
            return
        share = self.core_share()
        for w in self._stepping():
            if w.step_share != share:
                w.schedule_end()

    def run(self, prompts: Sequence[list[int]], output_lens: Sequence[int], offsets: Sequence[float]) -> list[Any]:
        for i, (prompt, n_out, t) in enumerate(zip(prompts, output_lens, offsets)):
            req = SimRequest(f"sim-{i}", list(prompt), int(n_out), float(t))
            self.requests[req.request_id] = req
            self.at(t + self.overheads.router_s, self._arrive, req)
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            self._advance(t)
            self.now = t
            fn(*args)
            self._reschedule()
        results = []
        for req in self.requests.values():
            res = RequestResult(prompt_len=len(req.prompt), start_time=req.send_time)
            if req.finish_time is not None and req.token_times:
                res.success = True
                res.output_len = len(req.token_times)
                res.ttft = req.token_times[0] - req.send_time
                res.latency = req.token_times[-1] - req.send_time
                res.itl = [b - a for a, b in zip(req.token_times, req.token_times[1:])]
            else:
                res.error = "did not finish in the simulation"
            results.append(res)
        return results

    def _params(self, req: SimRequest) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)

    def _publish(self) -> None:
        """Every worker's status as the router would have it now (it streams each change)."""
        for w in self.workers:
            w.publish()

    def _routes(self, req: SimRequest) -> list[Route]:
        """The router's offers for req, best first (Placement.decode_routes)."""
        self._publish()
        return self.placement.decode_routes((), len(req.prompt), req.output_len)

    def _arrive(self, req: SimRequest) -> None:
        if self.colocated:
            w = self._routes(req)[0].decode
            w.inflight += 1
            req.decode = w
            w.engine.add_request(req.request_id, req.prompt, self._params(req))
            w.kick()
        else:
            self.queue.append(req)
            self._admit_queue()

    def on_change(self) -> None:
        if self.queue:
            self._admit_queue()

    def _admit_queue(self) -> None:
        """The head of the admission queue goes to the first route whose worker has room: a local
        one at once, a remote one reserving decode blocks unless the prefill worker is backlogged
        (``Placement.prefill_backlogged``), as the router's admission does."""
        while self.queue:
            req = self.queue[0]
            backlogged = self.placement.prefill_backlogged((), len(req.prompt))
            for route in self._routes(req):
                d = route.decode
                if not self.placement.fits(d, len(req.prompt)) or (backlogged and not route.local):
                    continue
                if route.local:
                    break
                try:
                    res = d.engine.reserve(req.request_id, req.prompt, self._params(req))
                except NoCapacity:
                    continue
                break
            else:
                return
            self.queue.pop(0)
            d.inflight += 1
            if route.local:   # the decode worker's own Generate: prompt and decode there
                self.local_routes += 1
                req.decode = d
                d.engine.add_request(req.request_id, req.prompt, self._params(req))
                d.kick()
                continue
            d.core_debt_s += self.decode_s_per_request
            req.decode, req.needed = d, frozenset(res.needed_block_indices)
            p, _ = self.placement.pick_prefill((), len(req.prompt))
            p.inflight += 1
            p.core_debt_s += self.prefill_s_per_request
            p.inflight_prompt_tokens += len(req.prompt)
            req.prefill = p
            p.engine.add_request(req.request_id, req.prompt, self._params(req))
            p.kick()

    # ---- outputs ----------------------------------------------------------------------
    def on_output(self, worker: SimWorker, out: RequestOutput) -> None:
        req = self.requests[out.request_id]
        if worker.role == "prefill":
            self._prefill_output(worker, req, out)
            return
        for _ in out.new_token_ids:
            req.token_times.append(self.now + self.overheads.token_s)
        self._charge_tokens(worker, len(out.new_token_ids))
        if out.finished:
            self._finish(req)

    def _prefill_output(self, p: SimWorker, req: SimRequest, out: RequestOutput) -> None:
        shipped = sum(1 for i in out.ready_blocks if i in req.needed)
        if shipped:   # this step's finished blocks go out on the request's KV stream
            req.kv_free_at = max(req.kv_free_at, self.now) + shipped * self.kv_s_per_block
            p.core_debt_s += shipped * self.prefill_s_per_block
            assert req.decode is not None
            req.decode.core_debt_s += shipped * self.decode_s_per_block
        if not out.prefill_done:
            return
        p.inflight_prompt_tokens -= len(req.prompt)
        req.token_times.append(self.now + self.overheads.token_s)
        self._charge_tokens(p, 1)
        req.first_token = out.new_token_ids[0]
        kv_done = max(req.kv_free_at, self.now)
        if shipped:   # what the router learns of a hand-off: its blocks after the token, until acknowledged
            self.placement.costs.observe_transfer(shipped, (kv_done - self.now) * 1e3)
        self.at(kv_done, self._kv_delivered, req)
        if out.finished:   # the first token ends it: no decode needed (the router releases it)
            return
        self.at(max(kv_done, self.now + self.overheads.token_s + self.overheads.handoff_s), self._admit, req)

    def _kv_delivered(self, req: SimRequest) -> None:
        p, d = req.prefill, req.decode
        assert p is not None and d is not None
        p.inflight -= 1
        p.engine.release(req.request_id)
        d.engine.kv.mark_received(req.request_id)   # no bytes are simulated: every block arrived and checked
        if req.output_len <= 1:
            d.engine.abort(req.request_id)
            self._finish(req)
        p.kick()
        self.on_change()

    def _admit(self, req: SimRequest) -> None:
        d = req.decode
        assert d is not None and req.first_token is not None
        reason = d.engine.admit(req.request_id, req.first_token)
        if reason is not None:
            self._finish(req)
            return
        d.kick()

    def _finish(self, req: SimRequest) -> None:
        if req.finish_time is not None:
            return
        req.finish_time = self.now
        if req.decode is not None:
            req.decode.inflight -= 1
        self.on_change()
