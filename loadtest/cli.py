"""The load-test command line (`python -m loadtest`, `hybridspec loadtest`).

    python -m loadtest --server HOST:PORT [--concurrency N | --rate R] [--requests M] [--duration S]
                       [--max-new-tokens T | --max-new-tokens-dist D] [--prompts FILE | --prompt-len-dist D]
                       [--cancel-fraction F] [--slo-ttft-ms X] [--slo-tpot-ms Y] [--seed S] [--out DIR]
    python -m loadtest sweep --concurrency 1,4,16 --config "name=ar:--spec off" \\
                       --config "name=ngram:--spec ngram --policy fixed" [--serve-args "MODEL_DIR --device cuda"]
                       [load options] [--out DIR]

Exit status: 0 done (the errors the server returned are in the result), 1 the server could not be reached, before
the load or after it (then the results are written: the requests it lost are errors), or with --fail-on-error an
error other than CANCELLED occurred (a stream the server aborted is SERVER_ABORTED), or a sweep's server failed;
2 invalid options,
130 interrupted by Ctrl-C (no new requests were sent, those in flight finished, the results were written).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import signal
import sys
import time
from pathlib import Path

import grpc

from loadtest.run import LoadConfig, run_load, summary_line
from loadtest.workload import DIST_HELP


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _add_load_options(p: argparse.ArgumentParser, sweep: bool) -> None:
    d = LoadConfig()
    g = p.add_argument_group("load")
    if sweep:
        g.add_argument("--concurrency", type=_positive_ints, required=True, metavar="N,N,...",
                       help="concurrencies to run, comma-separated (closed loop)")
    else:
        g.add_argument("--concurrency", type=int, default=None, metavar="N",
                       help="closed loop: concurrent clients (default 1); with --rate: cap on requests in flight "
                            "(default none)")
        g.add_argument("--rate", type=float, default=None, metavar="R",
                       help="open loop: Poisson arrivals, R requests/s")
    g.add_argument("--requests", type=int, default=None, metavar="M",
                   help=f"requests to send (default {LoadConfig.DEFAULT_REQUESTS} unless --duration is given"
                        + ("; a sweep: max(100, 4 x concurrency) per point" if sweep else "") + ")")
    g.add_argument("--duration", type=float, default=None, metavar="S",
                   help="no new request after S seconds (those in flight finish)")
    g.add_argument("--warmup", type=int, default=d.warmup, metavar="K",
                   help="K requests before measuring, not recorded (default 0)")
    g.add_argument("--channels", type=int, default=d.channels, help="gRPC connections to spread requests over")
    w = p.add_argument_group("workload")
    w.add_argument("--prompts", default=None, metavar="FILE",
                   help='JSONL, one {"prompt": TEXT} or {"prompt_token_ids": [...]} per line (used in order, cycled)')
    w.add_argument("--prompt-len-dist", default=d.prompt_len_dist, metavar="D",
                   help=f"without --prompts: random token-id prompts of these lengths: {DIST_HELP} "
                        f"(default {d.prompt_len_dist})")
    w.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, metavar="T",
                   help=f"output length (default {d.max_new_tokens})")
    w.add_argument("--max-new-tokens-dist", default=None, metavar="D",
                   help=f"sampled output lengths instead: {DIST_HELP}")
    w.add_argument("--cancel-fraction", type=float, default=d.cancel_fraction, metavar="F",
                   help="cancel this fraction of the streams mid-stream, after a random number of chunks (default 0)")
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=d.ignore_eos,
                   help="generate exactly the output length, past EOS (default on)")
    w.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy (default)")
    w.add_argument("--top-p", type=float, default=None)
    w.add_argument("--top-k", type=int, default=None)
    w.add_argument("--timeout", type=float, default=None, metavar="S", help="each call's deadline")
    w.add_argument("--seed", type=int, default=d.seed, help="workload seed (default 0)")
    r = p.add_argument_group("report")
    r.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on time to first token")
    r.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on time per output token")
    r.add_argument("--out", default=None, metavar="DIR",
                   help="where result.json and the plots go (default loadtest-results/TIMESTAMP)")
    r.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    r.add_argument("--wait", type=float, default=d.wait, metavar="S",
                   help=f"wait up to S seconds for the server to be ready (default {d.wait:g})")


def build_parser(sweep: bool = False) -> argparse.ArgumentParser:
    if sweep:
        p = argparse.ArgumentParser(prog="loadtest sweep", description="Concurrency x server-configuration sweep: "
                                    "starts and stops `hybridspec serve` on a free port for each configuration.")
        s = p.add_argument_group("servers")
        s.add_argument("--config", action="append", required=True, metavar="name=NAME:ARGS",
                       help='a server configuration, e.g. "name=ngram:--spec ngram --policy fixed" (repeatable)')
        s.add_argument("--serve-args", default="", metavar="ARGS",
                       help='arguments for every configuration, e.g. "/models/m --device cuda --dtype bfloat16"')
        s.add_argument("--serve-cmd", default=None, metavar="CMD",
                       help="command that starts a server (default: `hybridspec serve`)")
        s.add_argument("--serve-host", default="127.0.0.1", help="address the servers listen on (default loopback)")
        s.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                       help="environment variable for the servers (repeatable), e.g. OMP_NUM_THREADS=1")
        s.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to start")
    else:
        p = argparse.ArgumentParser(prog="loadtest", description="Concurrent gRPC streaming load test of a "
                                    "running `hybridspec serve` (`loadtest sweep --help` for sweeps).",
                                    epilog="sweep mode: python -m loadtest sweep --help")
        p.add_argument("--server", required=True, metavar="HOST:PORT", help="the server to load")
        p.add_argument("--fail-on-error", action="store_true", help="exit 1 if any error other than CANCELLED")
    _add_load_options(p, sweep)
    return p


def _config(args: argparse.Namespace, sweep: bool) -> LoadConfig:
    return LoadConfig(
        concurrency=None if sweep else (args.concurrency if args.concurrency is not None or args.rate is not None
                                         else 1),
        rate=None if sweep else args.rate, requests=args.requests, duration=args.duration, prompts=args.prompts,
        prompt_len_dist=args.prompt_len_dist, max_new_tokens=args.max_new_tokens,
        max_new_tokens_dist=args.max_new_tokens_dist, cancel_fraction=args.cancel_fraction, seed=args.seed,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, ignore_eos=args.ignore_eos,
        timeout=args.timeout, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, warmup=args.warmup,
        wait=args.wait, channels=args.channels, progress=args.progress, plots=args.plots)


def _out_dir(args: argparse.Namespace) -> Path:
    return Path(args.out) if args.out else Path("loadtest-results") / time.strftime("%Y%m%d-%H%M%S")


def _stop_on_sigint(stop: asyncio.Event) -> None:
    """First Ctrl-C: no new requests, the ones in flight finish and the result is written; a second one quits."""
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        print("\nloadtest: interrupted: finishing the requests in flight (Ctrl-C again to quit)", file=sys.stderr)
        loop.remove_signal_handler(signal.SIGINT)
        stop.set()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        pass


async def _run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    _stop_on_sigint(stop)
    out = _out_dir(args)
    result = await run_load(args.server, _config(args, sweep=False), out, stop=stop)
    print(summary_line(result))
    print(f"results in {out}/")
    if result["interrupted"]:
        return 130
    lost = result["server_stats"].get("after_error")
    if lost:  # the server went away during the run: the records are written, the exit says it was lost
        print(f"loadtest: error: the server could not be reached after the load ({lost})", file=sys.stderr)
        return 1
    if args.fail_on_error and any(k != grpc.StatusCode.CANCELLED.name for k in result["errors"]):
        return 1
    return 0


async def _sweep(args: argparse.Namespace) -> int:
    from loadtest import sweep as sw

    configs = [sw.parse_config(text, i) for i, text in enumerate(args.config)]
    cfg = _config(args, sweep=True)
    serve_argv, env = sw.serve_command(args.serve_cmd), sw.environment(args.server_env)
    stop = asyncio.Event()
    _stop_on_sigint(stop)
    out = _out_dir(args)
    result = await sw.run_sweep(configs, args.concurrency, cfg, out, serve_argv=serve_argv,
                                serve_args=shlex.split(args.serve_args), host=args.serve_host, env=env,
                                startup_timeout=args.startup_timeout, stop=stop)
    print(sw.table(result))
    print(f"results in {out}/")
    if result["interrupted"]:
        return 130
    return 1 if any("error" in r for r in result["runs"]) else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sweep = argv[:1] == ["sweep"]
    args = build_parser(sweep).parse_args(argv[1:] if sweep else argv)
    try:
        return asyncio.run(_sweep(args) if sweep else _run(args))
    except ValueError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, OSError) as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as e:
        print(f"loadtest: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
