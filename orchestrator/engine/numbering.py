"""Which enum numbering a worker speaks, and its wire values read by that numbering; pure.

Two TensorRT-LLM servers number the same enums differently (docs/openengine-additions.md, "Two numberings"):
- revision 1 (tensorrt_llm/grpc/openengine, merged) vendors openengine v0.1.0: ERROR_CODE_INTERNAL = 11,
  HEALTH_STATE_NOT_READY = 4, no DRAINING anywhere. It reports ServerInfo.schema_revision 1 (bindings'
  SCHEMA_REVISION) and, when it sets KvConnectorInfo, schema_version at field 8.
- the sibling server (tensorrt_llm/openengine, open PR #16336) pins openengine a66ff6f, which keeps the drain
  surface: ERROR_CODE_DRAINING = 11, ERROR_CODE_INTERNAL = 12, HEALTH_STATE_DRAINING = 4,
  HEALTH_STATE_NOT_READY = 5, KvConnectorInfo.supports_drain = 8 and schema_version = 9. It reports
  ServerInfo.schema_revision 3 (that openengine's SCHEMA_REVISION) and always sets KvConnectorInfo with
  schema_version at field 9, a number v0.1.0 leaves unused.

So the server says which it speaks: schema_revision >= 3, or a KvConnectorInfo that carries field 9 (which
still holds if openengine's relabelling of those fields as revision 1, 8ce850d, reaches the sibling's pin).
Facts and commits: tests/e2e/test_trtllm_conformance.py ("numbering-r1", "numbering-sibling").

Every value either numbering does not define is read as unknown, never looked up by name: a worker that sends
one is degraded (an unknown health state is not ready; an unknown error code is a 502 naming its number).
"""

from __future__ import annotations

import enum

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from orchestrator.openengine.v1 import error_pb2, lifecycle_pb2, server_pb2
from orchestrator.transport.errors import ERROR_CODE_DRAINING

_HS = lifecycle_pb2.HealthState
_EC = error_pb2.ErrorCode

_DRAIN_SCHEMA_VERSION_FIELD = 9  # KvConnectorInfo.schema_version in the drain numbering (supports_drain is 8)


class Numbering(enum.Enum):
    V0_1_0 = "openengine v0.1.0"  # revision 1 TensorRT-LLM, and every worker that says nothing else
    DRAIN = "openengine a66ff6f"  # the sibling server: DRAINING states and codes, INTERNAL moved to 12


class Health(enum.StrEnum):
    """A health state as both numberings mean it; UNKNOWN for a number the worker's numbering lacks."""

    UNSPECIFIED = "unspecified"
    STARTING = "starting"
    READY = "ready"
    DEGRADED = "degraded"
    NOT_READY = "not_ready"
    DRAINING = "draining"
    UNKNOWN = "unknown"

    @property
    def serving(self) -> bool:
        return self in (Health.READY, Health.DEGRADED)

    @property
    def wire_name(self) -> str:
        return f"HEALTH_STATE_{self.name}"


_HEALTH: dict[Numbering, dict[int, Health]] = {
    Numbering.V0_1_0: {_HS.HEALTH_STATE_UNSPECIFIED: Health.UNSPECIFIED, _HS.HEALTH_STATE_STARTING: Health.STARTING,
                       _HS.HEALTH_STATE_READY: Health.READY, _HS.HEALTH_STATE_DEGRADED: Health.DEGRADED,
                       _HS.HEALTH_STATE_NOT_READY: Health.NOT_READY},
    Numbering.DRAIN: {0: Health.UNSPECIFIED, 1: Health.STARTING, 2: Health.READY, 3: Health.DEGRADED,
                      4: Health.DRAINING, 5: Health.NOT_READY},
}
# The drain numbering's error codes in ours: 0..10 are the same; 11 DRAINING, 12 INTERNAL.
_DRAIN_CODES = {**{code: code for code in range(11)}, 11: ERROR_CODE_DRAINING, 12: _EC.ERROR_CODE_INTERNAL}


def numbering_of(info: server_pb2.ServerInfo) -> Numbering:
    """What the server says about itself (see the module's docstring)."""
    if info.schema_revision >= 3:
        return Numbering.DRAIN
    if info.HasField("kv_connector") and _has_unknown_field(info.kv_connector, _DRAIN_SCHEMA_VERSION_FIELD):
        return Numbering.DRAIN
    return Numbering.V0_1_0


def _has_unknown_field(message: Message, number: int) -> bool:
    fields = UnknownFieldSet(message)
    return any(fields[i].field_number == number for i in range(len(fields)))


def health_of(numbering: Numbering, value: int) -> Health:
    return _HEALTH[numbering].get(value, Health.UNKNOWN)


def health_text(numbering: Numbering, value: int) -> str:
    """How a health answer is named in logs and /health: its meaning, and the number when it has none."""
    health = health_of(numbering, value)
    return f"unknown health state {value}" if health is Health.UNKNOWN else f"health state {health.wire_name}"


def error_code_of(numbering: Numbering, value: int) -> int:
    """A wire ErrorCode in our (v0.1.0) numbering. A code the worker's numbering lacks keeps its number (named
    ERROR_CODE_<n>, a 502): the drain numbering defines 0..12, so its unknown codes are unknown to ours too."""
    if numbering is Numbering.V0_1_0:
        return value
    return _DRAIN_CODES.get(value, value)
