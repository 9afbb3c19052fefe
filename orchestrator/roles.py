"""The three worker roles, one enum for config, discovery keys, capabilities, the pool and the simulator."""

from __future__ import annotations

import enum

from orchestrator.openengine.v1 import server_pb2


class Role(enum.StrEnum):
    AGGREGATED = "aggregated"  # runs whole requests
    PREFILL = "prefill"  # runs context-only legs
    DECODE = "decode"  # runs generation legs (and whole requests in conditional mode)

    @property
    def engine_role(self) -> server_pb2.EngineRole:
        """The ServerInfo.engine_role value that declares this role."""
        return _ENGINE_ROLES[self]

    @classmethod
    def from_engine_role(cls, value: int) -> Role | None:
        """None for ENGINE_ROLE_UNSPECIFIED: the worker serves any role (revision-1 TensorRT-LLM)."""
        return next((role for role, number in _ENGINE_ROLES.items() if number == value), None)


_ENGINE_ROLES = {Role.AGGREGATED: server_pb2.ENGINE_ROLE_AGGREGATED, Role.PREFILL: server_pb2.ENGINE_ROLE_PREFILL,
                 Role.DECODE: server_pb2.ENGINE_ROLE_DECODE}
ROLES: tuple[str, ...] = tuple(Role)
