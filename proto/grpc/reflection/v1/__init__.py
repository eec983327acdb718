"""grpc.reflection.v1: the standard server reflection service."""
