"""The committed generated code must match proto/: compares compiled descriptors, not generated text."""

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from kvservice._proto import allocator_pb2, state_pb2

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


@pytest.mark.parametrize("name,module", [("allocator", allocator_pb2), ("state", state_pb2)])
def test_generated_code_matches_the_proto(tmp_path, name, module):
    out = tmp_path / f"{name}.desc"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Ikvservice/_proto=proto/kvservice/v1",
                    f"--descriptor_set_out={out}", f"proto/kvservice/v1/{name}.proto"], cwd=REPO, check=True)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    committed = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(committed)
    _normalize(fresh)
    _normalize(committed)
    assert fresh.name == committed.name == f"kvservice/_proto/{name}.proto"
    assert committed == fresh, "kvservice/_proto is stale: run `make proto` and commit the result"
