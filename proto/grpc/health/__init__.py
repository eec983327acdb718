"""grpc.health.v1"""
