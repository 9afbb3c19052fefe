"""API keys for the HTTP API: Bearer tokens, compared in constant time, from the config, a file or the environment.

No keys configured: no authentication (the default, for a frontend bound to loopback or behind a proxy).
With keys, every /v1/* route needs `Authorization: Bearer KEY`; /health and /metrics too when the config
says so (`auth.protect_health`, `auth.protect_metrics`). Keys are never logged.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from orchestrator.config import AuthConfig, ConfigError


class ApiKeys:
    def __init__(self, keys: list[str]):
        self._keys = [key.encode() for key in keys if key]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        if not authorization or authorization[:7].lower() != "bearer ":
            return False
        presented = authorization[7:].strip().encode("latin-1")
        # Compare with every key, whatever matched: the time taken says nothing about which key is close.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(presented, key)
        return matched


def load_api_keys(auth: AuthConfig, *, file: str, base_dir: Path) -> ApiKeys:
    keys = list(auth.api_keys)
    if auth.api_keys_file:
        path = Path(auth.api_keys_file)
        path = path if path.is_absolute() else base_dir / path
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(file, "auth.api_keys_file", f"a readable file of API keys, one per line ({exc.strerror})",
                              auth.api_keys_file) from exc
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if auth.api_keys_env:
        keys += [key.strip() for key in os.environ.get(auth.api_keys_env, "").split(",") if key.strip()]
    return ApiKeys(keys)
