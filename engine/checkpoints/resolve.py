"""What ``--model`` (or ``LLM(model)``) names, turned into a checkpoint directory the engine
loads: nothing (the default model, fetched and converted on first use), a preset name (``tiny``:
a random-weight model for tests), a GGUF file (or a directory holding one), a Hugging Face Hub id
(``ORG/NAME``), or a local checkpoint directory."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from pdserve.engine.checkpoints import default_model, gguf_checkpoint, hub
from pdserve.engine.cache_dir import build_once
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.settings import pdserve_home

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
Report = Callable[[str], None]


RANDOM_MODELS = ("tiny", "small")   # presets with random weights, for tests and benchmarks


class ModelSpecError(ValueError):
    """``--model`` names nothing pdserve can load (one line saying what and how to fix it)."""


# Failures of the world rather than of the name: the index, the Hub, another process's build.
ModelResolveError = (default_model.ModelFetchError, hub.HubError, TimeoutError)


def resolve_model(spec: str | None, report: Report | None = None, flag: str = "--model") -> str:
    """The local checkpoint directory ``spec`` stands for, made or fetched on first use: raises
    ModelSpecError (the name or file is wrong) or one of ModelResolveError."""
    try:
        return _resolve(spec, report, flag)
    except gguf_checkpoint.GGUFError as e:
        raise ModelSpecError(f"{flag} {str(spec)[:200]}: {e}") from None


def _resolve(spec: str | None, report: Report | None, flag: str) -> str:
    if not spec:
        return str(default_model.ensure(pdserve_home(), report=report))
    if spec in RANDOM_MODELS and not Path(spec).exists():
        from pdserve.engine.model_maker import ensure_model   # lazy: torch only when a preset is made
        return str(ensure_model(spec))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(from_gguf(path, report))
    if hub.looks_like_hub_id(spec):
        return check_model_dir(str(hub.download(spec, report=report)), flag)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(from_gguf(ggufs[0], report))
        if ggufs:
            raise ModelSpecError(f"{flag} {spec} holds {len(ggufs)} GGUF files; pass one of them: "
                                 f"{', '.join(g.name for g in ggufs[:4])}")
    return check_model_dir(spec, flag)


def from_gguf(path: Path, report: Report | None = None) -> Path:
    """The cached checkpoint converted from GGUF file ``path`` (keyed by its content); a Q8_0
    file's linear weights stay int8 (the W8A16 path)."""
    summary = gguf_checkpoint.summarize(path)
    w8a16 = summary.quantization == "Q8_0"
    digest = _sha256(path)
    name = f"gguf-{path.stem[:60]}-{digest[:12]}-c{gguf_checkpoint.CONVERTER_VERSION}{'-w8a16' if w8a16 else ''}"
    target = pdserve_home() / "models" / name
    if not target.is_dir() and report:
        report(f"converting {path.name} ({summary.architecture}, {summary.quantization}) into {target}")
    return build_once(target, lambda out: gguf_checkpoint.convert(path, out, w8a16=w8a16, report=report))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def check_model_dir(path: str, flag: str = "--model") -> str:
    """The checkpoint directory, or ModelSpecError saying what is missing and how to fix it."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelSpecError(f"{flag} {path[:200]}: no such file or directory; give a local Hugging Face checkpoint "
                             f"directory, a .gguf file, a Hub id (ORG/NAME), `tiny`, or leave {flag} out for "
                             f"the default model ({default_model.DEFAULT_MODEL.name})")
    if not p.is_dir():
        raise ModelSpecError(f"{flag} {path[:200]} is a file but not a .gguf; give the checkpoint's directory")
    if not (p / "config.json").is_file():
        raise ModelSpecError(f"{flag} {path[:200]} is not a Hugging Face checkpoint directory: it has no "
                             f"config.json (and no .gguf file)")
    try:
        ModelConfig.from_dir(p)
    except (ValueError, KeyError) as e:   # an architecture or setting the engine does not run
        raise ModelSpecError(f"{flag} {path[:200]}: {str(e)[:200]}") from None
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ModelSpecError(f"{flag} {path[:200]} has no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}): copy "
                             f"the checkpoint's tokenizer files into it")
    if not any(p.glob("*.safetensors")):
        raise ModelSpecError(f"{flag} {path[:200]} has no *.safetensors weights; pdserve loads safetensors "
                             f"checkpoints and GGUF files")
    return str(p)
