#!/usr/bin/env bash
# vskipper in SGLang on your own GPU: upstream SGLang beside SGLang + vskipper, side by side, on the
# Llama-3-8B shape with random weights (--load-format dummy: nothing is downloaded), CUDA graphs on,
# timed by SGLang's own serving benchmark (python -m sglang.benchmark.serving), decode-heavy and
# prefill-heavy; vskipper's route counters on /metrics prove the routed path ran. One table at the end.
# Needs a python with SGLang's CUDA install and vskipper installed into it (pip install -e . from this
# repository, so that SGLang finds vskipper's plugin), and one GPU with room for three 8B servers
# (about 80 GB: an H100 or larger). It cds to the repo root and sets PYTHONPATH itself.
#
#   bash benchmarks/gpu/sglang_check.sh                      # on a GPU: everything under $OUT
#   bash benchmarks/gpu/sglang_check.sh --smoke              # a tiny Llama on CPU (CI: tests/test_sglang_check.py)
#   bash benchmarks/gpu/sglang_check.sh --model-path DIR     # another model directory (its config.json;
#                                                            # add --load-format auto for its real weights)
# Options: --port P (servers on P, P+1, P+2; default 31000), --execution routed|auto|dense|routed-mlp
# (default routed; auto measures a cost calibration at the first start when there is none), --rounds N
# (default 3; --smoke 1), --decode IN,OUT,PROMPTS,CONCURRENCY (default 128,512,128,64), --prefill ...
# (default 4096,16,64,8), --kv-tokens N (KV pool per server; default what three servers leave room for,
# at most 65536), --time-limit S (default 1800; --smoke 300), -- FLAGS... (more flags for every server).
#
# Systems: upstream (`python -m sglang.launch_server`, vskipper's plugin not loaded), vskipper with
# RandomSkip at rate 0 (`vskipper serve`: the routed path, nothing skipped: vskipper's own cost) and
# at rate 0.5 over the upper half of the layers (16-31 of 32). A warm-up call per workload and server,
# then per round and workload each server in a shuffled order, one at a time.
# $OUT (default: a new temp dir): sglang-check.md (the table and the checks), results.json, logs/
# (one per server), bench/ (each benchmark call's output and JSONL), model/ and tokenizer/ (written here).
# Exit status: 0 if every check passed, 1 if any failed (or the time ran out), 2 on bad input (no SGLang
# or vskipper in this python, no GPU without --smoke, a port in use, an unknown flag, too little GPU memory).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
SMOKE=0
PORT=31000
LIMIT=""
ARGS=()
SERVER_ARGS=()
need() { [ $# -ge 2 ] && [ -n "$2" ] || { echo "sglang_check.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) SMOKE=1; ARGS+=(--smoke) ;;
        --port) need "$@"; PORT=$2; shift ;;
        --time-limit) need "$@"; LIMIT=$2; shift ;;
        --model-path|--load-format|--execution|--rounds|--decode|--prefill|--kv-tokens) need "$@"; ARGS+=("$1" "$2"); shift ;;
        --) shift; SERVER_ARGS=("$@"); break ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        *) echo "sglang_check.sh: unknown argument '$1' (expected --smoke, --model-path DIR, --port P, --execution E," \
                "--rounds N, --decode/--prefill IN,OUT,PROMPTS,CONCURRENCY, --kv-tokens N, --load-format F," \
                "--time-limit S, -- SERVER FLAGS, --help)" >&2; exit 2 ;;
    esac
    shift
done
[[ "$PORT" =~ ^[0-9]+$ ]] && [ "$PORT" -ge 1024 ] && [ "$PORT" -le 65533 ] \
    || { echo "sglang_check.sh: --port '$PORT': expected an integer in 1024..65533" >&2; exit 2; }
[ -z "$LIMIT" ] && LIMIT=$([ "$SMOKE" -eq 1 ] && echo 300 || echo 1800)
[[ "$LIMIT" =~ ^[0-9]+$ ]] && [ "$LIMIT" -ge 60 ] || { echo "sglang_check.sh: --time-limit '$LIMIT': expected seconds >= 60" >&2; exit 2; }
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
rm -f "$OUT/servers.pids"

