"""Shared fixtures (tiny checkpoints made once per session, the real default model converted once
per run, HF reference outputs) and the suite's markers and parallel layout.

Markers set here, from what a test does rather than by hand:
- ``e2e``: the test (or a fixture or helper of its module it reaches) starts processes: a deployment,
  a CLI child, rank processes, a Ray cluster. ``pytest -m "not e2e"`` is the quick loop.
- ``exclusive``: timing-sensitive (a stall watchdog of a second, token gaps under a second); under
  pytest-xdist it runs with no other test running beside it (a lock the other workers wait on).
Under pytest-xdist's ``--dist loadgroup`` (``pytest_xdist_make_scheduler`` below) one group runs on
one worker, in order: every test of a module together (its module-scoped deployment is started
once), every Ray test together (one local Ray cluster at a time), every fault-injection module
together. Groups are handed out longest first (``GROUP_SECONDS``, measured per group), so the
workers end together.
"""
from __future__ import annotations

import fcntl
import inspect
import json
import os
import random
import types
from pathlib import Path

# Ray reads its auth mode once, when first imported; whichever test module imports it first,
# the Ray tests' local cluster uses token authentication.
os.environ.setdefault("RAY_AUTH_MODE", "token")

import pytest

from pdserve.engine.model_maker import make_model
from pdserve.engine.step_cost import KindFit
from pdserve.services.planner.cost_model import CostModel

ARCHS = ("qwen3", "llama", "qwen2")
_TESTS = Path(__file__).resolve().parent

# ---- markers and parallel layout ------------------------------------------------------------------
# Names whose use means "starts a process": launchers, subprocess, Ray, the multi-rank engine.
_STARTERS = {"start_cluster", "FaultCluster", "Cluster", "subprocess", "Popen", "fork", "start_local_cluster",
             "tensor_parallel_size"}
# Modules every test of which is end to end, whatever the scan finds (ranks, actors, clusters
# started through engine or deployment objects the scan does not follow: rank processes, actors).
_E2E_MODULES = {"test_ray_serving", "test_ray_quickstart", "test_tensor_parallel", "test_cli_up",
                "test_bench_scripts", "test_metrics_e2e", "test_serving_e2e", "test_serving_large_kv"}
_GROUPS = {"test_ray_serving": "ray", "test_ray_quickstart": "ray", "test_bench_scripts": "ray",
           "test_fault_matrix": "faults", "test_supervisor": "faults", "test_leases": "faults",
           "test_restart_outage": "faults"}
# Seconds per group (the sum of its tests' durations in a -n 2 run, 2026-12-03; for the order
# groups are handed out in, the longest first; unknown: 1 s).
GROUP_SECONDS = {"ray": 420, "faults": 280, "test_real_model": 130, "test_readme_quickstart": 25,
                 "test_tensor_parallel": 94, "test_security": 115, "test_multi_host": 82,
                 "test_serving_e2e": 74, "test_batch_invariance": 73, "test_internal_plane": 50,
                 "test_exhaustion_and_shm": 36, "test_openai_api": 36, "test_kv_routing": 32, "test_planner": 31,
                 "test_front_door": 23, "test_cli_vllm_habits": 22, "test_router_runtime": 22, "test_metrics_e2e": 16,
                 "test_code_shape": 16, "test_bench_serve": 15, "test_cli_up": 14, "test_topology_argv": 12,
                 "test_serving_large_kv": 11, "test_kv_tamper_across_hosts": 10, "test_membership": 75,
                 "test_worker_set_role": 6, "test_ray_multi_node": 110,
                 "test_slo_admission": 40, "test_tracing": 12, "test_spec_decode_serving": 45,
                 "test_compose": 150}
EXCLUSIVE = {"test_request_queued_longer_than_the_stall_timeout_is_not_migrated",
             "test_a_huge_text_prompt_is_refused_fast_without_memory_growth_or_stalls",
             # its prefill must send a block at least every 0.5 s (the idle lease) for 2 s
             "test_progress_keeps_a_reservation_alive_well_past_its_idle_lease"}


