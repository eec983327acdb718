"""Load testing a running `hybridspec serve` over gRPC: closed and open loops of streaming requests, latency and
throughput metrics (TTFT, TPOT, ITL, goodput, errors by status, mean accepted length), a JSON result, PNG plots,
and sweeps over concurrency x server configurations.

    python -m loadtest --server 127.0.0.1:50051 --concurrency 32 --requests 200 --max-new-tokens 64 --out DIR
    python -m loadtest sweep --concurrency 1,4,16 --config "name=ar:--spec off" --config "name=ngram:--spec ngram"

Imports only clients/ and proto/ (plus grpc, numpy, matplotlib); a sweep starts servers as subprocesses.
"""

from loadtest.cli import main
from loadtest.run import LoadConfig, run_load

__all__ = ["LoadConfig", "main", "run_load"]
