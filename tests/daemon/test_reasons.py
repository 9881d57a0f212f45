"""The daemon's typed refusal reasons are the proto's ErrorReason, name for name."""

from __future__ import annotations

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.errors import Reason


def test_reasons_are_the_protos_error_reasons() -> None:
    on_wire = set(pb.ErrorReason.keys()) - {"ERROR_REASON_UNSPECIFIED"}
    assert {r.name for r in Reason} == on_wire
    assert all(r.value == r.name for r in Reason)  # the ErrorInfo reason is the name
