"""Sweep: for each server configuration, start `hybridspec serve ... --port 0` as a subprocess (the port it picks
is read from its "listening on" line), run the closed loop at each concurrency, stop the server (SIGTERM), and
write per-run results plus combined results and plots:

    DIR/sweep.json                        every run's headline numbers
    DIR/throughput_vs_concurrency.png     output tokens/s and goodput, a line per config
    DIR/p99_vs_concurrency.png            p99 TTFT / TPOT / ITL, a line per config
    DIR/NAME/server.log                   the server's output
    DIR/NAME/cN/result.json (+ plots)     one run (as `python -m loadtest --out DIR/NAME/cN`)
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from clients.client import GenerationClient
from loadtest import plots
from loadtest.run import LoadConfig, run_load, stats_dict, write_json

HEADLINE = ("requests", "completed", "errors", "duration_s", "output_tokens", "output_tokens_per_s", "requests_per_s",
            "goodput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "mean_accepted_length")
NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclass(frozen=True)
class ServerConfig:
    name: str
    args: list[str]


def parse_config(text: str, index: int = 0) -> ServerConfig:
    """ "name=ngram:--spec ngram --policy fixed" -> ServerConfig("ngram", ["--spec", "ngram", "--policy", "fixed"]);
    without "name=...:" the name is configINDEX."""
    text = text.strip()
    if text.startswith("name="):
        name, sep, rest = text[len("name="):].partition(":")
        if not sep:
            raise ValueError(f"--config {text!r}: expected name=NAME:SERVE_ARGS")
    else:
        name, rest = f"config{index}", text
    if not NAME.match(name):
        raise ValueError(f"--config {text!r}: the name may use letters, digits and _ . + - only")
    return ServerConfig(name, shlex.split(rest))


def serve_command(serve_cmd: str | None = None) -> list[str]:
    """The command that starts a server: --serve-cmd, else `hybridspec serve` from PATH or beside this Python."""
    if serve_cmd:
        return shlex.split(serve_cmd)
    exe = shutil.which("hybridspec")
    beside = Path(sys.executable).parent / "hybridspec"
    if exe is None and beside.is_file():
        exe = str(beside)
    if exe is None:
        raise ValueError("`hybridspec` is not on PATH (install the package) and no --serve-cmd was given")
    return [exe, "serve"]


class ServerProcess:
    """A `hybridspec serve` subprocess on a free port, its output in `log_path`."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.argv, self.log_path = argv, log_path
        self._log = open(log_path, "wb")
        # its own session: a Ctrl-C at the terminal reaches the sweep, which then stops the server itself
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    async def wait_listening(self, timeout: float) -> str:
        """Waits for the "listening on HOST:PORT" line and returns HOST:PORT."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(r"listening on (\S+)", self.log_path.read_text(errors="replace"))
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self.proc.returncode} before listening: "
                                   f"{shlex.join(self.argv)}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not listening after {timeout:g}s: {shlex.join(self.argv)}\n"
                                   f"{self.log_tail()}")
            await asyncio.sleep(0.1)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the server drains, then exits), SIGKILL after `timeout` s. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


async def wait_idle(target: str, timeout: float = 30.0) -> tuple[bool, dict]:
    """Waits until the server runs and queues nothing and every page and slot is free; returns (whether it got
    there, the last stats)."""
    deadline = time.monotonic() + timeout
    async with GenerationClient(target) as client:
        while True:
            s = stats_dict(await client.stats())
            idle = (s["running_requests"] == 0 and s["waiting_requests"] == 0
                    and s["free_pages"] == s["total_pages"] and s["free_slots"] == s["total_slots"])
            if idle or time.monotonic() > deadline:
                return idle, s
            await asyncio.sleep(0.05)


async def run_sweep(configs: list[ServerConfig], concurrencies: list[int], cfg: LoadConfig, out_dir: str | Path, *,
                    serve_argv: list[str], serve_args: list[str] = (), host: str = "127.0.0.1",
                    env: dict[str, str] | None = None, startup_timeout: float = 600.0,
                    stop: asyncio.Event | None = None) -> dict:
    if not configs or not concurrencies or any(c < 1 for c in concurrencies):
        raise ValueError("a sweep needs at least one --config and concurrencies >= 1")
    if cfg.rate is not None:
        raise ValueError("a sweep runs closed loops: --rate cannot be used with sweep")
    if len({c.name for c in configs}) != len(configs):
        raise ValueError("--config names must be distinct")
    dataclasses.replace(cfg, concurrency=concurrencies[0]).check()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stop = stop or asyncio.Event()
    runs: list[dict] = []
    for config in configs:
        cdir = out / config.name
        cdir.mkdir(exist_ok=True)
        argv = [*serve_argv, *serve_args, *config.args, "--host", host, "--port", "0"]
        server = ServerProcess(argv, cdir / "server.log", env)
        try:
            target = await server.wait_listening(startup_timeout)
            for c in concurrencies:
                if stop.is_set():
                    break
                requests = cfg.requests if cfg.requests or cfg.duration else max(LoadConfig.DEFAULT_REQUESTS, 4 * c)
                run_cfg = dataclasses.replace(cfg, concurrency=c, requests=requests)
                result = await run_load(target, run_cfg, cdir / f"c{c}", label=f"{config.name} c={c}", stop=stop)
                free, stats = await wait_idle(target)
                runs.append({"config": config.name, "concurrency": c, "dir": f"{config.name}/c{c}",
                             "memory_free_after": free, "result": {k: result[k] for k in HEADLINE}})
        except (TimeoutError, RuntimeError, OSError, grpc.aio.AioRpcError) as e:
            detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
            print(f"loadtest: sweep: config {config.name}: {detail}", file=sys.stderr)
            runs.append({"config": config.name, "error": detail})
        finally:
            status = server.stop()
        if status not in (0, None) and "error" not in runs[-1]:
            print(f"loadtest: sweep: server for {config.name} exited with status {status}", file=sys.stderr)

    sweep = {"configs": [{"name": c.name, "serve_args": [*serve_args, *c.args]} for c in configs],
             "serve_command": serve_argv, "concurrency": concurrencies, "runs": runs,
             "interrupted": stop.is_set(), "files": ["sweep.json"]}
    if cfg.plots and any("result" in r for r in runs):
        plots.sweep_throughput(runs, out / "throughput_vs_concurrency.png")
        plots.sweep_p99(runs, out / "p99_vs_concurrency.png")
        sweep["files"] += ["throughput_vs_concurrency.png", "p99_vs_concurrency.png"]
    write_json(out / "sweep.json", sweep)
    return sweep


def table(sweep: dict) -> str:
    """The sweep as a plain-text table."""
    head = ("config", "conc", "req", "errors", "tok/s", "req/s", "goodput/s", "TTFT p99", "TPOT p99", "ITL p99",
            "acc.len", "mem free")
    rows = [head]
    for run in sweep["runs"]:
        if "error" in run:
            rows.append((run["config"], "-", "-", run["error"].splitlines()[0][:40], *["-"] * 8))
            continue
        r = run["result"]
        p99 = lambda k: "-" if r[k]["p99"] is None else f"{r[k]['p99']:.1f}"  # noqa: E731
        acc = r["mean_accepted_length"]
        rows.append((run["config"], str(run["concurrency"]), str(r["requests"]),
                     ",".join(f"{k}:{v}" for k, v in r["errors"].items()) or "0",
                     f"{r['output_tokens_per_s']:.1f}", f"{r['requests_per_s']:.2f}",
                     f"{r['goodput']['requests_per_s']:.2f}", p99("ttft_ms"), p99("tpot_ms"), p99("itl_ms"),
                     "-" if acc is None else f"{acc:.2f}", "yes" if run["memory_free_after"] else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def environment(pairs: list[str]) -> dict[str, str]:
    """os.environ plus KEY=VALUE pairs (--server-env)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--server-env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env
