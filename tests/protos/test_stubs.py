"""The committed gRPC stubs are what protoc makes of the committed .proto files (`make protos` regenerates them)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ("rollout", "admin", "agent")


def _descriptor_bytes(source: str) -> bytes:
    literal = re.search(r"AddSerializedFile\((b'.*?')\)\n", source, re.S)
    assert literal, "no serialized descriptor in the generated module"
    return ast.literal_eval(literal.group(1))


def _without_versions(source: str) -> list[str]:
    """The stub's lines minus the generator's version stamps (a newer grpcio-tools changes only those)."""
    return [line for line in source.splitlines() if "version" not in line.lower()]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stubs")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            *(f"protos/{name}.proto" for name in PROTOS),
        ],
        cwd=ROOT,
        check=True,
    )
    return out / "protos"


@pytest.mark.parametrize("name", PROTOS)
def test_committed_stubs_match_the_proto_file(generated, name):
    committed = ROOT / "protos"
    fresh_pb2 = (generated / f"{name}_pb2.py").read_text()
    assert _descriptor_bytes((committed / f"{name}_pb2.py").read_text()) == _descriptor_bytes(fresh_pb2), (
        f"protos/{name}_pb2.py is stale: run `make protos`"
    )
    fresh_grpc = (generated / f"{name}_pb2_grpc.py").read_text()
    assert _without_versions((committed / f"{name}_pb2_grpc.py").read_text()) == _without_versions(fresh_grpc), (
        f"protos/{name}_pb2_grpc.py is stale: run `make protos`"
    )
