"""Stored responses of the Responses API: `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`.

A record is the response object a client gets back, and the conversation it ends (the items a continuation puts
before its own input: the earlier conversation, this request's input, this response's output), both as JSON.
Records are bounded by age (`responses.max_age_s`: an older one reads as gone) and by count
(`responses.max_count`: the oldest go first).

- `SqliteStore` (the default): one file named in the config, or memory (this process only). sqlite3 blocks, so
  every call runs on a worker thread, one at a time.
- `RedisStore`: a Redis server several orchestrator replicas share, so a replica continues a response another
  one stored. Each record is a key with its expiry; a sorted set by creation time bounds the count. The client is
  redis-py's blocking one, on worker threads (the service is trio; redis-py's asyncio client would need the
  asyncio thread the grpcio transport uses, for no gain at the rate responses are stored).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Protocol

import attrs
import trio

from orchestrator.config import ResponsesConfig


@attrs.frozen
class StoredResponse:
    id: str
    created_at: float
    response: str  # the Response object, JSON
    conversation: str  # the items a continuation puts before its input, JSON list


class ResponseStore(Protocol):
    async def put(self, record: StoredResponse) -> None: ...

    async def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None when there is none (never stored, deleted, or past its age)."""

    async def delete(self, response_id: str) -> bool:
        """Whether there was one to delete."""

    def close(self) -> None: ...


def open_store(config: ResponsesConfig, base_dir: Path) -> ResponseStore:
    if config.store == "redis":
        return RedisStore(config.url, prefix=config.key_prefix, max_age_s=config.max_age_s,
                          max_count=config.max_count)
    return SqliteStore(config.resolved_path(base_dir), max_age_s=config.max_age_s, max_count=config.max_count)


class _BlockingStore:
    """A store whose client blocks: each call runs on a worker thread (`_put`, `_get`, `_delete` do the work)."""

    async def put(self, record: StoredResponse) -> None:
        await trio.to_thread.run_sync(self._put, record)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await trio.to_thread.run_sync(self._get, response_id)

    async def delete(self, response_id: str) -> bool:
        return await trio.to_thread.run_sync(self._delete, response_id)

    def _put(self, record: StoredResponse) -> None:
        raise NotImplementedError

    def _get(self, response_id: str) -> StoredResponse | None:
        raise NotImplementedError

    def _delete(self, response_id: str) -> bool:
        raise NotImplementedError


class SqliteStore(_BlockingStore):
    def __init__(self, path: Path | None, *, max_age_s: float, max_count: int, clock=time.time) -> None:
        self.max_age_s, self.max_count, self.clock = max_age_s, max_count, clock
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(":memory:" if path is None else str(path), check_same_thread=False,
                                   isolation_level=None)  # autocommit: each statement is its own transaction
        self._lock = threading.Lock()  # one statement at a time on the one connection
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")  # (several frontend processes may share the file)
            self._db.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created_at REAL NOT NULL, "
                             "response TEXT NOT NULL, conversation TEXT NOT NULL)")
            self._db.execute("CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _put(self, record: StoredResponse) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                             (record.id, record.created_at, record.response, record.conversation))
            self._db.execute("DELETE FROM responses WHERE created_at < ?", (self.clock() - self.max_age_s,))
            self._db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC "
                             "LIMIT -1 OFFSET ?)", (self.max_count,))

    def _get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute("SELECT id, created_at, response, conversation FROM responses WHERE id = ? "
                                   "AND created_at >= ?", (response_id, self.clock() - self.max_age_s)).fetchone()
        return None if row is None else StoredResponse(*row)

    def _delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0


class RedisStore(_BlockingStore):
    def __init__(self, url: str, *, prefix: str, max_age_s: float, max_count: int) -> None:
        import redis  # only a deployment with a shared store needs the package

        self._redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5, decode_responses=True)
        self.prefix, self.max_age_s, self.max_count = prefix, max_age_s, max_count
        self._by_age = f"{prefix}:by-age"

    def _key(self, response_id: str) -> str:
        return f"{self.prefix}:{response_id}"

    def close(self) -> None:
        self._redis.close()

    def _put(self, record: StoredResponse) -> None:
        pipe = self._redis.pipeline()
        pipe.hset(self._key(record.id), mapping={"created_at": repr(record.created_at), "response": record.response,
                                                 "conversation": record.conversation})
        pipe.expire(self._key(record.id), max(1, int(self.max_age_s)))
        pipe.zadd(self._by_age, {record.id: record.created_at})
        pipe.zremrangebyscore(self._by_age, "-inf", time.time() - self.max_age_s)
        pipe.execute()
        excess = int(self._redis.zcard(self._by_age)) - self.max_count
        if excess > 0:  # the oldest go
            oldest = self._redis.zrange(self._by_age, 0, excess - 1)
            if oldest:
                pipe = self._redis.pipeline()
                pipe.delete(*[self._key(str(rid)) for rid in oldest])
                pipe.zrem(self._by_age, *oldest)
                pipe.execute()

    def _get(self, response_id: str) -> StoredResponse | None:
        fields = self._redis.hgetall(self._key(response_id))
        if not fields:
            return None
        return StoredResponse(response_id, float(fields["created_at"]), str(fields["response"]),
                              str(fields["conversation"]))

    def _delete(self, response_id: str) -> bool:
        self._redis.zrem(self._by_age, response_id)
        return bool(self._redis.delete(self._key(response_id)))
