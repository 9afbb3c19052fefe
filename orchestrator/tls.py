"""TLS material in one shape, wherever the orchestrator speaks TLS.

A `TlsMaterial` is PEM bytes read once from the files the configuration names: the CA that signs the peer's
certificate (None: the system's CAs), our own certificate and key (mTLS as a client; the served certificate as a
server) and, for a client, the name the peer's certificate must carry when it is not the address's host. Every
user turns it into what its library takes: an `ssl.SSLContext` (our HTTP/2 channel to the workers, the HTTP
server) or grpc credentials (grpcio channels to the workers, etcd).
"""

from __future__ import annotations

import ssl
import tempfile
from pathlib import Path

import attrs
import grpc


class UnreadableTlsFile(OSError):
    """One of the files cannot be read; `setting` says which (ca_file, cert_file or key_file)."""

    def __init__(self, setting: str, error: OSError):
        super().__init__(error.errno, error.strerror, error.filename)
        self.setting = setting


@attrs.frozen
class TlsMaterial:
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = attrs.field(default=None, repr=False)
    server_name: str | None = None

    @classmethod
    def read(cls, ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None, *,
             base_dir: Path | None = None, server_name: str | None = None) -> TlsMaterial:
        """The files' bytes, relative paths taken against `base_dir`; UnreadableTlsFile if one cannot be read."""
        def read(setting: str, name: str | None) -> bytes | None:
            if name is None:
                return None
            path = Path(name)
            try:
                return (path if path.is_absolute() or base_dir is None else base_dir / path).read_bytes()
            except OSError as exc:
                raise UnreadableTlsFile(setting, exc) from exc
        return cls(read("ca_file", ca_file), read("cert_file", cert_file), read("key_file", key_file), server_name)

    @property
    def has_identity(self) -> bool:
        return self.cert is not None and self.key is not None

    def client_context(self, alpn: list[str]) -> ssl.SSLContext:
        """A client's context: trust `ca` (else the system's CAs), present our certificate when we have one."""
        context = ssl.create_default_context(cadata=self.ca.decode() if self.ca else None)
        self._load_identity(context)
        context.set_alpn_protocols(alpn)
        return context

    def server_context(self, alpn: list[str]) -> ssl.SSLContext:
        """A server's context presenting our certificate (`cert` and `key` are required)."""
        if not self.has_identity:
            raise ValueError("a TLS server needs a certificate and its key")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._load_identity(context)
        context.set_alpn_protocols(alpn)
        return context

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def grpc_options(self) -> list[tuple[str, str]]:
        """The name the peer's certificate must carry, when it is not the address's host."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def _load_identity(self, context: ssl.SSLContext) -> None:
        if not self.has_identity:
            return
        # ssl loads a certificate and key from files only: a private temporary directory, removed at once
        with tempfile.TemporaryDirectory(prefix="orch-tls-") as directory:
            cert, key = Path(directory, "cert.pem"), Path(directory, "key.pem")
            cert.write_bytes(self.cert or b"")
            key.touch(mode=0o600)
            key.write_bytes(self.key or b"")
            context.load_cert_chain(cert, key)