# --- env: what this check needs, or a clear message and exit 2 ----------------------------------
if ! command -v "$PY" > /dev/null; then echo "sglang_check.sh: no python at '$PY' (set PYTHON=...)" >&2; exit 2; fi
"$PY" - "$SMOKE" "$PORT" <<'EOF' || exit 2
import importlib.util, socket, sys
from importlib.metadata import entry_points
smoke, port = sys.argv[1] == "1", int(sys.argv[2])
missing = [m for m in ("torch", "sglang", "vskipper", "transformers", "tokenizers", "requests")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"sglang_check.sh: missing python package(s): {', '.join(missing)} (this check needs SGLang installed "
             f"(its CUDA build on a GPU) and vskipper installed into the same python: pip install -e .)")
if "vskipper" not in {ep.name for ep in entry_points(group="sglang.srt.plugins")}:
    sys.exit("sglang_check.sh: vskipper's SGLang plugin is not registered in this python (entry point group "
             "sglang.srt.plugins): install vskipper into it (pip install -e . from the repository), not only on PYTHONPATH")
import os
allowed = os.environ.get("SGLANG_PLUGINS", "")
if allowed and "vskipper" not in {x.strip() for x in allowed.split(",")}:
    sys.exit(f"sglang_check.sh: SGLANG_PLUGINS={allowed!r} leaves vskipper's plugin out: unset it or add vskipper")
import sglang, torch
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"python {sys.version.split()[0]} | torch {torch.__version__} (cuda {torch.version.cuda}) | sglang "
      f"{sglang.__version__} | {dev}")
if not smoke and not torch.cuda.is_available():
    sys.exit("sglang_check.sh: no CUDA device: this check needs a GPU (bash benchmarks/gpu/sglang_check.sh --smoke "
             "runs it with a tiny model on CPU)")
for p in (port, port + 1, port + 2):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p))
        except OSError as e:
            sys.exit(f"sglang_check.sh: port {p} is in use ({e.strerror}): the servers take ports {port}-{port + 2}; "
                     f"choose others with --port")
EOF

# --- every server this run starts is stopped when it ends, however it ends -----------------------
CHILD=""
cleanup() {
    trap - EXIT INT TERM
    [ -n "$CHILD" ] && kill -TERM "$CHILD" 2> /dev/null && wait "$CHILD" 2> /dev/null
    [ -f "$OUT/servers.pids" ] || return 0
    local pg name
    while read -r pg name; do kill -TERM -- "-$pg" 2> /dev/null && echo "stopped $name (process group $pg)" >&2; done \
        < "$OUT/servers.pids"
    for _ in $(seq 30); do
        local alive=0
        while read -r pg name; do kill -0 -- "-$pg" 2> /dev/null && alive=1; done < "$OUT/servers.pids"
        [ "$alive" -eq 0 ] && return 0
        sleep 1
    done
    while read -r pg name; do kill -KILL -- "-$pg" 2> /dev/null; done < "$OUT/servers.pids"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

echo "== sglang_check: everything under $OUT (time limit ${LIMIT}s)"
timeout --kill-after=20 "$((LIMIT + 60))" "$PY" -m benchmarks.gpu.sglang_check --out "$OUT" --port "$PORT" \
    --time-limit "$LIMIT" ${ARGS[@]+"${ARGS[@]}"} \
    ${SERVER_ARGS[@]+--sglang-args "${SERVER_ARGS[*]}"} &
CHILD=$!
wait "$CHILD"
rc=$?
CHILD=""
if [ "$rc" -eq 124 ]; then
    echo "!! sglang_check timed out after ${LIMIT}s (+60 s grace); logs under $OUT" >&2
    exit 1
elif [ "$rc" -eq 137 ]; then
    echo "!! sglang_check was killed (SIGKILL: out of memory, or the time limit's hard kill); logs under $OUT" >&2
    exit 1
fi
echo "== done: status $rc; table in $OUT/sglang-check.md"
exit "$rc"
