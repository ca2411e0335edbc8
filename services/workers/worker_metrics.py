"""A worker's Prometheus metrics (pdserve.services.common.metrics: the names, the registry and the endpoint):
the engine's gauges read when scraped, per-step histograms, KV tier counters, speculative decoding
counters, hand-off counts."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter

from pdserve.services.common.metrics import LABELS, ProcessMetrics

if TYPE_CHECKING:
    from pdserve.engine import LLMEngine, RequestOutput
    from pdserve.services.workers.async_engine import StepTime


KV_TIER_COUNTERS = {"kv_host_hits": "Prefix blocks served from the host-RAM KV tier",
                    "kv_disk_hits": "Prefix blocks served from the disk KV tier",
                    "kv_offloaded_blocks": "Computed blocks the pool evicted into the KV tiers",
                    "kv_disk_writes": "Block files written to the disk KV tier",
                    "kv_tier_refused": "Tier blocks refused (corrupt, truncated, another model's)",
                    "kv_tier_dropped_writes": "Disk tier writes dropped (the write queue was full)",
                    "kv_tier_write_errors": "Disk tier writes that failed (full disk, I/O error)"}
KV_TIER_GAUGES = {"kv_host_blocks": "Blocks held in the host-RAM KV tier", "kv_host_bytes": "Bytes held there",
                  "kv_disk_blocks": "Blocks held in the disk KV tier", "kv_disk_bytes": "Bytes held there"}


class KVTierCollector:
    """The engine's KV tier stats as Prometheus samples, read at scrape time."""

    def __init__(self, engine: "LLMEngine", labels) -> None:
        self.engine, self.labels = engine, labels

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        stats = self.engine.kv_tiers.stats()
        values = self.labels()
        for kinds, family in ((KV_TIER_COUNTERS, CounterMetricFamily), (KV_TIER_GAUGES, GaugeMetricFamily)):
            for key, doc in kinds.items():
                metric = family(f"pdserve:{key}", doc, labels=LABELS)
                metric.add_metric(values, stats[key])
                yield metric


SPEC_DECODE_COUNTERS = {"spec_decode_num_drafts": "Speculative drafts verified",
                        "spec_decode_num_draft_tokens": "Draft tokens verified",
                        "spec_decode_num_accepted_tokens": "Draft tokens accepted"}


class SpecDecodeCollector:
    """The engine's speculative decoding counters, with vLLM's names and meanings, read at scrape
    time: drafts, draft tokens, accepted tokens, and accepted tokens per draft position (label
    position). Acceptance rate: accepted / draft tokens; mean accepted length: 1 + accepted / drafts."""

    def __init__(self, engine: "LLMEngine", labels) -> None:
        self.engine, self.labels = engine, labels

    def collect(self):
        from prometheus_client.core import CounterMetricFamily
        stats = self.engine.speculator.stats
        values = self.labels()
        for key, doc in SPEC_DECODE_COUNTERS.items():
            metric = CounterMetricFamily(f"pdserve:{key}", doc, labels=LABELS)
            metric.add_metric(values, getattr(stats, key.removeprefix("spec_decode_")))
            yield metric
        metric = CounterMetricFamily("pdserve:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in their draft", labels=(*LABELS, "position"))
        for position, n in enumerate(list(stats.accepted_per_position)):
            metric.add_metric([*values, str(position)], n)
        yield metric


