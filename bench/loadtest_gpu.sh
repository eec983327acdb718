#!/usr/bin/env bash
# Load-test sweep of `hybridspec serve` on the GPU against the bench model (issue 8), one command on the H200:
#
#     HYBRIDSPEC_COMMIT=<commit> bash bench/loadtest_gpu.sh        (~6 min; writes $OUT/loadtest/)
#
# with build/loadtest-wheels carried (the device's grpcio is too old for the stubs; see WHEELS below).
# Measured (smoke run, 40 layers, c=1,64, 8 s per point): model directory 16 s, a server start ~20-35 s (model
# built on the GPU), the first warm-up ~30 s (Triton compiles), then ~20-45 s per point.
#
# 1. `python -m bench.bench_model_dir`: a random-weights model directory, Qwen3.6-35B-A3B shapes (40 layers,
#    Zipf routing, bf16 weights made on the GPU by each server at start; no checkpoint on disk). With decisive
#    logits (workers/bench_model.make_logits_decisive_) it also writes "repeat" prompts: 128 tokens whose
#    greedy continuation the prompt already holds for 96 tokens (an n-gram drafter's best case).
# 2. `python -m loadtest sweep`: per server configuration (ar = --spec off; ngram = --spec ngram --policy
#    hybridspec) one `hybridspec serve` on 127.0.0.1 (CUDA graphs are on by default in the engine), closed
#    loops at concurrency 1, 4, 16, 64, each sending new requests for POINT_S seconds after WARMUP requests;
#    output 64-128 tokens (greedy, ignore EOS). The sweep gets SIGINT after BUDGET_S seconds (no new requests,
#    in-flight ones finish, results and plots are written).
# 3. $OUT/loadtest/: sweep.json, throughput_vs_concurrency.png, p99_vs_concurrency.png, meta.json (date, commit,
#    GPU, options), sweep.log, runs.tar.gz (every point's result.json / requests.jsonl, the servers' logs).
#
# Knobs (environment): LAYERS (40), CONC (1,4,16,64), POINT_S (15), WARMUP (2), BUDGET_S (380),
# WORKLOAD (repeat | random: random token-id prompts of 128 tokens, on which n-gram drafts almost nothing),
# MAX_NEW (uniform:64:128), PYTHON (python3); a CPU dry run of the plumbing (numbers mean nothing):
# DEVICE=cpu DTYPE=float32 MODEL_ARGS=--tiny LAYERS=2 CONC=1,2 POINT_S=2 OUT=/tmp/x bash bench/loadtest_gpu.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUTDIR=${OUT:-$ROOT/loadtest-results/gpu}/loadtest
WORK=${WORK:-/tmp/hybridspec-loadtest}
LAYERS=${LAYERS:-40}
CONC=${CONC:-1,4,16,64}
POINT_S=${POINT_S:-15}
WARMUP=${WARMUP:-2}
BUDGET_S=${BUDGET_S:-380}
WORKLOAD=${WORKLOAD:-repeat}
MAX_NEW=${MAX_NEW:-uniform:64:128}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
MODEL_ARGS=${MODEL_ARGS:-}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
START=$(date +%s)
log() { echo "[loadtest_gpu +$(( $(date +%s) - START ))s] $*"; }

mkdir -p "$OUTDIR"
rm -rf "$WORK" && mkdir -p "$WORK"
COMMIT=${HYBRIDSPEC_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}
DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
log "commit $COMMIT, $DATE, GPU ${GPU:-none seen}, $LAYERS layers, concurrency $CONC, ${POINT_S}s per point"

# the device image's grpcio (1.84) is older than the committed stubs need (>= 1.85.1): wheels carried in WHEELS
# (build/loadtest-wheels, made here by: pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux2014_x86_64 -d build/loadtest-wheels grpcio==1.85.3) go first
WHEELS=${WHEELS:-$ROOT/build/loadtest-wheels}
if ! "$PY" -c "import engine.server" >/dev/null 2>&1 && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$WORK/site:$PYTHONPATH"
    log "installed $(cd "$WHEELS" && ls *.whl | tr '\n' ' ')into $WORK/site"
fi
# the engine's imports (grpc, protobuf stubs, tokenizers, matplotlib) work with this Python, or stop now
if ! "$PY" -c "import engine.server, loadtest.sweep, loadtest.plots, tokenizers, torch; assert '$DEVICE' == 'cpu' or torch.cuda.is_available()"; then
    log "ERROR: this Python cannot run the server or the load test (see above; a grpcio version error: carry"
    log "       build/loadtest-wheels, made as the WHEELS comment above says)"; exit 1
