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
    from proto.grpc.health.v1 import health_pb2
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
    assert set(health_pb2.DESCRIPTOR.services_by_name["Health"].methods_by_name) == {"Check", "Watch"}


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
