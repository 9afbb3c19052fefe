"""API keys for the HTTP API: Bearer tokens, compared in constant time, each with a name.

Named keys (`auth.keys: [{name, key | key_env | key_file, limits}]`) label the usage metrics and logs; the
older forms are still read and named by where they came from: `api_keys[0]`, `api_keys_file:LINE`,
`api_keys_env[0]`. No keys configured: no authentication (the default, for a frontend bound to loopback or
behind a proxy). With keys, every /v1/* route needs `Authorization: Bearer KEY`; /health and /metrics too
when the config says so (`auth.protect_health`, `auth.protect_metrics`). Secrets are never logged.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import attrs

from orchestrator.config import AuthConfig, ConfigError, KeyLimits


@attrs.frozen
class ApiKey:
    name: str
    secret: bytes = attrs.field(repr=False)
    limits: KeyLimits | None = None
    cache_salt: str | None = None  # auth.keys[i].cache_salt: this key's own prefix-cache namespace


class ApiKeys:
    def __init__(self, keys: list[ApiKey]):
        self.keys = [key for key in keys if key.secret]

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def identify(self, authorization: str | None) -> ApiKey | None:
        """The key an `Authorization: Bearer KEY` header presents, or None."""
        if not authorization or authorization[:7].lower() != "bearer ":
            return None
        return self.identify_plain(authorization[7:])

    def identify_plain(self, presented_key: str | None) -> ApiKey | None:
        """The key a header carries as it is (Anthropic's `x-api-key: KEY`), or None."""
        if not presented_key:
            return None
        presented = presented_key.strip().encode("latin-1")
        # Compare with every key, whatever matched: the time taken says nothing about which key is close.
        found = None
        for key in self.keys:
            if hmac.compare_digest(presented, key.secret) and found is None:
                found = key
        return found


def load_api_keys(auth: AuthConfig, *, file: str, base_dir: Path) -> ApiKeys:
    """Every configured key, read now: a missing variable or unreadable file is a ConfigError naming its key."""
    keys = [ApiKey(named.name, _named_secret(named, f"auth.keys[{i}]", file, base_dir), named.limits,
                   named.cache_salt) for i, named in enumerate(auth.keys)]
    keys += [ApiKey(f"api_keys[{i}]", key.encode()) for i, key in enumerate(auth.api_keys)]
    if auth.api_keys_file:
        text = _read(auth.api_keys_file, "auth.api_keys_file", "a readable file of API keys, one per line", file,
                     base_dir)
        keys += [ApiKey(f"api_keys_file:{number}", line.strip().encode())
                 for number, line in enumerate(text.splitlines(), 1)
                 if line.strip() and not line.lstrip().startswith("#")]
    if auth.api_keys_env:
        values = [key.strip() for key in os.environ.get(auth.api_keys_env, "").split(",") if key.strip()]
        keys += [ApiKey(f"api_keys_env[{i}]", key.encode()) for i, key in enumerate(values)]
    first_with: dict[bytes, str] = {}
    for key in keys:
        if key.secret and key.secret in first_with:
            raise ConfigError(file, "auth", f"each key once: {key.name} is the same key as {first_with[key.secret]} "
                              "(which name would its usage count under?)")
        first_with[key.secret] = key.name
    return ApiKeys(keys)


def _named_secret(named, where: str, file: str, base_dir: Path) -> bytes:
    if named.key is not None:
        secret = named.key
    elif named.key_env is not None:
        secret = os.environ.get(named.key_env, "").strip()
        if not secret:
            raise ConfigError(file, f"{where}.key_env", f"an environment variable holding the key ({named.key_env} "
                              "is unset or empty)", named.key_env)
    else:
        secret = _read(named.key_file, f"{where}.key_file", "a readable file holding the key", file, base_dir).strip()
    if not secret:
        raise ConfigError(file, where, "a non-empty key")
    return secret.encode()


def _read(value: str, key: str, expected: str, file: str, base_dir: Path) -> str:
    path = Path(value)
    path = path if path.is_absolute() else base_dir / path
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(file, key, f"{expected} ({exc.strerror})", value) from exc
