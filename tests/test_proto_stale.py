"""The committed generated code must match proto/: compares compiled descriptors, not generated text."""

import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

from kvservice._proto import allocator_pb2

REPO = Path(__file__).resolve().parent.parent


def _normalize(fdp: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """Drops what protoc adds but the runtime does not keep (source info, derived json names)."""
    fdp.ClearField("source_code_info")

    def strip(messages):
        for m in messages:
            for f in m.field:
                f.ClearField("json_name")
            strip(m.nested_type)
    strip(fdp.message_type)
    return fdp


def test_generated_code_matches_the_proto(tmp_path):
    out = tmp_path / "allocator.desc"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Ikvservice/_proto=proto/kvservice/v1",
                    f"--descriptor_set_out={out}", "proto/kvservice/v1/allocator.proto"], cwd=REPO, check=True)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    committed = descriptor_pb2.FileDescriptorProto()
    allocator_pb2.DESCRIPTOR.CopyToProto(committed)
    _normalize(fresh)
    _normalize(committed)
    assert fresh.name == committed.name == "kvservice/_proto/allocator.proto"
    assert committed == fresh, "kvservice/_proto is stale: run `make proto` and commit the result"
