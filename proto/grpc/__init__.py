"""Standard gRPC service definitions (health, reflection), generated here so no extra package is needed."""
