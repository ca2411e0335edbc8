"""Traces under the internal plane's rule (services/common/tracing.py): a collector off loopback gets TLS
(the deployment's certificate, or https://), plaintext there is refused at start unless
--otlp-insecure, and the client's `user` is exported only as a keyed hash."""
from __future__ import annotations

import ipaddress
import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.services.common import tracing
from pdserve.services.deployment.certs import CertsConfig, make_certs
from pdserve.services.common.security import Credentials, TLSFiles, new_token

REPO_ROOT = Path(__file__).resolve().parents[3]


def _tls(tmp_path: Path, host: str = "127.0.0.1") -> TLSFiles:
    made = make_certs(CertsConfig(out=str(tmp_path / "certs"), hosts=(host,)))
    cert, key = made.hosts[host.replace(":", "_")]
    return TLSFiles(cert, key, made.ca)


def test_the_exporter_channel_follows_the_plane_rule(tmp_path, caplog) -> None:
    assert tracing.exporter_security("127.0.0.1:4317") == (True, None)           # loopback: plaintext
    assert tracing.exporter_security("localhost:4317", Credentials(None, _tls(tmp_path)))[0] is True
    plaintext, creds = tracing.exporter_security("10.1.2.3:4317", Credentials(None, _tls(tmp_path, "10.1.2.3")))
    assert plaintext is False and creds is not None                               # the deployment's TLS
    plaintext, creds = tracing.exporter_security("https://otel.example:4317")
    assert plaintext is False and creds is not None                               # system roots
    for endpoint in ("10.1.2.3:4317", "http://otel.example:4317", "[fd00::9]:4317"):
        with pytest.raises(ValueError, match="not loopback and this process has no TLS.*--otlp-insecure"):
            tracing.exporter_security(endpoint, Credentials(new_token()))
    with caplog.at_level(logging.WARNING, logger="pdserve.services.common.tracing"):
        assert tracing.exporter_security("10.1.2.3:4317", Credentials(), insecure=True) == (True, None)
    assert "in clear" in caplog.text


def test_configure_refuses_a_plaintext_collector_off_loopback() -> None:
    try:
        with pytest.raises(ValueError, match="--otlp-insecure"):
            tracing.configure("pdserve-router", "10.1.2.3:4317", credentials=Credentials(new_token()))
        assert not tracing.enabled()
    finally:
        tracing.shutdown()


def test_the_user_is_exported_only_as_a_keyed_hash(monkeypatch) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    token = new_token()
    try:
        assert tracing.configure("pdserve-router", "127.0.0.1:9", credentials=Credentials(token))
        key = tracing._hash_key
    finally:
        tracing.shutdown()   # nothing was exported: nothing to flush
    # the same user, the same hash in every process of the deployment (the key comes from its token)
    assert key == tracing.hash_key(Credentials(token)) != tracing.hash_key(Credentials(new_token()))
    memory, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "_hash_key", key)
    span = tracing.start("pdserve.request", request_id="r1", user="alice@example.com")
    tracing.event(span, "step", user="alice@example.com")
    tracing.end(span, user="bob")
    provider.shutdown()
    (span,) = memory.get_finished_spans()
    attributes, event = dict(span.attributes), dict(span.events[0].attributes)
    assert "user" not in attributes and "user" not in event and attributes["request_id"] == "r1"
    assert event["user_hash"] != attributes["user_hash"] and len(attributes["user_hash"]) == 32
    assert "alice" not in json.dumps({**attributes, **event}) and "bob" not in json.dumps(attributes)


def _local_address() -> str | None:
    """This machine's address on its route out (no packet is sent), if it has one off loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ipaddress.ip_address(ip).is_loopback or ip == "0.0.0.0" else ip


def test_spans_reach_a_collector_off_loopback_over_mutual_tls(tmp_path) -> None:
    ip = _local_address()
    if ip is None:
        pytest.skip("no address off loopback on this machine")
    tls = _tls(tmp_path, ip)
    out = tmp_path / "spans.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tests.services.common.tls_collector", ip, str(tls.cert),
                             str(tls.key), str(tls.ca), str(out)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        try:
            assert tracing.configure("pdserve-router", f"{ip}:{port}", credentials=Credentials(new_token(), tls))
            tracing.end(tracing.start("pdserve.request", request_id="over-tls", user="carol"))
        finally:
            tracing.shutdown()   # flushes the batch through the TLS channel
        deadline = time.monotonic() + 30
        while not (out.exists() and "over-tls" in out.read_text()):
            assert time.monotonic() < deadline, "the span never reached the TLS collector"
            time.sleep(0.2)
        span = json.loads(out.read_text().splitlines()[0])
        keys = {a["key"] for a in span["attributes"]}
        assert "user_hash" in keys and "user" not in keys and "carol" not in out.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=30)
