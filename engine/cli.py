"""The `hybridspec` command line.

    hybridspec serve [MODEL_DIR] [--host 127.0.0.1] [--port 50051] [--device cpu|cuda] [--dtype float32|bfloat16]
                     [--spec off|ngram|draft|mtp|replay] [--policy ar|fixed|budget|hybridspec] [--max-verify-len K]
                     [--draft-model DIR] [--executor local|ray] [--expert-parallel N] [--metrics-port N]
                     [engine limits]
    hybridspec generate PROMPT --server HOST:PORT [sampling options]      (stream from a running server)
    hybridspec generate PROMPT [--model DIR] [model options] [sampling options]   (run in this process)
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

from scheduler.types import MAX_NEW_TOKENS, InvalidRequest, SamplingParams, not_unicode

# spec None = the embedded default model's own speculation (mtp with the trained pair) without a model directory,
# else off
MODEL_DEFAULTS = {"device": "cpu", "dtype": "float32", "spec": None, "policy": "hybridspec", "max_verify_len": 16,
                  "draft_model": None, "expert_parallel": 1}


def _speculation(model: str | None, spec: str | None, draft_model: str | None) -> tuple[str, str | None]:
    """(spec, draft_model) after the default: the embedded model speculates the way it was trained to; `--spec draft`
    on it drafts with its own draft model (models/draft) unless --draft-model names another."""
    if spec == "draft" and model is None and draft_model is None:  # the embedded target's own draft model
        from engine.default_model import default_model_dir, trained_draft_dir, trained_model_dir

        trained = trained_model_dir()
        if trained is not None and default_model_dir() == trained and trained_draft_dir() is not None:
            return spec, str(trained_draft_dir())
    if spec is not None:
        return spec, draft_model
    if model is None and draft_model is None:
        from engine.default_model import default_speculation

        d = default_speculation()
        return d["spec"], d["draft_model"]
    return "off", draft_model


def _add_model_options(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    """Model options; with defaults=False they default to None (so `generate --server` can reject them)."""
    d = MODEL_DEFAULTS if defaults else dict.fromkeys(MODEL_DEFAULTS)
    p.add_argument("--device", default=d["device"], help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default=d["dtype"], choices=["float32", "bfloat16"], help="default float32")
    p.add_argument("--spec", default=d["spec"], choices=["off", "ngram", "draft", "mtp", "replay"],
                   help="speculative decoding method (default: the embedded model's own, mtp for the trained "
                        "pair; off with a model directory)")
    p.add_argument("--policy", default=d["policy"], choices=["ar", "fixed", "budget", "hybridspec"],
                   help="verification-length policy (default hybridspec)")
    p.add_argument("--max-verify-len", type=int, default=d["max_verify_len"],
                   help="longest verification, 1..16 (default 16)")
    p.add_argument("--draft-model", default=d["draft_model"], help="draft model directory (with --spec draft)")
    p.add_argument("--expert-parallel", type=int, default=d["expert_parallel"], metavar="N",
                   help="shard the experts over N workers, one per GPU (N > 1 needs --executor ray; default 1)")


def _check_expert_parallel(n: int, executor: str) -> None:
    if n < 1:
        raise ValueError(f"--expert-parallel must be an integer >= 1, got {n}")
    if n > 1 and executor != "ray":
        raise ValueError(f"--expert-parallel {n} needs --executor ray (with --executor {executor} only 1 is allowed)")


def _check_seconds(flag: str, value: float | None, allow_zero: bool, allow_inf: bool = False) -> None:
    """A duration flag: a number > 0 (>= 0 with allow_zero), not NaN (nor infinite unless allow_inf)."""
    if value is None:
        return
    ok = (value >= 0 if allow_zero else value > 0) and not math.isnan(value) and (allow_inf or math.isfinite(value))
    if not ok:
        allowed = f"a {'finite ' if not allow_inf else ''}number of seconds {'>= 0' if allow_zero else '> 0'}"
        raise ValueError(f"{flag} must be {allowed}, got {value:g}")


def _check_port(flag: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= 65535:
        raise ValueError(f"{flag} must be a port number in 0..65535 (0 = any free port), got {value}")


def _log_level(name: str) -> int:
    level = logging.getLevelName(name.upper())  # the level's number for a known name
    if not isinstance(level, int):
        levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
        raise ValueError(f"--log-level must be one of {', '.join(levels)} (any case), got {name!r}")
    return level


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, help=f"1..{MAX_NEW_TOKENS} (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from engine.async_engine import DEFAULT_MAX_WAITING
    from engine.server import DEFAULT_HOST, DEFAULT_PORT

    srv = sub.add_parser("serve", help="run the gRPC server (hybridspec.v1.Generation, health, reflection)")
    srv.add_argument("model", nargs="?", default=None, metavar="MODEL_DIR",
                     help="model directory (default: the embedded default model)")
    srv.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    srv.add_argument("--port", type=int, default=DEFAULT_PORT,
                     help=f"gRPC port (default {DEFAULT_PORT}; 0 = any free port, printed at start)")
    _add_model_options(srv)
    srv.add_argument("--executor", default="local", choices=["local", "ray"],
                     help="where the worker runs: this process (default) or a Ray actor (joins RAY_ADDRESS "
                          "or starts a local Ray on loopback)")
    srv.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus text metrics at http://HOST:PORT/metrics (default off)")
    srv.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                     help=f"queued requests beyond which new ones get RESOURCE_EXHAUSTED (default {DEFAULT_MAX_WAITING})")
    srv.add_argument("--max-running", type=int, default=None, help="requests running at once = GDN state slots")
    srv.add_argument("--num-pages", type=int, default=None,
                     help="KV pages in the pool (default: sized to memory; with --expert-parallel N the total, "
                     "each worker holding 1/N)")
    srv.add_argument("--max-step-tokens", type=int, default=None, help="per-step token budget (chunked prefill)")
    srv.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion, in tokens")
    srv.add_argument("--drain-timeout", type=float, default=30.0,
                     help="on SIGTERM, seconds in-flight requests may take before they are aborted (default 30)")
    srv.add_argument("--log-level", default="WARNING", help="Python logging level (default WARNING)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridspec", description="Serving engine for hybrid GDN + MoE models.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for PROMPT and stream it to the terminal")
    gen.add_argument("prompt")
    where = gen.add_mutually_exclusive_group()
    where.add_argument("--server", default=None, metavar="HOST:PORT", help="stream from a running `hybridspec serve`")
    where.add_argument("--model", default=None, help="model directory, run in this process "
                                                     "(default: the embedded default model)")
    gen.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                     help="with --server: wait up to SECONDS for the server to become ready (default 0)")
    gen.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="with --server: deadline of the call")
    _add_model_options(gen, defaults=False)
    gen.add_argument("--executor", default=None, choices=["local", "ray"],
                     help="without --server: where the worker runs (default local)")
    _add_sampling_options(gen)
    _add_serve_parser(sub)
    sub.add_parser("loadtest", add_help=False, help="load-test a server (loadtest/: `hybridspec loadtest --help`)")
    return parser


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, stop=list(args.stop), seed=args.seed,
                          ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    if (why := not_unicode("PROMPT", args.prompt)) is not None:  # command-line bytes that are not UTF-8
        raise ValueError(why)
    params = _sampling(args)  # checked here too, so bad options fail before any model or connection
    _check_seconds("--wait", args.wait, allow_zero=True)
    _check_seconds("--timeout", args.timeout, allow_zero=False)
    if args.server is not None:
        given = [f"--{k.replace('_', '-')}" for k in (*MODEL_DEFAULTS, "executor") if getattr(args, k) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} cannot be used with --server (the server's own options apply)")
        from clients.cli import run_generate

        return run_generate(args.server, args.prompt, wait=args.wait, timeout=args.timeout,
                            max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                            top_k=params.top_k, stop=params.stop, seed=params.seed, ignore_eos=params.ignore_eos)
    if args.wait or args.timeout is not None:
        raise ValueError("--wait and --timeout need --server")
    from engine.llm import LLM  # heavy import (torch) only when needed

    model_options = {k: (MODEL_DEFAULTS[k] if getattr(args, k) is None else getattr(args, k)) for k in MODEL_DEFAULTS}
    model_options["spec"], model_options["draft_model"] = _speculation(args.model, model_options["spec"],
                                                                       model_options["draft_model"])
    _check_expert_parallel(model_options["expert_parallel"], args.executor or "local")
    llm = LLM(model=args.model, executor=args.executor or "local", **model_options)
    out = sys.stdout
    out.write(args.prompt)
    last = None
    for last in llm.stream(args.prompt, params):
        out.write(last.new_text)
        out.flush()
    out.write("\n")
    if last is not None:
        print(f"[{len(llm.last_stream_tokens)} tokens, finish_reason={last.finish_reason}]", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    level = _log_level(args.log_level)
    for name in ("max_waiting", "max_running", "num_pages", "max_step_tokens", "max_model_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    _check_expert_parallel(args.expert_parallel, args.executor)
    _check_port("--port", args.port)
    _check_port("--metrics-port", args.metrics_port)
    _check_seconds("--drain-timeout", args.drain_timeout, allow_zero=True, allow_inf=True)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.llm import LLM
    from engine.server import ServeOptions, run_event_loop, serve_until_signal

    limits = {k: getattr(args, k) for k in ("max_running", "num_pages", "max_step_tokens", "max_model_len")
              if getattr(args, k) is not None}
    # LLM checks the speculation options exactly as the Python API does, then builds the engine core.
    spec, draft_model = _speculation(args.model, args.spec, args.draft_model)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, spec=spec, policy=args.policy,
              max_verify_len=args.max_verify_len, draft_model=draft_model, executor=args.executor,
              expert_parallel=args.expert_parallel, **limits)
    options = ServeOptions(host=args.host, port=args.port, metrics_port=args.metrics_port,
                           max_waiting=args.max_waiting, drain_timeout=args.drain_timeout)
    ep = f" x{args.expert_parallel} expert-parallel" if args.expert_parallel > 1 else ""
    what = f" ({args.model or 'embedded default model'}, executor {args.executor}{ep}, spec {spec})"
    return run_event_loop(serve_until_signal(llm.engine, options, what))


def as_flags(message: str, parser: argparse.ArgumentParser, command: str) -> str:
    """An error of the engine's own checks (LLM, SamplingParams) names the Python parameter it refuses
    (`max_verify_len must be ...`); on the command line it names the option typed instead (`--max-verify-len`).
    (With --server, the client's own checks name the field of the message it would send: `sampling.top_k`.)"""
    name, sep, rest = message.partition(" ")
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command_parser = sub.choices.get(command) if sub is not None else None
    if not sep or command_parser is None:
        return message
    for action in command_parser._actions:
        flags = [o for o in action.option_strings if o.startswith("--")]
        if action.dest == name and flags:
            return f"{flags[0]} {rest}"
    return message


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["loadtest"]:  # loadtest parses its own options (and imports no engine code)
        from loadtest.cli import main as loadtest_main

        return loadtest_main(list(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            return cmd_serve(args)
    except KeyboardInterrupt:  # Ctrl-C (serve drains on it; this is before its server runs, or `generate`)
        print("\nhybridspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`generate ... | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush stays quiet too
        return 141
    except (InvalidRequest, ValueError, FileNotFoundError, OSError) as e:
        print(f"hybridspec: error: {as_flags(str(e), parser, args.command)}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from engine.executor import WorkerLost  # (an engine raised it: torch is loaded already)

        if not isinstance(e, WorkerLost):
            raise
        print(f"hybridspec: error: {e}", file=sys.stderr)  # a Ray worker / expert-parallel group failed to start
        return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