class WorkerMetrics(ProcessMetrics):
    """Engine-side metrics: counters and histograms from the engine thread after every step,
    gauges read from the engine when scraped (see ``attach``)."""

    SHARED = {"num_requests_running": "Sequences in the running batch",
              "prompt_tokens": "Prompt tokens of requests prefilled here",
              "generation_tokens": "Tokens sampled here",
              "request_queue_time_seconds": "Arrival to first scheduled",
              "kv_transfer_seconds": "Seconds per KV send of a chunk's blocks"}

    def __init__(self, role: str, worker_id: str, model_name: str = "") -> None:
        super().__init__(role, worker_id, model_name)
        self.num_requests_waiting = self.gauge("num_requests_waiting", "Sequences waiting to be scheduled")
        self.kv_cache_usage_perc = self.gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)")
        self.prefix_cache_queries = self.counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = self.counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.num_preemptions = self.counter("num_preemptions", "Sequences preempted for recompute")
        self.kv_transfer_bytes = self.counter("kv_transfer_bytes", "KV bytes sent (prefill) or received (decode)")
        self.kv_transfer_failures = self.counter("kv_transfer_failures", "KV blocks refused or failed to send")
        self._kv_raw_bytes = Counter("pdserve:kv_raw_bytes", "Prefill: KV bytes delivered, raw, by wire codec",
                                     (*LABELS, "codec"), registry=self.registry)
        self._kv_wire_bytes = Counter("pdserve:kv_wire_bytes", "Prefill: those KV bytes' size on the wire, by wire "
                                      "codec (raw / wire: the compression ratio)", (*LABELS, "codec"),
                                      registry=self.registry)
        self.engine_step_seconds = self.histogram("engine_step_seconds", "Wall time of each engine step")
        self.engine_step_cpu_seconds = self.counter(
            "engine_step_cpu_seconds", "CPU time the engine thread spent in steps (the rest of the process's CPU "
            "time is serving around the engine: RPCs, token delivery, KV receive)")
        self._last = {"queries": 0, "hits": 0, "preemptions": 0}
        self._engine: "LLMEngine | None" = None
        self._tiers_watched = False
        self._spec_watched = False

    def attach(self, engine: "LLMEngine") -> None:
        """Read the gauges from engine whenever scraped: admission, cancel, abort and finish show
        at once, also on an engine that takes no further step."""
        bm, sched = engine.block_manager, engine.scheduler
        self.num_requests_running.set_function(lambda: len(sched.running))
        self.num_requests_waiting.set_function(lambda: len(sched.waiting))
        self.kv_cache_usage_perc.set_function(bm.usage)
        self._engine = engine
        self.watch_kv_tiers(engine)
        if engine.speculator is not None and not self._spec_watched:
            self._spec_watched = True
            self.registry.register(SpecDecodeCollector(engine, lambda: [self.labels[name] for name in LABELS]))

    def watch_kv_tiers(self, engine: "LLMEngine") -> None:
        """Publish the engine's KV tier figures (engine/kv/tiers.py), read when scraped: hits per
        tier, blocks offloaded, refused, writes dropped or failed (counters), blocks and bytes held
        per tier (gauges). Nothing is published without tiers."""
        if engine.kv_tiers is None or self._tiers_watched:
            return
        self._tiers_watched = True
        self.registry.register(KVTierCollector(engine, lambda: [self.labels[name] for name in LABELS]))

    def set_role(self, role: str) -> None:
        """The worker switched roles: later samples carry the new role label (``relabel``); the
        gauges read the same engine under it."""
        self.relabel(role=role)
        if self._engine is not None:
            self.attach(self._engine)

    def on_step(self, engine: "LLMEngine", outputs: list["RequestOutput"], timing: "StepTime | None" = None) -> None:
        if timing is not None:
            self.engine_step_seconds.observe(timing.wall_s)
            self.engine_step_cpu_seconds.inc(timing.cpu_s)
        bm = engine.block_manager
        sched = engine.scheduler
        if self._engine is None:
            self.attach(engine)
        for key, counter, value in (("queries", self.prefix_cache_queries, bm.prefix_cache_queries),
                                    ("hits", self.prefix_cache_hits, bm.prefix_cache_hits),
                                    ("preemptions", self.num_preemptions, sched.num_preemptions)):
            counter.inc(value - self._last[key])
            self._last[key] = value
        for out in outputs:
            self.generation_tokens.inc(len(out.new_token_ids))
            if out.queue_s is not None:   # first token: the prompt was prefilled here
                self.prompt_tokens.inc(out.num_prompt_tokens)
                self.request_queue_time_seconds.observe(out.queue_s)

    def kv_sent(self, nbytes: int, seconds: float, wire_bytes: int = 0, codec: str = "off") -> None:
        """Prefill role: one request's KV acknowledged: nbytes raw, wire_bytes on the wire under codec."""
        self.kv_transfer_bytes.inc(nbytes)
        self.kv_transfer_seconds.observe(seconds)
        self._kv_raw_bytes.labels(**self.labels, codec=codec).inc(nbytes)
        self._kv_wire_bytes.labels(**self.labels, codec=codec).inc(wire_bytes or nbytes)

    def kv_received(self, nbytes: int) -> None:
        self.kv_transfer_bytes.inc(nbytes)

    def kv_failure(self) -> None:
        self.kv_transfer_failures.inc()

    def kv_handoff_ended(self, state) -> None:
        """Decode role: a reservation ended; a failed or lapsed one counts as a KV failure."""
        if state.value in ("failed", "expired"):
            self.kv_transfer_failures.inc()
