"""Distinct Triton compile keys per kernel over a serving workload, measured on CPU.

On a GPU every new specialization key of a Triton kernel is a JIT compile (~0.3-1 s on the H200) inside the step
that meets it first. The key is the kernel's constexpr arguments, Triton's integer specializations of its other
int arguments (value == 1 becomes a constant, divisibility by 16 is an attribute; `do_not_specialize` turns both
off), the argument dtypes and the launch options (num_warps, num_stages). Pointer alignment is left out (it
follows the allocator, not the step's shapes).

Under TRITON_INTERPRET=1 nothing is compiled, so this module wraps the interpreter's launch
(`InterpretedFunction.run`) and computes that key from the bound arguments and the kernel's signature.

    TRITON_INTERPRET=1 HYBRIDSPEC_KERNELS=triton python tests/specializations.py workload [--ep]
        the tiny bench model served by the engine's scheduler + runner (bench/e2e.py's `serve`): policies
        ar, fixed16, hybridspec with the replay drafter (its DFlash-shaped cost model runs too), several
        concurrencies. By default in shadow mode: each kernels.dispatch call runs its Triton wrapper dry (the
        launches are recorded, not executed) and then the reference for the result; --execute interprets the
        kernels instead (minutes). --ep: the MoE layers go through workers/expert_parallel.py
        (a one-rank gloo group: the exchange and the expert kernels over the received rows).
    TRITON_INTERPRET=1 HYBRIDSPEC_KERNELS=triton python tests/specializations.py sweep
        dry run (kernels are not executed, tensors on the meta device) of every decode/verify/commit kernel at
        the bench model's sizes (Qwen3.6-35B-A3B) over B = 1..64, T_i = 1..17, contexts up to 8k, plain and
        expert-parallel MoE: the counts a long serving run would reach.

Both print a table (kernel, distinct keys, the key fields that vary) and a final JSON line.
tests/test_specializations.py runs a short workload and bounds the counts.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class SpecRecorder:
    """Wraps InterpretedFunction.run: keys[kernel] = {key: context where it was first seen}. `execute=False`
    records without running the kernel (dry sweeps)."""

    def __init__(self, execute: bool = True):
        self.execute = execute
        self.keys: dict[str, dict[tuple, str]] = defaultdict(dict)
        self.launches: dict[str, int] = defaultdict(int)
        self.context = ""
        self._orig = None
        self._sigs: dict = {}
        self._patched: dict = {}
        self._in_shadow = False

    def __enter__(self) -> SpecRecorder:
        import triton.runtime.interpreter as interpreter

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("set TRITON_INTERPRET=1 before triton is imported")
        self._orig = interpreter.InterpretedFunction.run
        recorder = self

        def run(fn_self, *args, grid, warmup, **kwargs):
            name, key = recorder.key(fn_self, args, kwargs)
            recorder.keys[name].setdefault(key, recorder.context)
            recorder.launches[name] += 1
            if recorder.execute:
                return recorder._orig(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
            return None

        interpreter.InterpretedFunction.run = run
        return self

    def __exit__(self, *exc) -> None:
        import triton.runtime.interpreter as interpreter

        interpreter.InterpretedFunction.run = self._orig
        for name, f in self._patched.items():
            setattr(self._dispatch, name, f)
        self._patched = {}

    def shadow_dispatch(self) -> None:
        """Every kernels.dispatch entry runs its Triton wrapper dry (launches recorded, kernels not executed),
        then its PyTorch reference for the result: the same launch arguments as the interpreted Triton path
        (the wrappers never read a kernel's output on the host), at the speed of the references."""
        from kernels import dispatch

        self._dispatch = dispatch
        recorder = self

        def shadowed(f):
            def run(*args, **kwargs):
                if recorder._in_shadow:
                    return f(*args, **kwargs)
                prev = os.environ.get("HYBRIDSPEC_KERNELS")
                recorder._in_shadow, recorder.execute = True, False
                try:
                    os.environ["HYBRIDSPEC_KERNELS"] = "triton"
                    f(*args, **kwargs)
                    os.environ["HYBRIDSPEC_KERNELS"] = "ref"
                    return f(*args, **kwargs)
                finally:
                    recorder._in_shadow, recorder.execute = False, True
                    if prev is None:
                        os.environ.pop("HYBRIDSPEC_KERNELS", None)
                    else:
                        os.environ["HYBRIDSPEC_KERNELS"] = prev
            return run

        for name, f in inspect.getmembers(dispatch, inspect.isfunction):
            if f.__module__ == dispatch.__name__ and name != "use_triton":
                self._patched[name] = f
                setattr(dispatch, name, shadowed(f))

    def key(self, fn_self, args, kwargs) -> tuple[str, tuple]:
        import triton.language as tl
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl

        fn = fn_self.fn
        name = f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"
        sig = self._sigs.get(fn)
        if sig is None:
            sig = self._sigs[fn] = inspect.signature(fn)
        params = {k: v for k, v in kwargs.items() if k in sig.parameters}
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters and k in LAUNCH_OPTIONS))
        bound = sig.bind(*args, **params)
        bound.apply_defaults()
        dns = set(fn_self.kwargs.get("do_not_specialize") or ())
        parts = []
        for i, (pname, value) in enumerate(bound.arguments.items()):
            ann = sig.parameters[pname].annotation
            if ann is tl.constexpr or "constexpr" in str(ann):
                parts.append((pname, "=", _plain(value)))
                continue
            if isinstance(value, bool) or isinstance(value, float) or value is None:
                spec = native_specialize_impl(BaseBackend, value, False, True, False)
            elif isinstance(value, int):
                no = pname in dns or i in dns
                spec = native_specialize_impl(BaseBackend, value, False, not no, not no)
            else:  # tensors, descriptors: dtype (and block shape), alignment left out
                spec = native_specialize_impl(BaseBackend, value, False, True, False)
            parts.append((pname, ":", tuple(_plain(s) for s in spec)))
        return name, tuple(parts) + options


