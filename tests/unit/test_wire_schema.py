"""Our proto/ files match the OpenEngine v1 spec tables (v0.1.0 plus the later-branch additions) field by field,
and the committed stubs are current."""

import filecmp

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from orchestrator.openengine import build
from orchestrator.openengine.v1 import (
    error_pb2,
    generation_pb2,
    kv_pb2,
    lifecycle_pb2,
    lora_pb2,
    model_pb2,
    openengine_pb2,
    server_pb2,
)
from spec_tables import SHARED_SPEC, VENDORED_SPEC, load_spec

MODULES = {
    "openengine/v1/error.proto": error_pb2,
    "openengine/v1/kv.proto": kv_pb2,
    "openengine/v1/generation.proto": generation_pb2,
    "openengine/v1/server.proto": server_pb2,
    "openengine/v1/model.proto": model_pb2,
    "openengine/v1/lifecycle.proto": lifecycle_pb2,
    "openengine/v1/lora.proto": lora_pb2,
    "openengine/v1/openengine.proto": openengine_pb2,
}
SPEC = load_spec()
SCALAR_TYPES = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BYTES: "bytes",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_UINT32: "uint32",
    FieldDescriptor.TYPE_UINT64: "uint64",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_DOUBLE: "double",
    FieldDescriptor.TYPE_FLOAT: "float",
}


def _proto(path: str) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    MODULES[path].DESCRIPTOR.CopyToProto(proto)
    return proto


def test_vendored_spec_is_the_shared_one():
    if not SHARED_SPEC.exists():
        pytest.skip("../shared/spec is not beside this checkout")
    assert VENDORED_SPEC.read_text() == SHARED_SPEC.read_text()


def test_spec_covers_every_file():
    assert set(SPEC) == set(MODULES)
    # 63 messages in v0.1.0; the additions bring KvBootstrap, MultimodalCapabilities and TokenizerInfo.
    assert sum(len(f.messages) for f in SPEC.values()) == 66


@pytest.mark.parametrize("path", sorted(MODULES))
def test_file_package_and_imports(path):
    proto = _proto(path)
    assert proto.package == "openengine.v1"
    assert proto.syntax == "proto3"


@pytest.mark.parametrize("path", sorted(MODULES))
def test_enums_match_spec(path):
    proto = _proto(path)
    ours = {e.name: {v.name: v.number for v in e.value} for e in proto.enum_type}
    assert ours == SPEC[path].enums


@pytest.mark.parametrize("path", sorted(MODULES))
def test_messages_match_spec_field_by_field(path):
    file_desc = MODULES[path].DESCRIPTOR
    assert set(file_desc.message_types_by_name) == set(SPEC[path].messages)
    for name, spec_fields in SPEC[path].messages.items():
        message = file_desc.message_types_by_name[name]
        assert [f.name for f in message.fields] == [f.name for f in spec_fields], name
        for spec_field in spec_fields:
            ours = message.fields_by_name[spec_field.name]
            where = f"{name}.{spec_field.name}"
            assert ours.number == spec_field.number, where
            if ours.type in SCALAR_TYPES:
                assert SCALAR_TYPES[ours.type] == spec_field.type, where
            elif ours.type == FieldDescriptor.TYPE_ENUM:
                assert ours.enum_type.full_name == f"openengine.v1.{spec_field.type}", where
            else:
                expected = (
                    "google.protobuf.Struct"
                    if spec_field.type == "Struct"
                    else f"openengine.v1.{spec_field.type}"
                )
                assert ours.message_type.full_name == expected, where
            assert ours.is_repeated == spec_field.repeated, where
            # proto3 `optional` is a synthetic one-field oneof with explicit presence.
            real_oneof = ours.containing_oneof
            if spec_field.optional:
                assert real_oneof is not None and real_oneof.name == f"_{spec_field.name}", where
            elif spec_field.oneof:
                assert real_oneof is not None and real_oneof.name == spec_field.oneof, where
            else:
                assert real_oneof is None, where


def test_services_match_spec():
    service_file = openengine_pb2.DESCRIPTOR
    spec = SPEC["openengine/v1/openengine.proto"].services
    assert set(service_file.services_by_name) == set(spec) == {"Inference", "Control"}
    for service_name, rpcs in spec.items():
        service = service_file.services_by_name[service_name]
        assert [m.name for m in service.methods] == [r[0] for r in rpcs]
        for name, request, response, server_streaming in rpcs:
            method = service.methods_by_name[name]
            assert method.input_type.name == request
            assert method.output_type.name == response
            proto = descriptor_pb2.MethodDescriptorProto()
            method.CopyToProto(proto)
            assert proto.server_streaming == server_streaming
            assert not proto.client_streaming


def test_wire_bytes_of_a_generate_request_are_stable():
    # A hand-encoded prefix: field 1 (request_id, LEN) and field 4 (token_ids, LEN{field 1 packed}).
    request = generation_pb2.GenerateRequest(
        request_id="r", token_ids=generation_pb2.TokenIds(ids=[1, 2])
    )
    assert request.SerializeToString() == b"\x0a\x01r" + b"\x22\x04\x0a\x02\x01\x02"


def test_committed_stubs_are_current(tmp_path):
    pytest.importorskip("grpc_tools")
    build.build(tmp_path)
    generated = sorted(p.name for p in tmp_path.glob("*.py*"))
    assert any(name.endswith(".pyi") for name in generated)  # the type stubs mypy reads
    assert generated == sorted(p.name for p in build.PACKAGE_DIR.glob("*_pb2*.py*"))
    _match, mismatch, errors = filecmp.cmpfiles(tmp_path, build.PACKAGE_DIR, generated, shallow=False)
    assert mismatch == [] and errors == []
