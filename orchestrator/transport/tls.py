"""TLS to the workers (`workers_tls`), in the two forms the two worker channels take it."""

from __future__ import annotations

import ssl
import tempfile
from pathlib import Path

import attrs
import grpc


@attrs.frozen
class ChannelTls:
    """TLS to a worker: the CA that signed its certificate, and ours for mTLS (PEM bytes)."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """For grpcio."""
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)

    def options(self) -> list[tuple[str, str]]:
        """For grpcio: the name the worker's certificate must carry, when it is not the address's host."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl_context(self) -> ssl.SSLContext:
        """The same trust and identity for our own HTTP/2 connections (ALPN h2)."""
        context = ssl.create_default_context(
            cadata=self.root_certificates.decode() if self.root_certificates else None)
        if self.certificate_chain and self.private_key:
            # ssl loads a certificate and key from files only: a private temporary directory, removed at once
            with tempfile.TemporaryDirectory(prefix="orch-tls-") as directory:
                cert, key = Path(directory, "cert.pem"), Path(directory, "key.pem")
                cert.write_bytes(self.certificate_chain)
                key.touch(mode=0o600)
                key.write_bytes(self.private_key)
                context.load_cert_chain(cert, key)
        context.set_alpn_protocols(["h2"])
        return context
