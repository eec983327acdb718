"""hybridspec.v1: the Generation service (generation.proto)."""
