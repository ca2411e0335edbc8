"""A request's priority on the wire (common.proto SamplingParams.priority, services/common/proto_convert.py)
and its validation (engine SamplingParams)."""
from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.sampling_params import PRIORITY_RANGE
from pdserve.v1 import common_pb2
from pdserve.services.common.proto_convert import params_from_proto, params_to_proto


@pytest.mark.parametrize("priority", [0, 1, -1, 7, 2**31 - 1, -(2**31)])
def test_priority_round_trips(priority: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, priority=priority)
    msg = params_to_proto(params)
    assert msg.HasField("priority") == (priority != 0)    # 0, the default, stays unset
    back = params_from_proto(common_pb2.SamplingParams.FromString(msg.SerializeToString()))
    assert back == params


def test_unset_priority_reads_as_the_default() -> None:
    assert params_from_proto(common_pb2.SamplingParams(max_tokens=3)).priority == 0


@pytest.mark.parametrize("priority", [2**31, -(2**31) - 1, True, 1.0, "1", None])
def test_priority_outside_the_int32_range_or_not_an_int_is_refused(priority) -> None:
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=priority).validate()


def test_priority_in_range_validates() -> None:
    """What validate() accepts is exactly the wire field's range: int32, the bounds included, and every
    value it accepts reaches the other side as itself."""
    field = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name["priority"]
    assert field.type == field.TYPE_INT32
    assert PRIORITY_RANGE == (-(2**31), 2**31 - 1)
    for priority in (-(2**31), -1, 0, 3, 2**31 - 1):
        params = SamplingParams(priority=priority)
        params.validate()   # raises ValueError where refused
        wire = common_pb2.SamplingParams.FromString(params_to_proto(params).SerializeToString())
        assert wire.priority == priority and params_from_proto(wire).priority == priority
