"""The wire contract: committed stubs equal what the .proto files generate, import from the installed
package, and carry the names DESIGN.md's "Contracts" section fixes."""

from __future__ import annotations

from pathlib import Path

import pytest

from proto import generate as gen

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_equal_freshly_generated(tmp_path):
    fresh = gen.generate(tmp_path)
    committed = gen.stub_paths(ROOT)
    assert [p.relative_to(tmp_path) for p in fresh] == [p.relative_to(ROOT) for p in committed]
    stale = []
    for new, old in zip(fresh, committed):
        assert old.is_file(), f"{old} is missing: run `python -m proto.generate`"
        if gen.normalized(new.read_text()) != gen.normalized(old.read_text()):
            stale.append(str(old.relative_to(ROOT)))
    assert not stale, f"stubs out of date with their .proto: {stale}; run `python -m proto.generate`"
    # nothing generated that is not tracked by stub_paths
    produced = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()}
    assert produced == {p.relative_to(tmp_path) for p in fresh}


def test_normalization_only_drops_version_stamps():
    text = ("# Protobuf Python Version: 7.35.1\n_runtime_version.ValidateProtobufRuntimeVersion(\n"
            "    _runtime_version.Domain.PUBLIC,\n    7,\n    35,\n    1,\n    '',\n    'x.proto'\n)\n"
            "GRPC_GENERATED_VERSION = '1.85.1'\nreal = 1\n")
    other = text.replace("7.35.1", "8.0.0").replace("    7,\n    35,\n    1,", "    8,\n    0,\n    0,") \
        .replace("1.85.1", "1.90.0")
    assert gen.normalized(text) == gen.normalized(other)
    assert gen.normalized(text) != gen.normalized(text.replace("real = 1", "real = 2"))
    assert "x.proto" in gen.normalized(text)


def test_contract_names():
    from proto.standard import health_pb2
    from proto.hybridspec.v1 import generation_pb2 as pb

    assert pb.DESCRIPTOR.package == "hybridspec.v1"
    generate = pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name["Generate"]
    assert generate.input_type.full_name == "hybridspec.v1.GenerateRequest"
    assert generate.output_type.full_name == "hybridspec.v1.GenerateResponse"
    assert generate.server_streaming and not generate.client_streaming

    def fields(message) -> set[str]:
        return set(message.DESCRIPTOR.fields_by_name)

    assert {"request_id", "prompt", "prompt_token_ids", "sampling"} <= fields(pb.GenerateRequest)
    assert pb.GenerateRequest.DESCRIPTOR.fields_by_name["prompt_token_ids"].is_repeated
    assert {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "seed", "ignore_eos"} <= fields(pb.SamplingParams)
    assert {"request_id", "token_ids", "text", "finished", "finish_reason", "usage"} <= fields(pb.GenerateResponse)
    assert {"prompt_tokens", "completion_tokens", "draft_tokens", "accepted_tokens", "verify_steps"} <= fields(pb.Usage)
    assert health_pb2.DESCRIPTOR.package == "grpc.health.v1"
    assert set(health_pb2.DESCRIPTOR.services_by_name["Health"].methods_by_name) == {"Check", "List", "Watch"}


def test_unset_sampling_fields_are_distinguishable():
    """proto3 `optional`: an explicit 0 (invalid max_new_tokens) differs from unset (the default)."""
    from proto.hybridspec.v1 import generation_pb2 as pb

    assert not pb.SamplingParams().HasField("max_new_tokens")
    assert pb.SamplingParams(max_new_tokens=0).HasField("max_new_tokens")
    assert not pb.GenerateRequest().HasField("prompt") and pb.GenerateRequest(prompt="").HasField("prompt")


@pytest.mark.parametrize("module", ["proto.hybridspec.v1.generation_pb2_grpc", "proto.grpc.health.v1.health_pb2_grpc",
                                    "proto.grpc.reflection.v1.reflection_pb2_grpc",
                                    "proto.grpc.reflection.v1alpha.reflection_pb2_grpc"])
