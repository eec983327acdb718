"""Clients of a running `hybridspec serve`: the async Python client and the `generate --server` CLI side.
Imports only the protocol (proto/) and grpc.

    from clients import GenerationClient
"""

from clients.client import Chunk, Completion, GenerationClient, Usage

__all__ = ["Chunk", "Completion", "GenerationClient", "Usage"]