def _names(code: types.CodeType) -> set[str]:
    """Global and attribute names a function's code (nested functions included) uses, and the
    keyword names of its calls."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
        elif isinstance(const, tuple):   # a call's keyword names
            out |= {c for c in const if isinstance(c, str) and c.isidentifier()}
    return out


def _starts_processes(obj, module: types.ModuleType, seen: set) -> bool:
    """Whether obj (a function or class of module) reaches a process-starting name, following the
    module's own functions and classes it names."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    funcs = [m for _, m in inspect.getmembers(obj, inspect.isfunction)] if inspect.isclass(obj) else [obj]
    for func in funcs:
        code = getattr(inspect.unwrap(func), "__code__", None)
        if code is None:
            continue
        names = _names(code)
        if names & _STARTERS:
            return True
        for name in names:
            target = getattr(module, name, None)
            if ((inspect.isfunction(target) or inspect.isclass(target))
                    and getattr(target, "__module__", None) == module.__name__
                    and _starts_processes(target, module, seen)):
                return True
    return False


def _is_e2e(item: pytest.Item) -> bool:
    module = item.module
    if Path(module.__file__).stem in _E2E_MODULES or Path(module.__file__).parent.name in ("faults", "e2e"):
        return True
    seen: set = set()
    if _starts_processes(item.function, module, seen):
        return True
    fixturedefs = [d for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
    while fixturedefs:   # the fixtures it uses, transitively
        fixturedef = fixturedefs.pop()
        func = fixturedef.func
        fmod = inspect.getmodule(func)
        if fmod is None or not Path(getattr(fmod, "__file__", "/")).is_relative_to(_TESTS):
            continue
        if _starts_processes(func, fmod, seen):
            return True
        if "getfixturevalue" in _names(inspect.unwrap(func).__code__):   # params naming other fixtures
            for name in fixturedef.params or ():
                if isinstance(name, str):
                    fixturedefs += item.session._fixturemanager.getfixturedefs(name, item) or ()
    return False


def _group(nodeid: str) -> str:
    """The group of a test, from its node id: its module's stem, or the shared group it belongs to."""
    stem = Path(nodeid.split("::", 1)[0]).stem
    return _GROUPS.get(stem, stem)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_e2e(item):
            item.add_marker(pytest.mark.e2e)
        if item.originalname in EXCLUSIVE:
            item.add_marker(pytest.mark.exclusive)
    if os.environ.get("PYTEST_XDIST_WORKER"):   # the longest groups first (stable: each keeps its order)
        items.sort(key=lambda item: -GROUP_SECONDS.get(_group(item.nodeid), 1))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup``: whole groups (``_group``) to one worker each, handed out in collection
    order (the longest first). xdist's own loadgroup reads ``xdist_group`` marks by rewriting node
    ids, which pytest 9 no longer allows; the group here is derived from the node id instead."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


def _lock_path(config: pytest.Config) -> Path | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:   # not under xdist: nothing runs beside anything
        return None
    return config._tmp_path_factory.getbasetemp().parent / f"exclusive-{run}.lock"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Under xdist: an ``exclusive`` test holds the lock alone (setup, call and teardown); every other
    test holds it shared. A turnstile taken first keeps a waiting exclusive test from being starved
    by the other workers' back-to-back shared holds."""
    path = _lock_path(item.config)
    if path is None:
        return (yield)
    exclusive = item.get_closest_marker("exclusive") is not None
    with open(path.with_suffix(".turnstile"), "a") as turnstile, open(path, "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            return (yield)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request: pytest.FixtureRequest, model_root: Path) -> str:
    """A tiny checkpoint of each architecture (qwen3: tied embeddings, q/k norms; llama: untied)."""
    path = model_root / f"tiny-{request.param}"
    if not path.exists():
        make_model(path, preset="tiny", arch=request.param, seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen3(model_root: Path) -> str:
    path = model_root / "tiny-qwen3"
    if not path.exists():
        make_model(path, preset="tiny", arch="qwen3", seed=0)
    return str(path)


@pytest.fixture(scope="session")
def served_reference(tiny_qwen3: str):
    """The offline engine with the test deployments' engine settings (tests/serving.TEST_ENGINE_ARGS):
    a request served greedily by one of them must get exactly its tokens (batch-invariant)."""
    from pdserve.engine import LLM
    return LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=512)


@pytest.fixture(scope="session")
def default_model() -> str:
    """pdserve's default model (the real SmolLM2-135M-Instruct), fetched and converted once into the
    suite's PDSERVE_HOME (the CI keeps one for the whole run; xdist workers share it: the build
    holds a file lock, so only one converts). For tests about the default model itself: every
    other test runs the tiny model (``tiny_qwen3``, ``--model tiny``)."""
    from pdserve.engine.checkpoints import default_model as packaged
    from pdserve.engine.settings import pdserve_home
    return str(packaged.ensure(pdserve_home()))


@pytest.fixture
def user_home(tmp_path: Path) -> Path:
    """A fresh PDSERVE_HOME for a test that runs pdserve as a user would (and finds its processes by
    it), whose ``kernels`` is the suite's: a fresh home compiles the C++ kernels again, about 16 s
    of both cores each time (first-run builds are test_kernel_build's and the CI's first test's).
    The default model, where the suite's home has it converted, is the suite's too (linked into
    ``models/``): converting it again costs about 12 s per test."""
    from pdserve.engine.checkpoints.default_model import default_model_dir
    from pdserve.engine.layers import cpu_kernels
    from pdserve.engine.settings import pdserve_home

    cpu_kernels.load()   # built once into the suite's home (a no-op where kernels are off)
    home = tmp_path / "home"
    home.mkdir()
    suite = pdserve_home()
    shared = suite / "kernels"
    if shared.is_dir():
        (home / "kernels").symlink_to(shared, target_is_directory=True)
    model = default_model_dir(suite)
    if model.is_dir():
        mine = default_model_dir(home)
        mine.parent.mkdir(parents=True, exist_ok=True)
        mine.symlink_to(model, target_is_directory=True)
    return home


def random_prompts(n: int, min_len: int, max_len: int, vocab: int = 1024, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


_HF_CACHE: dict[tuple, list[list[int]]] = {}


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face transformers greedy continuations in float32: the correctness oracle (cached)."""
    key = (model_dir, tuple(map(tuple, prompts)), max_new_tokens)
    if key not in _HF_CACHE:
        import torch

        from pdserve.services.loadtest.offline import hf_greedy as reference
        _HF_CACHE[key] = reference(model_dir, prompts, max_new_tokens, torch.float32)
    return _HF_CACHE[key]


def assert_no_leak(llm_or_engine) -> None:
    stats = llm_or_engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


@pytest.fixture(scope="session")
def cost(tiny_qwen3: str) -> CostModel:
    """A fixed cost model (the input the simulator prices steps with) for the tiny model."""
    fits = {
        "prefill": KindFit({"const": 0.004, "prefill_tokens": 0.0004, "prefill_seqs": 0.0005,
                            "prefill_attention": 0.0002}, 0, 0.0),
        "decode": KindFit({"const": 0.006, "decode_seqs": 0.0004, "decode_context": 0.002}, 0, 0.0),
        "mixed": KindFit({"const": 0.006, "prefill_tokens": 0.0004, "prefill_seqs": 0.0005,
                          "prefill_attention": 0.0002, "decode_seqs": 0.0004, "decode_context": 0.002}, 0, 0.0),
    }
    engine = {"model": tiny_qwen3, "block_size": 16, "max_num_seqs": 64, "enable_prefix_caching": True,
              "max_model_len": None, "resolved_num_kv_blocks": 4096, "seed": 0}
    return CostModel(fits, kv_transfer_s_per_block=0.0005, export_s_per_block=0.0001, kv_bytes_per_block=4096,
                     engine=engine, model_config=json.loads((Path(tiny_qwen3) / "config.json").read_text()),
                     machine={"torch_threads": 1})
