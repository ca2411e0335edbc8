"""Hugging Face Hub ids (``ORG/NAME``), as vLLM takes them: the checkpoint is downloaded with
``huggingface_hub`` into its usual cache (``HF_HOME``, ``HF_TOKEN``, ``HF_ENDPOINT`` from the
environment), or taken from that cache when it is there; an unreachable Hub fails in seconds
with one line."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from pdserve.engine.settings import ENV

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
CONNECT_TIMEOUT_S = 5.0
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"]


class HubError(RuntimeError):
    """The Hub id could not be resolved to a local checkpoint (one line saying why)."""


def looks_like_hub_id(text: str) -> bool:
    """ORG/NAME, as on the Hugging Face Hub (and not an existing local path)."""
    return bool(HUB_ID.fullmatch(text)) and not Path(text).exists()


def _from_environment() -> tuple[str | None, str | None]:
    """HF_ENDPOINT and the hub cache (HF_HUB_CACHE, else HF_HOME/hub) as the environment says now."""
    home = ENV.HF_HOME.get()
    return ENV.HF_ENDPOINT.get() or None, ENV.HF_HUB_CACHE.get() or (str(Path(home) / "hub") if home else None)


def download(repo_id: str, revision: str | None = None, report: Callable[[str], None] | None = None) -> Path:
    """The local snapshot directory of ``repo_id`` (at ``revision``), downloaded if not cached."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    say = report or (lambda _text: None)
    # read at call time, not at huggingface_hub's import: a process may set them after importing it
    endpoint, cache_dir = _from_environment()
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=WEIGHT_PATTERNS,
                                      local_files_only=True, cache_dir=cache_dir))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        pass   # not cached: ask the Hub
    api = HfApi(endpoint=endpoint)
    try:
        info = api.model_info(repo_id, revision=revision, timeout=CONNECT_TIMEOUT_S)
    except RepositoryNotFoundError:
        raise HubError(f"{repo_id}: no such model on {api.endpoint} (or it is gated: set HF_TOKEN)") from None
    except HfHubHTTPError as e:
        raise HubError(f"{repo_id}: the Hub at {api.endpoint} answered {str(e).splitlines()[0][:120]}") from None
    except Exception as e:   # connection refused, DNS, TLS, timeout: whatever the HTTP stack raises
        raise HubError(f"cannot reach the Hugging Face Hub at {api.endpoint} ({type(e).__name__}); download "
                       f"{repo_id} elsewhere and pass --model DIR, or set HF_ENDPOINT to a mirror") from None
    say(f"downloading {repo_id} ({(info.sha or revision or 'main')[:12]}) from {api.endpoint}")
    try:
        return Path(snapshot_download(repo_id, revision=info.sha or revision, allow_patterns=WEIGHT_PATTERNS,
                                      etag_timeout=CONNECT_TIMEOUT_S, endpoint=endpoint, cache_dir=cache_dir))
    except Exception as e:
        raise HubError(f"downloading {repo_id} from {api.endpoint} failed ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
