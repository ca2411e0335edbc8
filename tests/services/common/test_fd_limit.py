"""services/common/fd_limit.py: the router raises its open-file soft limit at start-up, and the HTTP
API's connection cap (services/api/http_connections.py) follows the limit in force when its server
starts, not the one at import. Each case runs in a child process whose limits are lowered first."""
from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from pdserve.services.api.http_connections import MAX_HTTP_CONNECTIONS, connection_cap

# In the child: import the HTTP API first (its cap must not be fixed then), raise, report.
CHILD = """
import json, logging, resource, sys
from pdserve.services.api.http_connections import bounded_protocol, connection_cap
from pdserve.services.common.fd_limit import raise_fd_limit
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
before = connection_cap()
soft = raise_fd_limit()
print(json.dumps({"before": before, "returned": soft, "limits": resource.getrlimit(resource.RLIMIT_NOFILE),
                  "cap": connection_cap(), "protocol_cap": bounded_protocol().max_connections}))
"""


def run_child(soft: int, hard: int) -> tuple[dict, str]:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    out = subprocess.run([sys.executable, "-c", CHILD], preexec_fn=lower, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout), out.stderr


def _hard() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 65535 if hard == resource.RLIM_INFINITY else hard


@pytest.mark.skipif(_hard() < 2048, reason="the hard open-file limit is too low to raise anything")
def test_the_soft_limit_is_raised_to_the_hard_one_and_the_cap_follows() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = min(_hard(), 65535)
    got, log = run_child(256, hard)
    assert got["before"] == 64                       # a quarter of 256, at import
    assert got["returned"] == want and got["limits"] == [want, hard]
    assert got["cap"] == got["protocol_cap"] == min(MAX_HTTP_CONNECTIONS, want // 4)
    assert "raised the open-file limit (RLIMIT_NOFILE) from 256 to" in log


def test_a_low_hard_limit_is_used_and_warned_about() -> None:
    got, log = run_child(200, 1000)
    assert got["returned"] == 1000 and got["limits"] == [1000, 1000]
    assert got["cap"] == got["protocol_cap"] == 250
    assert "WARNING the open-file limit is 1000 (hard limit 1000)" in log and "ulimit -n" in log


def test_a_soft_limit_at_the_hard_one_is_left_as_it_is() -> None:
    got, log = run_child(1000, 1000)
    assert got["limits"] == [1000, 1000] and "raised" not in log


def test_the_cap_is_a_quarter_of_the_limit_up_to_its_maximum() -> None:
    assert MAX_HTTP_CONNECTIONS == 4096
    assert connection_cap(1024) == 256 and connection_cap(20000) == 4096 and connection_cap(16) == 16
    assert connection_cap(resource.RLIM_INFINITY) == MAX_HTTP_CONNECTIONS
