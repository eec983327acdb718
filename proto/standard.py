"""The standard gRPC services' stubs: grpc.health.v1 and grpc.reflection.v1 / v1alpha.

The official packages' modules (grpcio-health-checking's `grpc_health`, grpcio-reflection's `grpc_reflection`) where
they are installed, else this repository's generated copies under proto/grpc. Both define the same protobuf symbols
from differently named .proto files, and one process's descriptor pool cannot hold both: with our copies loaded, a
later `import grpc_health.v1.health_pb2` (a test's or a tool's health check beside the engine) failed with
"duplicate symbol 'grpc.health.v1.HealthCheckRequest'", and so did the engine after it. Import these names from here,
never from proto.grpc directly.

    from proto.standard import health_pb2, health_pb2_grpc, reflection_v1_pb2, reflection_v1alpha_pb2, ...
"""

from __future__ import annotations

import importlib
from types import ModuleType


def _pick(official: str, ours: str) -> tuple[ModuleType, ModuleType]:
    """(pb2, pb2_grpc) of the official package `official` if it imports, else of our copy `ours` (also where ours
    is loaded already: the official one then cannot be, TypeError from the descriptor pool). Where the official
    modules fail otherwise (a grpcio older than their gencode: RuntimeError, VersionError) after registering their
    descriptors, ours cannot load either: the official modules' error is raised, not the clash."""
    first: Exception | None = None  # why the official modules did not load, where they are installed
    try:
        return (importlib.import_module(f"{official}_pb2"), importlib.import_module(f"{official}_pb2_grpc"))
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - ours may still load (nothing of theirs registered)
        first = e
    try:
        return importlib.import_module(f"{ours}_pb2"), importlib.import_module(f"{ours}_pb2_grpc")
    except TypeError:
        if first is None:
            raise
        raise first from None


health_pb2, health_pb2_grpc = _pick("grpc_health.v1.health", "proto.grpc.health.v1.health")
reflection_v1_pb2, reflection_v1_pb2_grpc = _pick("grpc_reflection.v1.reflection",
                                                  "proto.grpc.reflection.v1.reflection")
reflection_v1alpha_pb2, reflection_v1alpha_pb2_grpc = _pick("grpc_reflection.v1alpha.reflection",
                                                            "proto.grpc.reflection.v1alpha.reflection")