def _plain(v):
    if hasattr(v, "value") and type(v).__name__ == "constexpr":
        v = v.value
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return str(v)


def varying_fields(keys) -> dict[str, list]:
    """The fields that differ between a kernel's keys, with their distinct values."""
    keys = list(keys)
    if len(keys) < 2:
        return {}
    fields: dict[str, set] = defaultdict(set)
    for k in keys:
        for item in k:
            fields[item[0]].add(repr(item[-1]))
    return {f: sorted(v) for f, v in fields.items() if len(v) > 1}


def compact_keys(keys) -> list[str]:
    """Each key as its varying fields only ("N=('i32', 'D') S_P2=8")."""
    keys = list(keys)
    vary = varying_fields(keys)
    return [" ".join(f"{item[0]}={item[-1]!r}" for item in k if item[0] in vary) or "(one key)" for k in keys]


def summary(rec: SpecRecorder) -> dict[str, dict]:
    return {name: {"keys": len(keys), "launches": rec.launches[name], "varying": varying_fields(keys)}
            for name, keys in sorted(rec.keys.items())}


def print_table(rec: SpecRecorder, title: str) -> None:
    print(f"\n{title}\n| kernel | distinct keys | launches | varying key fields (values) |\n|---|---|---|---|")
    for name, s in summary(rec).items():
        vary = "; ".join(f"{f} {' '.join(v)}" for f, v in s["varying"].items()) or "-"
        print(f"| {name} | {s['keys']} | {s['launches']} | {vary} |")


# ------------------------------------------------------------------------------------------- tiny-model workload
def run_workload(rec: SpecRecorder, concurrencies=(1, 3, 8), policies=("ar", "fixed16", "hybridspec"),
                 prompt_len: int = 20, max_new: int = 12, acceptance: float = 0.7, ep: bool = False) -> None:
    """The engine's scheduler + ModelRunner on the tiny bench model (bench/e2e.py's `serve`), with the replay
    drafter and its DFlash-shaped cost model; `ep`: MoE layers through the expert-parallel exchange (one rank)."""
    import torch

    from e2e import drafter_model, serve, tiny_config
    from workers.bench_model import build_bench_model
    from workers.cache import ModelCache
    from workers.drafters import DraftModelDrafter, ReplayDrafter
    from workers.runner import ModelRunner

    torch.manual_seed(0)
    target = build_bench_model(config=tiny_config(), routing="zipf", dtype=torch.float32, device="cpu",
                               decisive=True)
    cfg = target.config
    if ep:
        import torch.distributed as dist

        from workers.expert_parallel import init_group, shard_model_

        if not dist.is_initialized():
            port = random.Random(os.getpid()).randint(20000, 60000)
            init_group(0, 1, f"tcp://127.0.0.1:{port}", "cpu")
        shard_model_(target)
    page_size, max_c = 16, max(concurrencies)
    pages_per_req = -(-(prompt_len + max_new + 16 + 4) // page_size)
    num_pages = max_c * pages_per_req
    cache = ModelCache(cfg, num_pages + 1, page_size, max_c + 1, torch.float32, "cpu")
    drafter_cost = DraftModelDrafter(drafter_model(cfg, 1, torch.float32, "cpu"), num_pages, page_size, max_c)
    runner = ModelRunner(target, cache)
    gen = torch.Generator().manual_seed(1)
    for conc in concurrencies:
        prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(conc)]
        runner.drafter = None
        rec.context = f"c={conc} ar"
        ar = serve(runner, prompts, max_new, 0, page_size, num_pages, "ar")
        replay = ReplayDrafter(acceptance, cfg.vocab_size, seed=7, cost_model=drafter_cost)
        for p, cont in zip(prompts, ar.tokens):
            replay.set_reference(p, cont + [0] * 18)
        for policy in policies:
            if policy == "ar":
                continue
            runner.drafter = replay
            rec.context = f"c={conc} {policy}"
            serve(runner, prompts, max_new, 16, page_size, num_pages, policy)


