"""Hub ids (ORG/NAME): a model in huggingface_hub's cache is used from there without the network
(as `vllm serve` does offline); one that is not, with the Hub unreachable, fails in seconds with
one line; a path that exists is never taken for a Hub id."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from pdserve.engine.checkpoints.hub import HubError, looks_like_hub_id
from pdserve.engine.checkpoints.resolve import resolve_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME in tmp_path, and a Hub endpoint nothing listens on."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    return tmp_path / "hf" / "hub"


def test_a_cached_model_is_used_without_the_network(offline_hub: Path, tiny_qwen3: str) -> None:
    repo = offline_hub / "models--acme--tiny-chat"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(tiny_qwen3, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    assert resolve_model("acme/tiny-chat") == str(snapshot)


def test_an_uncached_model_with_the_hub_unreachable_fails_fast(offline_hub: Path) -> None:
    start = time.monotonic()
    with pytest.raises(HubError) as err:
        resolve_model("acme/not-cached")
    assert time.monotonic() - start < 20
    assert str(err.value) == ("cannot reach the Hugging Face Hub at http://127.0.0.1:9 (ConnectError); download "
                              "acme/not-cached elsewhere and pass --model DIR, or set HF_ENDPOINT to a mirror")


def test_an_existing_path_is_not_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert looks_like_hub_id("Qwen/Qwen3-0.6B") and not looks_like_hub_id("models/mine")
    assert not looks_like_hub_id("a/b/c") and not looks_like_hub_id("../x")
