"""The process's file-descriptor limit, raised at start-up as vLLM's server raises its own.

Every HTTP connection, gRPC stream peer and shared-memory segment holds a descriptor, and the
HTTP API takes at most a quarter of the soft limit in connections
(services/api/http_connections.connection_cap): at the usual default soft limit of 1,024 that is
256, fewer than ``vllm bench serve`` opens at its defaults (every request at once, one connection
each). The soft limit may be raised up to the hard limit without privileges.
"""
from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

TARGET_FDS = 65535   # vLLM's target (set_ulimit)
LOW_FDS = 16384      # below it the HTTP API takes fewer than its 4,096 connections (a quarter of the limit)


def raise_fd_limit(target: int = TARGET_FDS, low: int = LOW_FDS) -> int:
    """Raise the soft RLIMIT_NOFILE to target, or to the hard limit if lower; never lowers it.
    Returns the soft limit now in force; a warning if it stays below low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, exc)
        else:
            log.info("raised the open-file limit (RLIMIT_NOFILE) from %d to %d", soft, want)
            soft = want
    if soft != resource.RLIM_INFINITY and soft < low:
        log.warning("the open-file limit is %d (hard limit %s): fewer connections will be served at once; "
                    "raise it with `ulimit -n` (or LimitNOFILE= under systemd, --ulimit nofile= under Docker) "
                    "to at least %d", soft, "unlimited" if hard == resource.RLIM_INFINITY else hard, low)
    return soft
