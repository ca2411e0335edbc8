"""A request's scheduling class and the SLO policy's arithmetic (services/router/slo.py), and the
doors' mapping of bad scheduling fields to a clear error. Over real processes:
tests/e2e/test_slo_admission.py."""
from __future__ import annotations

import math

import pytest

from pdserve.services.api.grpc_router import service_class
from pdserve.services.api.openai_protocol import HTTPError, _service_class
from pdserve.services.api.request_limits import InvalidRequest
from pdserve.services.router.admission import Ticket
from pdserve.services.router.slo import (MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, ServiceClass, SloPolicy,
    predicted_wait_ms, retry_after_s, step_ms_with_one_more)
from pdserve.v1 import router_pb2


def test_a_service_class_is_checked_and_gives_its_ticket() -> None:
    service = ServiceClass(priority=-3, client="alice", ttft_ms=500.0, tpot_ms=60, principal="team-a")
    assert service.ticket == Ticket(-3, "team-a")   # the fair share is the API key's, not the `user` sent
    assert ServiceClass(client="bob", principal="team-a").ticket == Ticket(0, "team-a")
    # sessions live inside their principal: another key's holder naming the same session gets another one
    assert ServiceClass(session="s1", principal="a").session_key != ServiceClass(session="s1", principal="b").session_key
    assert ServiceClass().session_key == ""
    for kwargs, field in ((dict(priority=2 ** 31), "priority"), (dict(priority=True), "priority"),
                          (dict(client="x" * 257), "user"), (dict(ttft_ms=0.0), "slo_ttft_ms"),
                          (dict(tpot_ms=float("nan")), "slo_tpot_ms"), (dict(ttft_ms=1e9), "slo_ttft_ms")):
        with pytest.raises(ValueError, match=field):
            ServiceClass(**kwargs)


def test_a_requests_own_targets_are_never_tighter_than_the_deployments() -> None:
    policy = SloPolicy(admission=True, ttft_ms=500.0, tpot_ms=0.0)
    assert policy.ttft_target_ms(ServiceClass()) == 500.0
    assert policy.ttft_target_ms(ServiceClass(ttft_ms=200.0)) == 500.0     # tighter: the deployment's
    assert policy.ttft_target_ms(ServiceClass(ttft_ms=2000.0)) == 2000.0   # looser: its own
    assert policy.tpot_target_ms(ServiceClass()) is None
    assert policy.tpot_target_ms(ServiceClass(tpot_ms=40.0)) == 40.0
    assert SloPolicy(tpot_ms=50.0).tpot_target_ms(ServiceClass(tpot_ms=1e-6)) == 50.0


def test_predictions_and_retry_hints() -> None:
    assert predicted_wait_ms(0, 10.0) == 0.0
    assert predicted_wait_ms(5, 0.0) == 0.0               # no admission seen yet: unknown, not infinite
    assert predicted_wait_ms(5, 10.0) == pytest.approx(500.0)
    assert retry_after_s(30.0) == MIN_RETRY_AFTER_S
    assert retry_after_s(2500.0) == pytest.approx(2.5)
    assert retry_after_s(math.inf) == MAX_RETRY_AFTER_S
    assert step_ms_with_one_more(base_ms=5.0, ms_per_seq=0.5, running=9) == pytest.approx(10.0)


def test_both_doors_refuse_bad_scheduling_fields_naming_them() -> None:
    assert service_class(router_pb2.GenerateRequest(priority=2, user="bob", slo_ttft_ms=300)) == \
        ServiceClass(2, "bob", 300.0, None)
    with pytest.raises(InvalidRequest) as err:
        service_class(router_pb2.GenerateRequest(slo_tpot_ms=-5))
    assert err.value.field == "slo_tpot_ms"
    with pytest.raises(InvalidRequest) as err:
        service_class(router_pb2.GenerateRequest(session_id="s" * 300))
    assert err.value.field == "session_id"
    assert _service_class({"priority": 1, "user": "u", "slo_ttft_ms": 250}) == ServiceClass(1, "u", 250.0, None)
    assert _service_class({"session_id": "chat-1"}).session_key == "chat-1"
    for body, field in (({"priority": "high"}, "priority"), ({"priority": 1.5}, "priority"),
                        ({"slo_ttft_ms": -1}, "slo_ttft_ms"), ({"user": 7}, "user"),
                        ({"session_id": 7}, "session_id"), ({"session_id": "s" * 300}, "session_id")):
        with pytest.raises(HTTPError) as http:
            _service_class(body)
        assert http.value.status == 400 and field in str(http.value), body


def test_while_overloaded_lower_classes_and_clients_over_their_share_yield() -> None:
    from pdserve.services.router.slo import OverloadShares
    shares = OverloadShares(window_s=10.0, overload_s=1.0)
    a, b, low = Ticket(0, "a"), Ticket(0, "b"), Ticket(1, "a")
    for t in range(6):                      # a was admitted 6 times, b once
        shares.admitted(a, float(t))
    shares.admitted(b, 6.0)
    assert shares.yields(a, 7.0) is None    # not overloaded: nobody yields
    shares.refused(b, 7.0)                  # overloaded from now (for overload_s)
    assert "fair share" in shares.yields(a, 7.5)
    assert shares.yields(b, 7.5) is None
    assert "higher priority" in shares.yields(low, 7.5)
    assert shares.yields(a, 9.0) is None    # the overload has passed
