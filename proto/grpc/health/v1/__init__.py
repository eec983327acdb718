"""grpc.health.v1: the standard health checking service."""
