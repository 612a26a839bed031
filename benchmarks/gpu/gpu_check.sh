#!/usr/bin/env bash
# The whole GPU evidence of vskipper in one time-boxed command (at most 9 minutes on one H200):
# python3 with torch, triton, transformers, safetensors, hypothesis and pytest preinstalled, no
# SGLang, no network, no venv; run from anywhere (it cds to the repo root and sets PYTHONPATH).
#
#   bash benchmarks/gpu/gpu_check.sh             # on a GPU; logs, results and the tuned JSON under $OUT
#   bash benchmarks/gpu/gpu_check.sh --smoke     # every step at tiny shapes on CPU (Triton interpreter,
#                                                # graphs replaced by the guarded eager step): CI
#   bash benchmarks/gpu/gpu_check.sh --only model,decode     # a subset of the steps (names below)
#
# Steps, each under its own time limit (seconds; also cut to what is left of the 535 s total):
#   env        versions and the device; missing package or no GPU: a clear message, exit 2
#   model   60 benchmarks/gpu/model_check.py: the transformed Llama-3-8B shape (random bf16 weights)
#              under CUDA graphs, RandomSkip and FlexiDepth hard/soft, replays vs eager; fp32
#              greedy tokens vs the reference on a small model
#   calibrate 60  vskipper calibrate --device cuda on one routed layer of the 8B shape (fewer
#              rounds; decode at 1k and 16k resident K/V per row: V*), then its table
#              (benchmarks/step/calibration_table.py); `auto` in decode uses it
#   tune    60 benchmarks/gpu/kernel_timings.py --tune: the fused MLP side (routed_swiglu_) at T in
#              {256, 1024}, a thinned sweep (the defaults always among the candidates)
#   kernels 45 benchmarks/gpu/kernel_timings.py with the tuned table: every op against its torch form
#              and cuBLAS on the gathered rows
#   decode 150 benchmarks/gpu/decode.py: tok/s of base, dense, routed, auto (both forms captured, one
#              replayed per step by resident K/V), routed at rate 0 (tau) and the eager base, compiled
#              and captured, over B {1,16,64,128,256} x C {1k,4k,16k} (capped by memory), beside the
#              bytes/FLOPs ideal; tau and V*
#   prefill 45 benchmarks/gpu/prefill.py: time to first token of 1k/4k/8k-token prompts, B in {1, 4}
#   profile 30 benchmarks/gpu/profile.py: kernel time per part (router and maps, attention, MLP, adapter,
#              grouped MLP side, other), base and routed, at two cells
#   ops     35 tests/test_ops_compile.py: a routed body captured and replayed, torch.compile, opcheck
#   props   50 tests/test_kernels.py: every kernel against its torch reference (HYPOTHESIS_PROFILE=cpu)
# $OUT (default: a new temp dir): summary.md, logs/<step>.log, runs/<step>/results.json, results/*.md
# (the pages: copy into docs/results/), cache/ (VSKIPPER_CACHE: the calibration and the tuned table),
# vskipper/kernel_configs/<gpu>.json. Exit status: 0 if every step passed, 1 if any failed or timed
# out (124), 2 on bad input.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
SMOKE=0
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) SMOKE=1 ;;
        --only) ONLY=",${2:?--only needs a comma-separated list of steps},"; shift ;;
        -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (expected --smoke, --only STEPS, --help)" >&2; exit 2 ;;
    esac
    shift
done
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT/logs" "$OUT/runs" "$OUT/results" "$OUT/cache" "$OUT/vskipper/kernel_configs"
export VSKIPPER_CACHE="$OUT/cache" TOKENIZERS_PARALLELISM=false
TOTAL=535                      # seconds for all steps; H200 startup and transfers are outside it
[ "$SMOKE" -eq 1 ] && TOTAL=600
t0=$(date +%s)
status=0
echo "| step | result | seconds | limit |" > "$OUT/summary.md"
echo "|---|---|---|---|" >> "$OUT/summary.md"

# run NAME LIMIT CMD...: the step's output to logs/NAME.log (its tail to the terminal), under
# min(LIMIT, time left); a failure or timeout is recorded and the next step runs.
run() {
    local name=$1 want=$2; shift 2
    if [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]]; then return 0; fi
    local left=$(( TOTAL - ($(date +%s) - t0) ))
    local limit=$(( want < left ? want : left ))
    [ "$SMOKE" -eq 1 ] && limit=$(( left < 240 ? left : 240 ))  # CPU: slower, and timings are not the point
    echo; echo "== [$(( $(date +%s) - t0 ))s] $name (limit ${limit}s): $*"
    if [ "$limit" -lt 5 ]; then
        echo "!! $name not run: no time left"
        echo "| $name | not run (no time left) | 0 | $want |" >> "$OUT/summary.md"
        status=1; return 0
    fi
    local s=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
    local rc=$?
    local took=$(( $(date +%s) - s ))
    tail -n 40 "$OUT/logs/$name.log"
    if [ "$rc" -eq 0 ]; then
        echo "| $name | ok | $took | $limit |" >> "$OUT/summary.md"
    else
        status=1
        local why="failed (exit $rc)"; [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="timed out"
        echo "!! $name $why after ${took}s; log: $OUT/logs/$name.log"
        echo "| $name | $why | $took | $limit |" >> "$OUT/summary.md"
    fi
}

