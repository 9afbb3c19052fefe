"""KV sessions: held on the prefill worker, pulled by the decode worker over loopback TCP.

Frames are msgpack maps behind a 4-byte big-endian length. The decode side asks
`{"op": "pull", ...}`, the prefill side checks the session and what prefilled it and answers with
its size, the decode side pays bytes / bandwidth and says `{"op": "done"}`, and only then are the
prefill's blocks released. A pull that breaks off before "done" leaves the blocks held until the
transfer timeout (TRT-LLM's kv_transfer_timeout_ms) - which is why the orchestrator must not drop a
decode leg before its first token.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import attrs
import msgpack

if TYPE_CHECKING:
    from orchestrator.sim.prefix_cache import PrefixLease

log = logging.getLogger(__name__)
PROTOCOL = "msgpack-tcp"
_MAX_FRAME = 1 << 20


class KvTransferError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code  # "KV_SESSION_NOT_FOUND" | "KV_TRANSFER_FAILED"


async def write_frame(writer: asyncio.StreamWriter, obj: dict) -> None:
    data = msgpack.packb(obj)
    writer.write(struct.pack(">I", len(data)) + data)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> dict:
    (size,) = struct.unpack(">I", await reader.readexactly(4))
    if size > _MAX_FRAME:
        raise KvTransferError("KV_TRANSFER_FAILED", f"frame of {size} bytes is too large")
    return msgpack.unpackb(await reader.readexactly(size))


@attrs.define
class HeldSession:
    session_id: str
    blocks: int
    tokens: int
    prompt_digest: str
    media_digest: str
    opaque_state: str
    first_gen_tokens: list[int]
    rank: int = 0  # the attention-DP rank whose blocks it holds
    lease: PrefixLease | None = None  # its prefill's hold on the prefix cache, released with it


class SessionStore:
    """Prefill side: sessions waiting for their decode, with a transfer timeout (None: held until exit)."""

    def __init__(self, release_blocks: Callable[[int, int, PrefixLease | None], None], timeout_s: float | None):
        self._release_blocks = release_blocks
        self.timeout_s = timeout_s
        self.sessions: dict[str, HeldSession] = {}
        self.expired = 0
        self.pulled = 0

    def hold(self, session: HeldSession) -> None:
        self.sessions[session.session_id] = session
        if self.timeout_s is not None:
            asyncio.get_running_loop().call_later(self.timeout_s, self._expire, session.session_id, session)

    def _expire(self, session_id: str, session: HeldSession) -> None:
        if self.sessions.get(session_id) is session:
            log.warning("kv session %s expired after %.1f s without a pull; %d blocks released",
                        session_id, self.timeout_s, session.blocks)
            self.expired += 1
            self.drop(session_id)

    def drop(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        self._release_blocks(session.blocks, session.rank, session.lease)
        return True

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_frame(reader)
            session = self.sessions.get(request.get("session_id", ""))
            if session is None:
                await write_frame(writer, {"ok": False, "code": "KV_SESSION_NOT_FOUND",
                                           "message": f"kv session {request.get('session_id')!r} not found"})
                return
            checks = [("prompt", session.prompt_digest), ("media", session.media_digest)]
            if request.get("opaque_state") is not None:  # a build whose handoff carries no opaque state
                checks.append(("opaque_state", session.opaque_state))
            mismatch = [name for name, ours in checks if request.get(name) != ours]
            if request.get("first_gen_tokens") != session.first_gen_tokens:
                mismatch.append("first_gen_tokens")
            if mismatch:
                await write_frame(writer, {"ok": False, "code": "KV_TRANSFER_FAILED",
                                           "message": "decode request differs from what prefilled session "
                                                      f"{session.session_id}: {', '.join(mismatch)}"})
                return
            await write_frame(writer, {"ok": True, "tokens": session.tokens, "blocks": session.blocks})
            done = await read_frame(reader)
            if done.get("op") == "done" and self.sessions.get(session.session_id) is session:
                self.pulled += 1
                self.drop(session.session_id)
                await write_frame(writer, {"ok": True})
        except (asyncio.IncompleteReadError, ConnectionError, KvTransferError, ValueError) as exc:
            log.info("kv pull connection ended early: %r", exc)
        finally:
            writer.close()


async def pull(host: str, port: int, request: dict, transfer_seconds: Callable[[int], float],
               sleep: Callable[[float], Awaitable[None]]) -> int:
    """Decode side: pull a session, spending its transfer time with `sleep` (a gpu_sleep.GpuSleep: 0.13 ms at time
    scale 0.1, which the loop's own timer rounds away); returns its token count. Raises KvTransferError."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        raise KvTransferError("KV_TRANSFER_FAILED", f"cannot reach kv endpoint {host}:{port}: {exc}") from exc
    try:
        await write_frame(writer, {"op": "pull", **request})
        answer = await read_frame(reader)
        if not answer.get("ok"):
            raise KvTransferError(answer.get("code", "KV_TRANSFER_FAILED"), answer.get("message", "pull refused"))
        started = time.monotonic()
        await sleep(transfer_seconds(answer["tokens"]))
        await write_frame(writer, {"op": "done", "seconds": time.monotonic() - started})
        await read_frame(reader)
        return answer["tokens"]
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise KvTransferError("KV_TRANSFER_FAILED", f"kv endpoint {host}:{port} closed the pull: {exc!r}") from exc
    finally:
        writer.close()
