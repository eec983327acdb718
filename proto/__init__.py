"""The wire contract: .proto files and their generated Python stubs (committed; regenerate with
`python -m proto.generate`).

    from proto.hybridspec.v1 import generation_pb2, generation_pb2_grpc
    from proto.standard import health_pb2, health_pb2_grpc  # (the official grpc_health where installed)
"""