# --- env: what this check needs, or a clear message and exit 2 ----------------------------------
if ! command -v "$PY" > /dev/null; then echo "gpu_check.sh: no python at '$PY' (set PYTHON=...)" >&2; exit 2; fi
"$PY" - "$SMOKE" <<'EOF' || exit 2
import importlib.util, sys
missing = [m for m in ("torch", "triton", "transformers", "safetensors", "hypothesis", "pytest", "numpy")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check.sh: missing python package(s): {', '.join(missing)} (this check needs torch, triton, "
             f"transformers, safetensors, hypothesis, pytest and numpy preinstalled; it installs nothing)")
import torch, triton, transformers
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"python {sys.version.split()[0]} | torch {torch.__version__} (cuda {torch.version.cuda}) | triton "
      f"{triton.__version__} | transformers {transformers.__version__} | {dev}")
if sys.argv[1] == "0" and not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA device: this check needs a GPU (bash benchmarks/gpu/gpu_check.sh --smoke runs it "
             "at tiny shapes on CPU)")
EOF

if [ "$SMOKE" -eq 1 ]; then
    export TRITON_INTERPRET=1            # before any kernel is decorated
    SM=--smoke
    SHAPE=64,96,4,2
    DEVICE=cpu
    TUNE="--ops routed_swiglu_ --max-candidates 2"
    OPS_K="opcheck or zero_rows or cuda_graph"
    PROPS_K="route_maps_kernel and not multi_block"
else
    SM=
    SHAPE=4096,14336,32,8
    DEVICE=cuda
    TUNE="--tokens 256 1024 --ops routed_swiglu_ --max-candidates 8"
    OPS_K="not (torch_compile and cpu)"  # inductor on CPU needs a host C++ toolchain: not relied on here
    PROPS_K=""
fi
RUNS=$OUT/runs                   # every step's results.json in runs/<step>/, its page in results/
PAGES=$OUT/results

run model 60 "$PY" -m benchmarks.gpu.model_check $SM --out "$RUNS/model" --docs "$PAGES"
if [ "$SMOKE" -eq 1 ]; then  # the CLI's flags checked, then its measurement on a 2 x 3 grid (the full one: 80 s here)
    CALIBRATE="'$PY' -m vskipper.cli calibrate --help > /dev/null && '$PY' -c 'from vskipper import calibrate, cost
cal, _ = calibrate.measure($SHAPE, device=\"cpu\", ts=(4, 16), fs=(0.0, 0.5, 1.0), repeats=1, passes=1, progress=False,
                          contexts=(16, 64))
print(\"calibration cached in\", cost.save(cal))'"
else
    CALIBRATE="'$PY' -m vskipper.cli calibrate --shape $SHAPE --device $DEVICE --repeats 2 --passes 1 --contexts 1024 16384"
fi
run calibrate 60 bash -c "$CALIBRATE && '$PY' -m benchmarks.step.calibration_table --shape $SHAPE --device $DEVICE \
    --out '$RUNS/calibration' --docs '$PAGES'"
run tune 60 bash -c "'$PY' -m benchmarks.gpu.kernel_timings $SM --tune '$VSKIPPER_CACHE/kernel_configs' $TUNE \
    && cp '$VSKIPPER_CACHE'/kernel_configs/*.json '$OUT/vskipper/kernel_configs/'"
run kernels 45 "$PY" -m benchmarks.gpu.kernel_timings $SM --out "$RUNS/kernels" --docs "$PAGES"
run decode 150 "$PY" -m benchmarks.gpu.decode $SM --out "$RUNS/decode" --docs "$PAGES"
run prefill 45 "$PY" -m benchmarks.gpu.prefill $SM --out "$RUNS/prefill" --docs "$PAGES"
run profile 30 "$PY" -m benchmarks.gpu.profile $SM --out "$RUNS/profile" --docs "$PAGES"
run ops 35 "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_ops_compile.py -k "$OPS_K"
run props 50 env HYPOTHESIS_PROFILE=cpu "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_kernels.py \
    ${PROPS_K:+-k "$PROPS_K"}

echo
echo "== [$(( $(date +%s) - t0 ))s] done: status $status; everything under $OUT"
cat "$OUT/summary.md"
exit $status
