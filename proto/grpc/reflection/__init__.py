"""grpc.reflection"""