fi

# 1. the model directory (and the repeat prompts where decisive logits exist)
MODEL=$WORK/bench-model
if [ "$WORKLOAD" = repeat ] && ! "$PY" -c "from workers.bench_model import make_logits_decisive_" 2>/dev/null; then
    log "workers/bench_model.py has no decisive logits: random prompts instead of repeat prompts"; WORKLOAD=random
fi
if [ "$WORKLOAD" = repeat ]; then
    "$PY" -m bench.bench_model_dir --out "$MODEL" --layers "$LAYERS" --routing zipf --decisive $MODEL_ARGS \
        --prompts-out "$WORK/prompts.jsonl" --num-prompts 512 || exit 1
    LOAD=(--prompts "$WORK/prompts.jsonl")
else
    "$PY" -m bench.bench_model_dir --out "$MODEL" --layers "$LAYERS" --routing zipf $MODEL_ARGS || exit 1
    LOAD=(--prompt-len-dist fixed:128)
fi
log "model directory $MODEL, workload $WORKLOAD"

# 2. the sweep (servers on loopback only: --serve-host 127.0.0.1)
SWEEP=$WORK/sweep
timeout --preserve-status -s INT -k 90 "$BUDGET_S" "$PY" -m loadtest sweep \
    --serve-cmd "$PY -m engine.cli serve" \
    --serve-args "$MODEL --device $DEVICE --dtype $DTYPE --max-model-len 1024 --max-running 64" \
    --serve-host 127.0.0.1 \
    --config "name=ar:--spec off" \
    --config "name=ngram:--spec ngram --policy hybridspec" \
    --concurrency "$CONC" --duration "$POINT_S" --warmup "$WARMUP" \
    "${LOAD[@]}" --max-new-tokens-dist "$MAX_NEW" --ignore-eos --temperature 0 \
    --startup-timeout 240 --wait 60 --out "$SWEEP" 2>&1 | tee "$OUTDIR/sweep.log"
STATUS=$?
log "sweep exited with status $STATUS"

# 3. results: plots rebuilt from the per-point results if the sweep was cut short before writing them
"$PY" - "$SWEEP" "$OUTDIR" "$COMMIT" "$DATE" "${GPU:-unknown}" "$STATUS" "$WORKLOAD" <<'EOF'
import json, shutil, sys
from pathlib import Path
sweep_dir, out, commit, date, gpu, status, workload = sys.argv[1:]
sweep_dir, out = Path(sweep_dir), Path(out)
sweep_file = sweep_dir / "sweep.json"
if sweep_file.is_file():
    runs = json.loads(sweep_file.read_text())["runs"]
else:
    from loadtest import plots
    from loadtest.sweep import HEADLINE
    runs = []
    for f in sorted(sweep_dir.glob("*/c*/result.json"), key=lambda p: (p.parts[-3], int(p.parts[-2][1:]))):
        r = json.loads(f.read_text())
        runs.append({"config": f.parts[-3], "concurrency": int(f.parts[-2][1:]), "dir": f"{f.parts[-3]}/{f.parts[-2]}",
                     "memory_free_after": None, "result": {k: r[k] for k in HEADLINE}})
    if runs:
        plots.sweep_throughput(runs, sweep_dir / "throughput_vs_concurrency.png")
        plots.sweep_p99(runs, sweep_dir / "p99_vs_concurrency.png")
    sweep_file.write_text(json.dumps({"runs": runs, "incomplete": True}, indent=2) + "\n")
for name in ("sweep.json", "throughput_vs_concurrency.png", "p99_vs_concurrency.png"):
    if (sweep_dir / name).is_file():
        shutil.copy(sweep_dir / name, out / name)
meta = {"date": date, "commit": commit, "gpu": gpu, "sweep_exit_status": int(status), "workload": workload,
        "model": json.loads((sweep_dir.parent / "bench-model" / "random_weights.json").read_text()),
        "layers": json.loads((sweep_dir.parent / "bench-model" / "config.json").read_text())["num_hidden_layers"],
        "points": [(r["config"], r.get("concurrency"), "error" if "error" in r else "ok") for r in runs]}
(out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
print(json.dumps(meta))
EOF
tar -czf "$OUTDIR/runs.tar.gz" --exclude='*.png' -C "$WORK" sweep
log "done: $(ls "$OUTDIR" | tr '\n' ' ')"
if [ "$STATUS" = 130 ] || [ "$STATUS" = 124 ]; then log "the sweep was stopped at BUDGET_S=${BUDGET_S}s: the points it finished are in"; exit 0; fi
exit "$STATUS"
