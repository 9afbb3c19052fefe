"""TLS material has one shape: PEM bytes read from the files a config section names."""

import pytest

from orchestrator.tls import TlsMaterial, UnreadableTlsFile


def test_relative_files_are_read_against_the_base_directory(tmp_path):
    (tmp_path / "ca.pem").write_bytes(b"CA")
    (tmp_path / "me.pem").write_bytes(b"CERT")
    (tmp_path / "me.key").write_bytes(b"KEY")
    material = TlsMaterial.read("ca.pem", "me.pem", str(tmp_path / "me.key"), base_dir=tmp_path, server_name="w0")
    assert material == TlsMaterial(ca=b"CA", cert=b"CERT", key=b"KEY", server_name="w0")
    assert material.has_identity


def test_an_unreadable_file_says_which_setting_named_it(tmp_path):
    with pytest.raises(UnreadableTlsFile) as info:
        TlsMaterial.read("ca.pem", base_dir=tmp_path)
    assert info.value.setting == "ca_file" and info.value.filename == str(tmp_path / "ca.pem")


def test_the_private_key_never_shows_in_a_repr():
    assert "SECRET" not in repr(TlsMaterial(cert=b"CERT", key=b"SECRET"))


def test_a_server_needs_a_certificate_and_its_key():
    with pytest.raises(ValueError, match="certificate and its key"):
        TlsMaterial(ca=b"CA").server_context(["http/1.1"])


def test_a_client_without_material_trusts_the_system_and_names_its_peer():
    material = TlsMaterial(server_name="worker.internal")
    assert material.client_context(["h2"]).verify_mode.name == "CERT_REQUIRED"
    assert material.grpc_options() == [("grpc.ssl_target_name_override", "worker.internal")]
    assert TlsMaterial().grpc_options() == []
