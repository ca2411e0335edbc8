"""`pdserve ray scale` under the internal plane's rule (services/ray_deploy/scale.py check_plane):
a router or new workers off loopback without mutual TLS are refused before any worker starts or
any proof of the cluster token is sent, unless --insecure-internal-plane. Ray itself is replaced
by stand-ins for the three calls scale() makes before it starts a worker."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import ray

from pdserve.services.ray_deploy import scale as scale_mod
from pdserve.services.common.security import new_token


class _Started(Exception):
    """Raised by the stand-in of _start_worker: scale() got past its checks."""


def _fake_ray(monkeypatch, tmp_path, router_address: str, worker_host: str, tls: bool = False) -> list[str]:
    tmp_path.mkdir(exist_ok=True)
    token = tmp_path / "token"
    token.write_text(new_token())
    token.chmod(0o600)
    spec = {"cluster_token_file": str(token), "host": worker_host, "tls": None}
    if tls:
        from tests.certs import make_ca_and_cert
        files = make_ca_and_cert(tmp_path)
        spec["tls"] = [str(files["cert.pem"]), str(files["key.pem"]), str(files["ca.pem"])]
    remote = lambda value: SimpleNamespace(remote=lambda *a: value)   # noqa: E731 - handle.method.remote()
    handle = SimpleNamespace(info=remote({"address": router_address}), launch_spec=remote(json.dumps(spec)))
    started: list[str] = []

    def start(template, actor, namespace, timeout_s):
        started.append(actor)
        raise _Started(actor)

    monkeypatch.setattr(scale_mod, "_workers", lambda name, ns: {"prefill": ["d-prefill-0"], "decode": ["d-decode-0"]})
    monkeypatch.setattr(scale_mod, "_start_worker", start)
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: handle)
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    return started


@pytest.mark.parametrize("router, host, needle", [
    ("10.0.0.5:50051", "127.0.0.1", "would reach 10.0.0.5 (not loopback)"),
    ("127.0.0.1:50051", "node-ip", "would bind node-ip (not loopback)"),
])
def test_ray_scale_refuses_a_plane_off_loopback_without_tls(monkeypatch, tmp_path, router, host, needle) -> None:
    started = _fake_ray(monkeypatch, tmp_path, router, host)
    with pytest.raises(ValueError, match="--insecure-internal-plane") as err:
        scale_mod.scale("d", "ns", {"prefill": 2, "decode": None})
    assert needle in str(err.value) and "--tls-cert" in str(err.value)
    assert started == []                                   # nothing started, no membership call made
    with pytest.raises(scale_mod.ScaleError, match="d-prefill-1"):   # the flag: it goes on (warned)
        scale_mod.scale("d", "ns", {"prefill": 2, "decode": None}, insecure_plane=True)
    assert started == ["d-prefill-1"]
    started = _fake_ray(monkeypatch, tmp_path / "tls", router, host, tls=True)   # the deployment's TLS: it goes on
    with pytest.raises(scale_mod.ScaleError):
        scale_mod.scale("d", "ns", {"prefill": 2, "decode": None})
    assert started == ["d-prefill-1"]


def test_loopback_needs_no_flag_and_the_cli_flag_reaches_scale(monkeypatch, tmp_path) -> None:
    from pdserve.services.cli.commands import build_parser
    from pdserve.services.cli import ray_cmd as cli
    started = _fake_ray(monkeypatch, tmp_path, "127.0.0.1:50051", "127.0.0.1")
    with pytest.raises(scale_mod.ScaleError):
        scale_mod.scale("d", "ns", {"prefill": None, "decode": 2})
    assert started == ["d-decode-1"]
    seen = {}
    monkeypatch.setattr(cli, "_connect", lambda address, namespace: None)
    monkeypatch.setattr(scale_mod, "scale", lambda *a, **kw: seen.update(kw) or scale_mod.ScaleResult())
    for argv, expected in ((["ray", "scale", "--prefill-workers", "2"], False),
                           (["ray", "scale", "--prefill-workers", "2", "--insecure-internal-plane"], True)):
        args = build_parser("ray").parse_args(argv)
        assert args.func(args) == 0 and seen["insecure_plane"] is expected
