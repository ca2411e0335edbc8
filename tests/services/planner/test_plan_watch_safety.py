"""`pdserve plan --watch` under a hostile network (services/planner/watch.py): the scrape sends the
metrics token and is refused without it, a body past the bound or one that drips is given up
within the deadline, malformed lines are skipped (counted, said once) instead of ending the loop,
--apply off loopback needs the token, and a non-loopback --router needs mutual TLS."""
from __future__ import annotations

import io
import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter

from pdserve.services.cli.commands import main
from pdserve.services.common.metrics import MetricsServer, _handler
from pdserve.services.planner.plan import PlanConfig
from pdserve.services.planner.watch import Planner, Scrape, WatchConfig, check_watch_security, fetch_metrics
from pdserve.services.common.security import Credentials, TLSFiles
from tests.certs import make_ca_and_cert

TOKEN = "t" * 32


@pytest.fixture
def metrics_server():
    """The real /metrics server of every pdserve process, on loopback, with a token."""
    registry = CollectorRegistry()
    Counter("pdserve:request_success", "finished", registry=registry).inc(7)
    server = MetricsServer(("127.0.0.1", 0), _handler(registry, TOKEN))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


class RawServer:
    """A loopback server that answers every connection with respond(conn), for hostile answers."""

    def __init__(self, respond) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.respond, self.stop = respond, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                try:
                    self.respond(conn, self.stop)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.sock.close()


def test_the_scrape_sends_the_token_and_says_which_flag_when_refused(metrics_server) -> None:
    with pytest.raises(ValueError, match="refused the scrape \\(401\\).*--metrics-token-file"):
        fetch_metrics(metrics_server)
    scrape = Scrape.parse(fetch_metrics(metrics_server, TOKEN), at=0.0)
    assert scrape.counters["request_success_total"] == 7.0 and scrape.malformed == 0


def test_a_body_past_the_bound_or_one_that_drips_is_given_up_in_time() -> None:
    def endless(conn, stop):
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
        while not stop.is_set():
            conn.sendall(b"x 1\n" * 4096)

    def drip(conn, stop):
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
        while not stop.is_set():
            conn.sendall(b"#")
            stop.wait(0.2)

    for respond, needle, kwargs in ((endless, "larger than 100000 bytes", {"limit": 100_000}),
                                    (drip, "no complete answer within 1s", {"timeout_s": 1.0})):
        server = RawServer(respond)
        try:
            t0 = time.monotonic()
            with pytest.raises(ValueError, match=needle):
                fetch_metrics(server.address, **kwargs)
            assert time.monotonic() - t0 < 30
        finally:
            server.close()


def test_malformed_lines_are_skipped_counted_and_said_once(cost) -> None:
    body = (b"HTTP/1.0 200 OK\r\n\r\n# HELP x\npdserve:request_success_total 5\nno-value-here\n"
            b"pdserve:prompt_tokens_total nan\npdserve:generation_tokens_total 1e999\n"
            b'pdserve:time_to_first_token_seconds_bucket{le="junk"} 3\npdserve:prompt_tokens_total 50\n')
    server = RawServer(lambda conn, stop: conn.sendall(body))
    out = io.StringIO()
    try:
        watch = WatchConfig(watch=True, router="127.0.0.1:1", router_metrics=server.address)
        planner = Planner(cost, PlanConfig(profile="unused", slos=("ttft:500",)), watch, Credentials(), out)
        first, second = planner.scrape(), planner.scrape()
    finally:
        server.close()
    assert first.counters == {"request_success_total": 5.0, "prompt_tokens_total": 50.0}   # no NaN, no inf summed
    assert first.malformed == second.malformed == 2 and planner.malformed == 4
    assert out.getvalue().count("malformed line(s)") == 1 and "'no-value-here'" in out.getvalue()


def test_apply_off_loopback_needs_the_metrics_token() -> None:
    remote = WatchConfig(watch=True, router="127.0.0.1:50051", router_metrics="10.0.0.5:9100", apply=True)
    with pytest.raises(ValueError, match="needs the router's metrics token.*--metrics-token-file"):
        check_watch_security(remote, Credentials(), None)
    check_watch_security(remote, Credentials(), TOKEN)                       # authenticated: fine
    check_watch_security(WatchConfig(watch=True, router="127.0.0.1:50051", router_metrics="10.0.0.5:9100"),
                         Credentials(), None)                                # no --apply: only printed
    check_watch_security(WatchConfig(watch=True, router="127.0.0.1:50051", router_metrics="127.0.0.1:9100",
                                     apply=True), Credentials(), None)       # loopback


def test_a_router_off_loopback_needs_mutual_tls(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "WARNING")   # main() sets it; restored after the test
    argv = ["plan", "--watch", "--router", "10.0.0.5:50051", "--router-metrics", "127.0.0.1:9100",
            "--profile", str(tmp_path / "missing.json"), "--slo", "ttft:500"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the planner would reach 10.0.0.5 (not loopback) without mutual TLS" in err
    assert "--tls-cert" in err and "--insecure-internal-plane" in err
    assert main([*argv, "--insecure-internal-plane"]) == 2        # past the rule: on to the missing profile
    assert "missing.json" in capsys.readouterr().err
    certs = make_ca_and_cert(tmp_path)
    tls = TLSFiles(certs["cert.pem"], certs["key.pem"], certs["ca.pem"])
    check_watch_security(WatchConfig(watch=True, router="10.0.0.5:50051", router_metrics="127.0.0.1:9100"),
                         Credentials(None, tls), None)              # with mutual TLS: fine
