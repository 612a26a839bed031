#!/usr/bin/env bash
# The GPU check of vskipper's grouped-execution kernels: one command, no network, under 8 minutes
# on one H200 (python3 with torch and triton preinstalled; no venv; the repo importable from here).
#
#   bash bench/gpu_check.sh            # from the repo root; with OUT=dir set, logs and table go there
#
# 1. CUDA graphs: a routed body (route_maps -> grouped_swiglu_ for RUN rows and for PROJECT rows,
#    plus masked decode attention) captured once and replayed with changing route decisions,
#    checked against eager; torch.compile of it on CUDA; opcheck; T = 0 (tests/test_ops_compile.py).
# 2. Property tests: every Triton kernel against its torch reference, HYPOTHESIS_PROFILE=gpu
#    (tests/test_kernels.py).
# 3. Timings: bench/kernel_timings.py, one markdown table (T in {16, 64, 256, 1024}, H=4096, I=14336, bf16).
# Each step has its own time limit so that a slow step cannot eat the others; the exit status is
# nonzero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
LOGS=${OUT:-$(mktemp -d)}
mkdir -p "$LOGS"
status=0
t0=$(date +%s)
step() { echo; echo "== [$(( $(date +%s) - t0 ))s] $*"; }

step "environment"
"$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "| torch", torch.__version__, "| triton", triton.__version__, "| cuda", torch.version.cuda, "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")' || exit 1
"$PY" -c 'import torch; raise SystemExit(0 if torch.cuda.is_available() else "no CUDA device: this check needs a GPU")' || exit 1

# Step 1: the custom-op layer (CUDA graphs, compile, opcheck); the CPU variant of the compile test
# is left out (inductor on CPU needs a host C++ toolchain, which this check does not rely on).
# Step 2: the kernels against their references.
export HYPOTHESIS_PROFILE=gpu

step "1/3 CUDA-graph capture and replay, torch.compile, opcheck (Triton on CUDA)"
timeout 170 "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_ops_compile.py -k "not (torch_compile and cpu)" 2>&1 \
    | tee "$LOGS/gpu_check_graphs.log" | tail -n 40
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { status=1; echo "!! step 1 failed (exit $rc; 124 = timed out)"; }

step "2/3 property tests: each kernel against its reference (HYPOTHESIS_PROFILE=gpu)"
timeout 180 "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_kernels.py --durations=8 2>&1 \
    | tee "$LOGS/gpu_check_props.log" | tail -n 60
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { status=1; echo "!! step 2 failed (exit $rc; 124 = timed out)"; }

step "3/3 timings (CUDA events, graph replay, median)"
timeout 110 "$PY" bench/kernel_timings.py --out "$LOGS/kernels.md" 2>"$LOGS/gpu_check_bench.log"
rc=$?
[ "$rc" -eq 0 ] || { status=1; echo "!! step 3 failed (exit $rc; 124 = timed out)"; tail -n 30 "$LOGS/gpu_check_bench.log"; }

step "done: status $status; logs and table in $LOGS"
exit $status
