"""The namespace harness's helpers (services/deployment/netns.py): subnets, tbf sizing, input
checks, and the sweep of what a dead process left."""
from __future__ import annotations

import ipaddress
import os
import subprocess

import pytest

from pdserve.services.deployment import netns


def test_subnets_differ_per_counter_and_per_pid_and_skip_used_ones() -> None:
    nets = {netns.pick_subnet(pid, c) for pid in (100, 101, 4095) for c in range(16)}
    assert len(nets) == 48
    assert all(n.prefixlen == 24 and n.subnet_of(ipaddress.IPv4Network("10.0.0.0/8")) for n in nets)
    first = netns.pick_subnet(7, 0)
    other = netns.pick_subnet(7, 0, used=[ipaddress.IPv4Network("10.0.0.0/9")])
    assert other != first and not other.overlaps(ipaddress.IPv4Network("10.0.0.0/9"))


def test_tbf_burst_holds_two_gso_packets_and_two_ms_at_high_rates() -> None:
    assert netns.tbf_burst_bytes(200_000_000) == netns.TBF_MIN_BURST
    assert netns.tbf_burst_bytes(1_000_000_000) == 250_000
    assert netns.tbf_burst_bytes(10_000_000_000) == 2_500_000


@pytest.mark.parametrize("args, field", [((0,), "num_hosts"), ((2, [None]), "rate_bps"), ((2, 100), "rate_bps")])
def test_bad_layouts_are_refused_naming_the_field(args, field) -> None:
    with pytest.raises(ValueError, match=field):
        netns.HostNetwork(*args)


def test_available_gives_a_reason_when_it_says_no() -> None:
    ok, why = netns.available()
    assert ok == (why == "")


@pytest.mark.skipif(not netns.available()[0], reason=f"no network namespaces: {netns.available()[1]}")
def test_sweep_removes_only_namespaces_of_dead_pids() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"{netns.PREFIX}-{dead.pid}-0-br", f"{netns.PREFIX}-{os.getpid()}-99-0"
    try:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
        swept = netns.sweep_stale()
        assert stale in swept and live not in swept
        assert live in netns.namespaces() and stale not in netns.namespaces()
    finally:
        for name in (stale, live):
            netns.delete_namespace(name)
