"""The once-per-machine kernel build: cached, locked across builders, optional."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from pdserve.engine import kernel_build
from pdserve.engine.layers import cpu_kernels

SOURCE = 'extern "C" int pd_answer() { return 42; }\n'


def test_concurrent_builders_compile_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    if kernel_build.find_compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    src = tmp_path / "answer.cpp"
    src.write_text(SOURCE)
    results: list[Path | None] = []
    caplog.set_level(logging.INFO, logger="pdserve.engine.kernel_build")
    threads = [threading.Thread(target=lambda: results.append(
        kernel_build.build_library("answer", [src], ["-O1", "-shared", "-fPIC"]))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1 and results[0] is not None and results[0].is_file()
    assert sum("building" in r.message for r in caplog.records) == 1
    # cached: a new source text is a new key, the old library stays
    src.write_text(SOURCE.replace("42", "43"))
    again = kernel_build.build_library("answer", [src], ["-O1", "-shared", "-fPIC"])
    assert again is not None and again != results[0]


def test_missing_compiler_builds_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    src = tmp_path / "answer.cpp"
    src.write_text(SOURCE)
    assert kernel_build.build_library("answer", [src], ["-shared", "-fPIC"]) is None


def test_kernels_off_falls_back_to_torch(tiny_qwen3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PDSERVE_CPU_KERNELS=0: no library, the torch backend and sampler, HF-exact greedy output."""
    from pdserve.engine import LLM, SamplingParams
    from tests.conftest import hf_greedy, random_prompts
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_amx", None)
    assert cpu_kernels.load() is None
    llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=128)
    runner = llm.engine.runner
    assert runner.backend.name == "torch" and not runner.sampler.native
    prompts = random_prompts(3, 4, 30, seed=21)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(tiny_qwen3, prompts, 8)