# ---------------------------------------------------------------------------------- dry sweep at bench-model sizes
def run_sweep(rec: SpecRecorder, max_batch: int = 64, max_t: int = 17, max_ctx: int = 8192, seed: int = 0,
              ep_world: int = 2, sm_count: int = 132, batches=None, moe: str = "both") -> None:
    """Every decode/verify/commit kernel wrapper at the bench model's sizes over the shape space of a serving
    run (kernels not executed: `rec.execute` should be False; tensors on the meta device)."""
    import torch

    import kernels.attention_triton as attention_triton
    from kernels import dispatch
    from workers.bench_model import qwen36_35b_a3b_config

    attention_triton.CPU_SM_COUNT = sm_count  # KV splits as on the GPU

    cfg = qwen36_35b_a3b_config(4)
    dev, dt = "meta", torch.bfloat16
    h, e, k_top = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    conv_dim, inter = 2 * hk * dk + hv * dv, cfg.moe_intermediate_size
    page = 16
    slots_n = max_batch + 1
    pool_pages = max_batch * (max_ctx // page + 4)
    kc = torch.empty(pool_pages, page, hkv, d, dtype=dt, device=dev)
    vc = torch.empty_like(kc)
    state = torch.empty(slots_n, hv, dk, dv, dtype=torch.float32, device=dev)
    conv_state = torch.empty(slots_n, conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=dt, device=dev)
    w_conv = torch.empty(conv_dim, cfg.linear_conv_kernel_dim, dtype=dt, device=dev)
    w_gu = torch.empty(e, 2 * inter, h, dtype=dt, device=dev)
    w_dn = torch.empty(e, h, inter, dtype=dt, device=dev)
    local = e // ep_world
    w_gu_l, w_dn_l = w_gu[:local], w_dn[:local]
    norm_w = torch.empty(h, dtype=dt, device=dev)
    rng = random.Random(seed)
    rot = int(d * 0.25)

    def step(lens: list[int], ctxs: list[int], verify: bool, hybrid: bool) -> None:
        b, n, mq = len(lens), sum(lens), max(lens)
        cu = torch.empty(b + 1, dtype=torch.int32, device=dev)
        slots = torch.empty(b, dtype=torch.int64, device=dev)
        x = torch.empty(n, h, dtype=dt, device=dev)
        dispatch.rmsnorm(x, norm_w, 1e-6)
        # attention layer
        qkv = torch.empty(n, hq * 2 * d + 2 * hkv * d, dtype=dt, device=dev)
        q, gate = qkv[:, : hq * 2 * d].view(n, hq, 2 * d).chunk(2, dim=-1)  # as workers/model.py Attention
        kk = qkv[:, hq * 2 * d: hq * 2 * d + hkv * d].view(n, hkv, d)
        vv = qkv[:, hq * 2 * d + hkv * d:].view(n, hkv, d)
        cos = torch.empty(n, rot, dtype=dt, device=dev)
        pt = torch.empty(b, max_ctx // page + 2, dtype=torch.int32, device=dev)
        pos = torch.empty(n, dtype=torch.int64, device=dev)
        qr = dispatch.qk_norm_rope_write(q, kk, vv, norm_w[:d], norm_w[:d], 1e-6, cos, cos, rot, kc, vc, pt, pos,
                                         pos)
        dispatch.paged_attention(qr, kc, vc, pt, cu, torch.empty(b, dtype=torch.int32, device=dev), d ** -0.5,
                                 lens, ctxs, gate)
        # GDN layer
        proj = torch.empty(n, conv_dim + hv * dv + 2 * hv, dtype=dt, device=dev)
        conv_in, z = proj[:, :conv_dim], proj[:, conv_dim: conv_dim + hv * dv]
        bb, aa = proj[:, conv_dim + hv * dv: conv_dim + hv * dv + hv], proj[:, conv_dim + hv * dv + hv:]
        write = torch.empty(b, dtype=torch.bool, device=dev) if verify else True
        mixed = dispatch.causal_conv1d(conv_in, w_conv, cu, conv_state, slots, mq, write)
        qg = mixed[:, : hk * dk].reshape(n, hk, dk)
        kg = mixed[:, hk * dk: 2 * hk * dk].reshape(n, hk, dk)
        vg = mixed[:, 2 * hk * dk:].reshape(n, hv, dv)
        g, beta = dispatch.gdn_gates(aa, bb, torch.empty(hv, device=dev), torch.empty(hv, dtype=dt, device=dev))
        o = dispatch.gdn(qg, kg, vg, g, beta, cu, state, slots, mq, write_state=write)
        dispatch.gated_rmsnorm(o, z.view(n, hv, dv), norm_w[:dv], 1e-6)
        # MoE layer
        if moe == "none":
            return
        logits = torch.empty(n, e, dtype=torch.float32, device=dev)
        wts, ids = dispatch.route(logits, k_top, True)
        mask = torch.empty(n, dtype=torch.bool, device=dev) if hybrid else None
        routed = dispatch.fused_moe(x, w_gu, w_dn, wts.to(dt), ids, mask) if moe != "ep" else x
        gu = torch.empty(n, 2 * cfg.shared_expert_intermediate_size, dtype=dt, device=dev)
        dispatch.silu_mul(gu[:, :cfg.shared_expert_intermediate_size], gu[:, cfg.shared_expert_intermediate_size:])
        dispatch.moe_residual(x, routed, torch.empty(n, 1, dtype=dt, device=dev), x)
        # expert parallel: the experts of this rank over the received rows (top-1, local ids)
        kept = n * k_top if not hybrid else rng.randint(max(1, (n - b) * k_top), n * k_top)
        n_recv = max(0, round(kept / ep_world * rng.uniform(0.6, 1.4)))
        if n_recv and moe != "local":
            dispatch.fused_moe(torch.empty(n_recv, h, dtype=dt, device=dev), w_gu_l, w_dn_l,
                               torch.empty(n_recv, 1, dtype=dt, device=dev),
                               torch.empty(n_recv, 1, dtype=torch.int64, device=dev))
        if verify:  # commit
            keep = torch.empty(b, dtype=torch.int64, device=dev)
            dispatch.gdn_commit(kg, vg, g, beta, cu, keep, state, slots, mq)
            dispatch.conv_commit(conv_in, cu, keep, conv_state, slots, mq)

    for b in batches or range(1, max_batch + 1):
        for mq in range(1, max_t + 1):
            for ctx_max in (64, 512, 2048, max_ctx - max_t):
                verify = mq > 1
                lens = [mq] + [rng.randint(1, mq) for _ in range(b - 1)]
                ctxs = [ctx_max] + [rng.randint(1, ctx_max) for _ in range(b - 1)]
                rec.context = f"B={b} T={mq} ctx={ctx_max}"
                step(lens, ctxs, verify, hybrid=verify)
                if verify:  # the same with every request verifying the same length (fixed-K policies)
                    step([mq] * b, ctxs, True, hybrid=False)
    # decode steps where verification is off, and the drafted-block shapes the commit sees (T = a_i + 1)
    for b in (1, 7) if batches else (1, 7, 16, 33, 64):
        rec.context = f"B={b} prefill"
        for plen in (128, 1000, 2048):
            step([plen] * min(b, 4), [0] * min(b, 4), False, False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["workload", "sweep"])
    ap.add_argument("--ep", action="store_true", help="workload: MoE through the expert-parallel exchange")
    ap.add_argument("--execute", action="store_true",
                    help="workload: run the Triton kernels (interpreted; slow) instead of the shadow mode (Triton "
                    "wrappers dry for the keys, references for the results)")
    ap.add_argument("--concurrency", default="1,3,8")
    ap.add_argument("--policies", default="ar,fixed16,hybridspec")
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--moe", default="both", choices=["both", "local", "ep", "none"],
                    help="sweep: MoE kernels as one GPU runs them (local), as an EP rank does (ep), both, none")
    ap.add_argument("--show-keys", default="", help="comma-separated kernels whose keys to print")
    args = ap.parse_args()
    os.environ.setdefault("HYBRIDSPEC_KERNELS", "triton")
    import torch

    torch.set_num_threads(1)
    if args.mode == "workload":
        with SpecRecorder(execute=True) as rec:
            if not args.execute:
                rec.shadow_dispatch()
            run_workload(rec, [int(c) for c in args.concurrency.split(",")], args.policies.split(","),
                         max_new=args.max_new, ep=args.ep)
        title = f"workload (tiny model, {'expert-parallel' if args.ep else 'local'} MoE, c={args.concurrency})"
    else:
        with SpecRecorder(execute=False) as rec:
            run_sweep(rec, max_batch=args.max_batch, moe=args.moe)
        title = f"sweep (bench-model sizes, B<=64, T<=17, ctx<=8k; dry; MoE {args.moe})"
    print_table(rec, title)
    for name in filter(None, args.show_keys.split(",")):
        for key, ctx in rec.keys.get(name, {}).items():
            print(name, ctx, key)
    print(json.dumps({"mode": args.mode, "ep": args.ep, "kernels": summary(rec)}))


if __name__ == "__main__":
    main()
