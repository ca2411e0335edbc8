"""The planner: `pdserve profile` measures a cost model; the simulator drives the real scheduler
and block manager in simulated time; `pdserve plan` ranks deployments under SLOs."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.step_cost import StepSample, fit_nonnegative, step_features
from pdserve.services.planner.cost_model import CostModel
from pdserve.engine.step_cost import published_costs
from pdserve.services.loadtest.traces import TraceOptions
from pdserve.services.planner.plan import TraceReplay, Workload, candidates, parse_slos, rank, simulate
from pdserve.services.planner.serving_costs import ServingCosts
from pdserve.services.planner.simulator import Candidate, Overheads, Simulation
from pdserve.services.router.placement import Placement
from pdserve.services.cli.commands import main

ROOT = Path(__file__).resolve().parents[3]


def _sim(cost: CostModel, candidate: Candidate, prompts, outs, offsets) -> tuple[Simulation, list]:
    sim = Simulation(cost, candidate, Overheads())
    return sim, sim.run(prompts, outs, offsets)


def test_cost_model_fit_recovers_coefficients_and_round_trips(tmp_path: Path) -> None:
    truth = {"const": 0.003, "prefill_tokens": 0.0002, "decode_seqs": 0.0005, "decode_context": 0.001}
    samples = []
    for n in (16, 64, 256, 512):
        for ctx in (0, 256):
            s = step_features([ctx], [n], 0)
            s.seconds = truth["const"] + truth["prefill_tokens"] * n
            samples.append(s)
    for b in (1, 4, 16, 32):
        for ctx in (64, 512):
            s = step_features([ctx] * b, [1] * b, b)
            s.seconds = truth["const"] + truth["decode_seqs"] * b + truth["decode_context"] * s.decode_context
            samples.append(s)
    model = CostModel.fit(samples)
    dec = model.fits["decode"]
    assert dec.knots == [1, 4, 16, 32]   # decode: piecewise linear in the batch size, a knot per profiled size
    for b in dec.knots:
        assert dec.coefficients[f"decode_seqs={b:g}"] == pytest.approx(truth["const"] + truth["decode_seqs"] * b,
                                                                        rel=1e-3)
    assert dec.coefficients["decode_context"] == pytest.approx(truth["decode_context"], rel=1e-3)
    for b in (2, 9, 48):   # between knots and beyond the last: the truth is linear, so exact
        probe = step_features([300] * b, [1] * b, b)
        want = truth["const"] + truth["decode_seqs"] * b + truth["decode_context"] * probe.decode_context
        assert model.step_seconds(probe) == pytest.approx(want, rel=1e-3)
    assert model.fits["prefill"].coefficients["prefill_tokens"] == pytest.approx(truth["prefill_tokens"], rel=1e-3)
    again = CostModel.load(model.save(tmp_path / "p.json"))
    probe = step_features([100, 200], [1, 1], 2)
    assert again.step_seconds(probe) == pytest.approx(model.step_seconds(probe))
    assert len(again.samples) == len(samples)
    # non-negative: a column that would fit negative is dropped
    import numpy as np
    x = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    coef = fit_nonnegative(x, np.array([3.0, 2.0, 1.0]), np.ones(3))
    assert (coef >= 0).all()


def test_decode_cost_follows_a_kernel_switch_between_batch_sizes() -> None:
    """A decode step's GEMMs change kernels with the row count: 10 ms up to 4 sequences, 24 ms at 5
    (measured so on the AVX2 EPYC before the bf16 kernel took more rows). One line through every
    batch size misses both sides; the piecewise fit predicts each profiled size."""
    def truth(b: int) -> float:
        return 0.010 if b <= 4 else 0.024 + 0.001 * (b - 5)
    samples = []
    for b in (1, 2, 4, 5, 8, 16):
        for ctx in (64, 512):
            s = step_features([ctx] * b, [1] * b, b)
            s.seconds = truth(b) + 0.002 * s.decode_context
            samples.append(s)
    model = CostModel.fit(samples)
    for b in (1, 2, 4, 5, 8, 16):
        probe = step_features([200] * b, [1] * b, b)
        assert model.step_seconds(probe) == pytest.approx(truth(b) + 0.002 * probe.decode_context, rel=1e-3)
    assert model.step_seconds(step_features([200] * 12, [1] * 12, 12)) == pytest.approx(
        truth(12) + 0.002 * 2.4, rel=1e-3)   # between knots 8 and 16: on the line through both


def test_simulated_steps_are_the_real_schedulers_chunked_prefill(cost: CostModel) -> None:
    """A 200-token prompt under a 64-token budget is chunked 64/64/64/8 by engine/scheduler.py
    (fcfs); a second request arriving meanwhile decodes in mixed steps beside the chunks. Under
    the default prompt order (shortest) that short prompt passes the long one under way."""
    prompt = list(range(2, 202))
    shortest, _ = _sim(cost, Candidate(colocated_workers=1, max_num_batched_tokens=64, schedule_policy="mixed"),
                       [prompt, list(range(300, 320))], [4, 8], [0.0, 0.001])
    assert [(t.request_ids, t.num_tokens) for t in (s.trace for s in shortest.colocated[0].steps[:2])] == \
        [(["sim-0"], [64]), (["sim-1", "sim-0"], [20, 44])]
    sim, res = _sim(cost, Candidate(colocated_workers=1, max_num_batched_tokens=64, schedule_policy="mixed",
                                    prompt_order="fcfs"),
                    [prompt, list(range(300, 320))], [4, 8], [0.0, 0.001])
    assert all(r.success for r in res) and [r.output_len for r in res] == [4, 8]
    steps = sim.colocated[0].steps
    first = steps[0].trace
    assert first.request_ids == ["sim-0"] and first.num_tokens == [64]
    assert [s.trace.num_tokens[0] for s in steps if s.trace.request_ids[0] == "sim-0"][:4] == [64, 64, 64, 8]
    assert all(s.trace.num_tokens and sum(s.trace.num_tokens) <= 64 for s in steps)
    # the short prompt is admitted in sim-0's last chunk; then it decodes beside nothing, and
    # a colocated mixed step appears when a prompt is chunked beside running decodes:
    sim2, _ = _sim(cost, Candidate(colocated_workers=1, max_num_batched_tokens=64, schedule_policy="mixed"),
                   [list(range(300, 320)), prompt], [16, 4], [0.0, 0.05])
    mixed = [s.trace for s in sim2.colocated[0].steps if s.trace.kind.value == "mixed"]
    assert mixed and all(t.num_decode_seqs == 1 and t.num_prefill_tokens == 63 for t in mixed[:3])
    # time advances by each step's priced duration, back to back while there is work
    for a, b in zip(steps, steps[1:]):
        assert b.start == pytest.approx(a.start + a.seconds)
    assert sim.colocated[0].engine.stats()["num_free_blocks"] == sim.colocated[0].engine.stats()["num_total_blocks"]


def test_disaggregated_roles_and_kv_handoff(cost: CostModel) -> None:
    w = Workload(rate=4.0, num_prompts=12, input_len=100, output_len=16)
    m = simulate(cost, Candidate(prefill_workers=1, decode_workers=1, max_num_batched_tokens=64), w)
    sim: Simulation = m["simulation"]
    assert m["completed"] == 12 and m["failed"] == 0
    assert all(s.trace.num_decode_seqs == 0 for s in sim.prefill[0].steps)      # prefill_first, never decodes
    assert all(s.trace.kind.value == "decode" for s in sim.decode[0].steps)     # KV arrives, nothing prefills here
    assert max(s.trace.num_tokens[0] for s in sim.prefill[0].steps) <= 64
    for wk in (*sim.prefill, *sim.decode):   # every block back in the pool: pins released, reservations admitted
        st = wk.engine.stats()
        assert st["num_free_blocks"] == st["num_total_blocks"] and st["num_pinned"] == 0
    # a slower KV transfer shows in the first gap after the first token
    slow = simulate(cost, Candidate(prefill_workers=1, decode_workers=1, max_num_batched_tokens=64), w,
                    Overheads(kv_s_per_block=0.05))
    assert slow["mean_itl_ms"] > m["mean_itl_ms"]


def test_serving_cpu_is_charged_to_the_core_it_runs_on(cost: CostModel) -> None:
    """The profile's serving costs are CPU time taken from a worker's core: each token a worker
    emits costs its event loop worker_s_per_token, and the router's per-token cost lands on the
    same core unless `pdserve up` gives the router a spare one (colocated workers on fewer cores
    than the machine has). One request alone: every decode gap grows by exactly that."""
    serving = ServingCosts(worker_s_per_token=0.001, router_s_per_token={"colocated": 0.002, "disaggregated": 0.004})
    prompt, n_out = [list(range(2, 42))], [8]

    def gaps(model: CostModel, candidate: Candidate, overheads: Overheads | None = None) -> list[float]:
        return Simulation(model, candidate, overheads or Overheads()).run(prompt, n_out, [0.0])[0].itl

    one = Candidate(colocated_workers=1)
    base = gaps(cost, one)
    shared = dataclasses.replace(cost, serving=serving, machine={**cost.machine, "cpu_count": 1})
    spare = dataclasses.replace(cost, serving=serving, machine={**cost.machine, "cpu_count": 2})
    assert gaps(shared, one) == pytest.approx([g + 0.003 for g in base])   # worker + router on its core
    assert gaps(spare, one) == pytest.approx([g + 0.001 for g in base])    # the router on the spare core
    assert gaps(shared, one, Overheads(serving_cpu=False)) == pytest.approx(base)
    # disaggregated: the decode worker emits every token after the first; the router sits beside it
    pd = Candidate(prefill_workers=1, decode_workers=1)
    base_pd = gaps(cost, pd)
    with_cpu = gaps(dataclasses.replace(cost, serving=serving), pd)
    assert with_cpu[2:] == pytest.approx([g + 0.005 for g in base_pd[2:]])
    # a load generator on the same machine runs where the router does not: the prefill worker's
    # core (a later prompt's TTFT grows), not the decode worker's (the gaps stay)
    later = [list(range(2, 42)), list(range(50, 90))]
    def run(overheads: Overheads) -> list:
        return Simulation(cost, pd, overheads).run(later, [8, 8], [0.0, 0.05])   # arrives mid-decode
    alone, loaded = run(Overheads()), run(Overheads(client_s_per_token=0.05))
    assert loaded[1].ttft > alone[1].ttft + 0.05 and loaded[1].itl[2:] == pytest.approx(alone[1].itl[2:])


def test_workers_that_outnumber_their_cores_share_them(cost: CostModel) -> None:
    """Two colocated workers on one core: a step's work is priced at a whole core, and while both
    step each gets half. Prompts of a and b tokens (b < a) arriving together, one per worker, each
    one step: the short one ends at 2b, the long one then runs alone and ends at a + b (not at a)."""
    long, short = list(range(2, 202)), list(range(300, 340))

    def first_tokens(shared_cores: int | None) -> tuple[Simulation, list[float]]:
        cand = Candidate(colocated_workers=2, max_num_batched_tokens=256, schedule_policy="mixed",
                         shared_cores=shared_cores)
        sim = Simulation(cost, cand, Overheads(serving_cpu=False))
        return sim, [r.ttft for r in sim.run([long, short], [1, 1], [0.0, 0.0])]

    sim, alone = first_tokens(None)
    a, b = (next(s.seconds for s in w.steps if s.trace.request_ids == [rid])
            for rid in ("sim-0", "sim-1") for w in sim.colocated if any(s.trace.request_ids == [rid] for s in w.steps))
    assert b < a
    _, shared = first_tokens(1)
    assert shared[0] == pytest.approx(alone[0] + b)        # a + b after it started, instead of a
    assert shared[1] == pytest.approx(alone[1] + b)        # 2b instead of b
    assert first_tokens(2)[1] == pytest.approx(alone)      # enough cores: nobody waits
    with pytest.raises(ValueError, match="shared_cores"):
        Candidate(colocated_workers=1, shared_cores=0)
    # A disaggregated split of three workers on two cores predicts slower first tokens than with a
    # core each (the planner's --watch over a deployment on one machine).
    w = Workload(rate=6.0, num_prompts=30, input_len=128, output_len=16)
    own = simulate(cost, Candidate(prefill_workers=2, decode_workers=1, max_num_batched_tokens=256), w)
    two = simulate(cost, Candidate(prefill_workers=2, decode_workers=1, max_num_batched_tokens=256, shared_cores=2), w)
    assert two["mean_ttft_ms"] > own["mean_ttft_ms"] and two["completed"] == own["completed"] == 30
    # never more than the shared cores' worth of work per simulated second, however steps interleave
    busy = Workload(rate=20.0, num_prompts=30, input_len=128, output_len=16)
    for cand in (Candidate(colocated_workers=3, max_num_batched_tokens=64, schedule_policy="mixed", shared_cores=1),
                 Candidate(prefill_workers=2, decode_workers=1, max_num_batched_tokens=64, shared_cores=2)):
        sim = simulate(cost, cand, busy)["simulation"]
        work = sum(s.seconds for wk in sim.workers for s in wk.steps)
        cores = cand.shared_cores
        assert 0.5 * cores * sim.now < work <= cores * sim.now + 1e-9, (cand.name, work, sim.now)


def test_simulation_is_deterministic_for_a_seed(cost: CostModel) -> None:
    cand = Candidate(colocated_workers=1, max_num_batched_tokens=256, schedule_policy="mixed")
    a = simulate(cost, cand, Workload(rate=8.0, num_prompts=30, input_len=64, output_len=16, seed=1))
    b = simulate(cost, cand, Workload(rate=8.0, num_prompts=30, input_len=64, output_len=16, seed=1))
    c = simulate(cost, cand, Workload(rate=8.0, num_prompts=30, input_len=64, output_len=16, seed=2))
    keys = ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "duration")
    assert [a[k] for k in keys] == [b[k] for k in keys]
    assert [a[k] for k in keys] != [c[k] for k in keys]


def test_faster_cost_model_predicts_lower_latency(cost: CostModel) -> None:
    w = Workload(rate=6.0, num_prompts=30, input_len=128, output_len=16)
    for cand in (Candidate(colocated_workers=1, max_num_batched_tokens=512, schedule_policy="mixed"),
                 Candidate(prefill_workers=1, decode_workers=1, max_num_batched_tokens=512)):
        slow = simulate(cost, cand, w)
        fast = simulate(cost.scaled(0.5), cand, w)
        assert fast["p50_ttft_ms"] < slow["p50_ttft_ms"]
        assert fast["p50_itl_ms"] < slow["p50_itl_ms"]
        assert fast["p99_tpot_ms"] < slow["p99_tpot_ms"]


def test_slo_filtering_and_ranking(cost: CostModel) -> None:
    assert parse_slos(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slos(["ttft:500,e2el:9000"]) == {"ttft": 500.0, "e2el": 9000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_slos(bad)
    w = Workload(rate=6.0, num_prompts=30, input_len=128, output_len=16)
    cand = Candidate(colocated_workers=1, max_num_batched_tokens=512, schedule_policy="mixed")
    loose = simulate(cost, cand, w, slos={"ttft": 1e6, "tpot": 1e6})
    tight = simulate(cost, cand, w, slos={"ttft": 0.001})
    assert loose["slo_attainment"] == pytest.approx(1.0) and tight["slo_attainment"] == 0.0
    mid = {"ttft": simulate(cost, cand, w)["p50_ttft_ms"]}
    assert 0.3 < simulate(cost, cand, w, slos=mid)["slo_attainment"] < 0.7
    # with an SLO nobody meets, goodput per core is 0 for everyone; with a loose one the cheaper
    # deployment (fewer cores for the same goodput) ranks first
    rows = [(c, simulate(cost, c, w, slos={"ttft": 1e6}))
            for c in (Candidate(prefill_workers=1, decode_workers=1), cand)]
    assert rank(rows)[0][0] is cand
    # ... and by goodput itself, the two-core deployment when it keeps more requests within the SLOs
    rows = [(c, simulate(cost, c, w, slos={"ttft": mid["ttft"]}))
            for c in (Candidate(colocated_workers=2, max_num_batched_tokens=512, schedule_policy="mixed"), cand)]
    assert rows[0][1]["request_goodput"] > rows[1][1]["request_goodput"]
    assert rank(rows)[0][0] is cand and rank(rows, "goodput")[0][0] is rows[0][0]
    with pytest.raises(ValueError, match="objective"):
        rank(rows, "throughput")
    assert len(candidates(2, [256, 2048], ["mixed"])) == 2 * (2 + 1)   # colocated x1, x2, 1P1D per budget
    assert len(candidates(2, [256], ["mixed"], disaggregations=("always", "conditional"))) == 2 + 2


def test_plan_cli(cost: CostModel, tmp_path: Path, capsys) -> None:
    path = cost.save(tmp_path / "profile.json")
    out_json = tmp_path / "plan.json"
    code = main(["plan", "--profile", str(path), "--rate", "4", "--num-prompts", "20", "--input-len", "64",
                 "--output-len", "8", "--slo", "ttft:2000", "--slo", "tpot:100", "--cores", "2",
                 "--chunk-budgets", "256", "--policies", "mixed", "--out", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "recommended:" in out and "pdserve up --model" in out and "1P1D" in out
    rows = json.loads(out_json.read_text())["candidates"]
    assert len(rows) == 4 and all("p99_ttft_ms" in r for r in rows)   # colocated x1, x2; 1P1D always, conditional
    assert {r["candidate"].split(",")[0] for r in rows} >= {"1P1D always", "1P1D conditional"}
    assert any("--disaggregation conditional" in r["up_flags"] for r in rows)
    code = main(["plan", "--profile", str(path), "--slo", "latency:5"])
    assert code == 2 and "--slo" in capsys.readouterr().err
    code = main(["plan", "--profile", str(tmp_path / "missing.json")])
    assert code == 2 and "pdserve profile" in capsys.readouterr().err


def test_profile_cli_end_to_end(tiny_qwen3: str, tmp_path: Path) -> None:
    """`pdserve profile` on the tiny model with a tiny sweep writes a usable cost model."""
    out = tmp_path / "tiny.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "profile", "--model", tiny_qwen3, "--out", str(out),
                           "--chunk-sizes", "16,64", "--max-context", "128", "--decode-batches", "1,4",
                           "--decode-contexts", "32,96", "--decode-steps", "3", "--mixed-chunks", "16",
                           "--repeats", "1", "--kv-blocks", "2", "--num-kv-blocks", "256"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "wrote" in proc.stdout
    model = CostModel.load(out)
    kinds = {s.kind for s in model.samples}
    assert {"prefill", "decode", "mixed"} <= kinds
    assert model.machine["cpu_count"] == os.cpu_count() and model.machine["torch_threads"] == 1
    assert model.engine["resolved_num_kv_blocks"] == 256 and model.engine["num_threads"] == 1
    assert model.kv_transfer_s_per_block > 0 and model.kv_bytes_per_block > 0
    assert model.step_seconds(StepSample("decode", 0, 0, 0.0, 4, 0.2, 0.0)) > 0
    # serving costs, measured through a real `pdserve up` (colocated and 1P1D) and its /metrics
    sv = model.serving
    assert sv.worker_s_per_token > 0 and sv.router(True) > 0 and sv.router(False) > 0
    assert sv.prefill_s_per_request + sv.prefill_s_per_block_sent > 0
    # a decode worker's cost beyond its tokens' is fitted from its CPU less its tokens' (a colocated
    # worker's rate): on the tiny model the rest is small enough to fit to 0 under load, but what it
    # is fitted from must be there: the KV each load shipped
    assert sv.decode_s_per_request >= 0 and sv.decode_s_per_block_received >= 0
    assert all(run["decode-0"]["pdserve:kv_transfer_bytes_total"] > 0 and "process_cpu_seconds_total" in run["decode-0"]
               for run in sv.measured["disaggregated"].values())
    assert set(sv.measured) == {"colocated", "disaggregated"} and "pdserve is up" in (
        tmp_path / "serving-disaggregated.log").read_text()
    # and it plans
    sim = simulate(model, Candidate(colocated_workers=1), Workload(rate=2.0, num_prompts=5, input_len=32, output_len=4))
    assert sim["completed"] == 5


def test_planner_accuracy_slo_attainment_curve(cost: CostModel, tmp_path: Path, capsys) -> None:
    """bench/planner_accuracy.py --slo: measured attainment by bench serve's goodput rule (a failed
    request misses), predicted from the simulator, a table per rate and the curves as a PNG."""
    from bench.planner_accuracy import main as accuracy_main, measured_attainment

    slos = {"ttft": 500.0, "tpot": 50.0}
    # good; TTFT too late; TPOT too slow ((2.0 - 0.1) / 9 s per token); failed
    result = {"errors": ["", "", "", "UNAVAILABLE: x"], "output_lens": [10, 10, 10, 0],
              "ttfts": [0.2, 0.6, 0.1, 0.0], "e2els": [0.5, 0.9, 2.0, 0.0], "duration": 4.0}
    assert measured_attainment(result, slos) == 0.25
    assert measured_attainment(result, {"ttft": 1000.0}) == 0.75

    profile = cost.save(tmp_path / "profile.json")
    measured_dir = tmp_path / "measured"
    measured_dir.mkdir()
    (measured_dir / "colocated-2.json").write_text(json.dumps({**result, "p50_ttft_ms": 150.0}))
    png = tmp_path / "slo.png"
    code = accuracy_main(["--profile", str(profile), "--setups", "colocated,1P1D", "--rates", "1,2",
                          "--num-prompts", "12", "--input-len", "64", "--output-len", "8", "--slo", "ttft:500,tpot:50",
                          "--measured-dir", str(measured_dir), "--plot", str(png), "--result-dir", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert code == 0
    table = out[out.index("SLO attainment (ttft <= 500 ms, tpot <= 50 ms), predicted / measured"):]
    rows = [line for line in table.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2
    assert rows[0].count("%") == 2 and rows[0].count("/ -") == 2          # rate 1: nothing measured
    assert rows[1].split("|")[2].strip().endswith("/ 25%")                 # colocated at 2 req/s: measured
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_simulator_places_requests_with_the_router_s_placement(cost: CostModel) -> None:
    """The simulated workers are placed by the router's own code (services/router/placement.py,
    the load policy) over their published statuses, not by a copy of its rules: requests arriving
    together spread over the decode workers (fewest in flight) and the prefill workers (fewest
    queued prompt tokens)."""
    sim = Simulation(cost, Candidate(prefill_workers=2, decode_workers=2, max_num_batched_tokens=64), Overheads())
    assert isinstance(sim.placement, Placement) and sim.placement.routing == "load"
    assert sim.placement.pool.workers == sim.workers
    asked = []
    routes = sim.placement.decode_routes
    sim.placement.decode_routes = lambda *args, **kwargs: asked.append(args[1]) or routes(*args, **kwargs)
    results = sim.run([[5] * 40] * 4, [3] * 4, [0.0] * 4)
    assert all(r.success for r in results) and asked and set(asked) == {40}
    placed = [sim.requests[f"sim-{i}"] for i in range(4)]
    assert sorted(r.decode.name for r in placed) == ["decode-0", "decode-0", "decode-1", "decode-1"]
    assert sorted(r.prefill.name for r in placed) == ["prefill-0", "prefill-0", "prefill-1", "prefill-1"]


def _burst(n: int, input_len: int, output_len: int) -> tuple[list[list[int]], list[int], list[float]]:
    """n distinct prompts arriving within 10 ms (a trace's burst)."""
    return ([list(range(2 + i, 2 + i + input_len)) for i in range(n)], [output_len] * n,
            [0.001 * i for i in range(n)])


def test_conditional_disaggregation_prefills_on_the_decode_worker_when_prompts_queue(cost: CostModel) -> None:
    """1P1D under a burst of 12 prompts: with conditional disaggregation the router's placement,
    pricing each route with the costs the simulated workers learned from their priced steps,
    keeps some prompts on the idle decode worker (its own prompt steps appear), so first tokens
    come sooner than when every prompt queues on the prefill worker; every block is returned."""
    prompts, outs, offsets = _burst(12, 200, 8)
    runs = {}
    for mode in ("always", "conditional"):
        sim, res = _sim(cost, Candidate(prefill_workers=1, decode_workers=1, max_num_batched_tokens=256,
                                        disaggregation=mode), prompts, outs, offsets)
        assert all(r.success for r in res) and [r.output_len for r in res] == outs
        for wk in sim.workers:
            st = wk.engine.stats()
            assert st["num_free_blocks"] == st["num_total_blocks"] and st["num_pinned"] == 0
        runs[mode] = (sim, sorted(r.ttft for r in res))
    always, conditional = runs["always"][0], runs["conditional"][0]
    assert always.local_routes == 0 and not any(s.trace.num_prefill_tokens for s in always.decode[0].steps)
    assert 0 < conditional.local_routes < 12
    assert sum(s.trace.num_prefill_tokens for s in conditional.decode[0].steps) >= 200 * conditional.local_routes
    assert sum(runs["conditional"][1]) < sum(runs["always"][1])
    # what the workers publish is learned from simulated time: the profile's price of a prompt token
    _, per_token, _ = published_costs(always.prefill[0].engine.step_cost, always.prefill[0].engine.decode_step_cost)
    assert per_token == pytest.approx(1e3 * cost.fits["prefill"].coefficients["prefill_tokens"], rel=0.5)


def _trace_file(path: Path, rows: int) -> Path:
    """A Mooncake-format trace: bursts of 4 rows at a timestamp, each prompt opening with the
    same two hash ids (a shared system prompt) and then its own."""
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"timestamp": 1000 * (i // 4), "input_length": 1536 + 512 * (i % 3),
                                "output_length": 40, "hash_ids": [1, 2, 100 + i, 200 + i, 300 + i]}) + "\n")
    return path


