"""grpc.reflection.v1alpha: the standard server reflection service (older name, still used by many tools)."""