def test_stubs_import_in_a_clean_interpreter(module):
    """Their own imports resolve from the installed package (not only from the repository root)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd="/", timeout=60)


def test_official_health_and_reflection_packages_coexist_with_the_engine(tmp_path):
    """grpcio-health-checking / grpcio-reflection installed beside the engine (a test's or a tool's health check):
    their modules define the same protobuf symbols as our copies from other .proto file names, so loading both
    failed with "duplicate symbol 'grpc.health.v1.HealthCheckRequest'" in either import order. proto.standard uses
    the official modules where importable. The packages are stood in for by our .proto files compiled under their
    file names (grpc_health/v1/health.proto, grpc_reflection/v1alpha/reflection.proto), as the packages ship them."""
    import shutil
    from pathlib import Path

    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[1]
    files = {"grpc_health/v1/health.proto": root / "proto/grpc/health/v1/health.proto",
             "grpc_reflection/v1alpha/reflection.proto": root / "proto/grpc/reflection/v1alpha/reflection.proto"}
    for name, src in files.items():
        dst = tmp_path / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)
        for pkg in (dst.parent, dst.parent.parent):
            (pkg / "__init__.py").touch()
    assert protoc.main(["grpc_tools.protoc", f"-I{tmp_path}", f"--python_out={tmp_path}",
                        f"--grpc_python_out={tmp_path}", *files]) == 0
    official = "import grpc_health.v1.health_pb2, grpc_health.v1.health_pb2_grpc, grpc_reflection.v1alpha.reflection_pb2"
    ours = "import engine.server, clients.client, proto.standard as s"
    check = ("import grpc_health.v1.health_pb2 as h, grpc_reflection.v1alpha.reflection_pb2 as r; "
             "assert s.health_pb2 is h and s.reflection_v1alpha_pb2 is r; "
             "assert s.health_pb2.HealthCheckResponse.SERVING == 1")
    _import_both_ways(tmp_path, official, ours, check)


def test_a_client_compiling_our_proto_with_the_proto_root_loads_beside_the_engine(tmp_path):
    """Our generation.proto is registered as hybridspec/v1/generation.proto, the name a client's own stubs get from
    `protoc -Iproto proto/hybridspec/v1/generation.proto`: the same file twice is one file to protobuf. Registered as
    proto/hybridspec/v1/generation.proto (before), importing such stubs beside the engine failed with "duplicate
    symbol 'hybridspec.v1.SamplingParams'" in either order."""
    from pathlib import Path

    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[1]
    assert protoc.main(["grpc_tools.protoc", f"-I{root / 'proto'}", f"--python_out={tmp_path}",
                        f"--grpc_python_out={tmp_path}", str(root / "proto/hybridspec/v1/generation.proto")]) == 0
    theirs = "from hybridspec.v1 import generation_pb2 as theirs, generation_pb2_grpc"
    ours = "import engine.server; from proto.hybridspec.v1 import generation_pb2 as ours"
    check = ("assert theirs.GenerateRequest.DESCRIPTOR is ours.GenerateRequest.DESCRIPTOR; "
             "assert ours.DESCRIPTOR.name == 'hybridspec/v1/generation.proto'; "
             "r = theirs.GenerateRequest(prompt='hi'); assert ours.GenerateRequest.FromString(r.SerializeToString()).prompt == 'hi'")
    _import_both_ways(tmp_path, theirs, ours, check)


def _import_both_ways(stubs, theirs: str, ours: str, check: str) -> None:
    """In a fresh interpreter with `stubs` (a folder) and the repository on its path: the imports `theirs` then
    `ours`, then `check`; and again in the other order."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": f"{stubs}:{Path(__file__).resolve().parents[1]}"}
    for order in (f"{theirs}; {ours}", f"{ours}; {theirs}"):
        subprocess.run([sys.executable, "-c", f"{order}; {check}"], check=True, cwd=stubs, env=env, timeout=120)