def test_plan_on_a_trace_replays_its_arrivals_lengths_and_shared_prefixes(cost: CostModel, tmp_path: Path,
                                                                          capsys) -> None:
    """`pdserve plan --dataset-name mooncake_trace` simulates the slice bench serve would replay:
    its scaled lengths and times, the same tokens for the same hash ids (the engines' prefix
    caches hit on them), and ranks every candidate, conditional disaggregation among them."""
    trace = _trace_file(tmp_path / "trace.jsonl", 24)
    opts = TraceOptions(str(trace), token_scale=1 / 16, output_scale=0.5, time_scale=0.5)
    replay = TraceReplay(opts, num_prompts=20, seed=0)
    prompts, outs, offsets = replay.requests(1000, None)
    assert [len(p) for p in prompts[:3]] == [96, 128, 160] and outs == [20] * 20
    assert offsets[:5] == [0.0, 0.0, 0.0, 0.0, 0.5] and offsets[-1] == 2.0
    assert all(p[:64] == prompts[0][:64] for p in prompts) and prompts[0][64:96] != prompts[1][64:96]
    m = simulate(cost, Candidate(colocated_workers=1, max_num_batched_tokens=256, schedule_policy="mixed"), replay)
    assert m["completed"] == 20
    assert m["simulation"].colocated[0].engine.stats()["prefix_cache_hits"] >= 19 * 4   # 4 shared blocks of 16
    path = cost.save(tmp_path / "profile.json")
    out_json = tmp_path / "plan.json"
    code = main(["plan", "--profile", str(path), "--dataset-name", "mooncake_trace", "--dataset-path", str(trace),
                 "--num-prompts", "20", "--trace-token-scale", "0.0625", "--trace-output-scale", "0.5", "--rate", "4",
                 "--slo", "ttft:2000", "--slo", "tpot:100", "--cores", "2", "--chunk-budgets", "256",
                 "--policies", "mixed", "--out", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "20 rows of mooncake_trace trace.jsonl from row 0" in out and "rescaled to 4 req/s" in out
    rows = json.loads(out_json.read_text())["candidates"]
    assert len(rows) == 4 and all(r["completed"] == 20 for r in rows)
    assert any(r["candidate"].startswith("1P1D conditional") for r in rows)
    code = main(["plan", "--profile", str(path), "--dataset-name", "mooncake_trace"])
    assert code == 2 and "--dataset-path" in capsys.readouterr().err
