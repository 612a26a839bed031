"""SGLang on a GPU user's own machine: upstream SGLang beside SGLang + vskipper, on one model, with
SGLang's own serving benchmark. Run through benchmarks/gpu/sglang_check.sh (which checks the
environment, time-boxes this and kills every server it started, whatever happens).

Three servers side by side, the same flags each (`--load-format dummy`: random weights, nothing
downloaded; CUDA graphs on, SGLang's defaults, decode graphs captured up to the largest concurrency;
the same KV pool size):
  upstream         `python -m sglang.launch_server`, vskipper's SGLang plugin not loaded (SGLANG_PLUGINS
                   lists every other general plugin installed)
  vskipper rate 0  `vskipper serve --skipper random:rate=0,...`: the routed path with nothing skipped
                   (vskipper's own cost)
  vskipper 0.5     `vskipper serve --skipper random:rate=0.5,layers=<upper half>,seed=0`
On a GPU they start one after another (each sizes its KV pool from the memory the others left); on
CPU (--smoke) all at once. Then, after a warm-up call of each workload on each server, `--rounds`
rounds: per round and workload, every server in a shuffled order, one at a time, each call
`python -m sglang.benchmark.serving --dataset-name random-ids --tokenize-prompt ...` (SGLang's CLI,
called in this process: `cli_main` with its argv), the route counters read off /metrics before and
after. The checks (sglang_report.py) prove the routed path ran; exit 1 if any fails.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import results as R
from benchmarks.gpu import sglang_report as rep
from benchmarks.results import log

NAME = "sglang-check"
WORKSPACE_GIB = 4.0  # per GPU server beside weights and KV pool: CUDA context, captured graphs, activations


class BadInput(Exception):
    """Input this run cannot take (a flag, the model directory, too little GPU memory): its message, exit 2."""


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    prompts: int
    concurrency: int

    def __post_init__(self) -> None:
        for f in ("input_len", "output_len", "prompts", "concurrency"):
            if getattr(self, f) < 1:
                raise ValueError(f"workload {self.name}: {f}={getattr(self, f)} must be >= 1")

    @property
    def kv_tokens(self) -> int:  # what its requests in flight hold at most
        return self.concurrency * (self.input_len + self.output_len)


@dataclass(frozen=True)
class System:
    name: str
    label: str
    rate: float | None  # RandomSkip's rate; None: upstream


SYSTEMS = (System("upstream", "upstream SGLang", None), System("vskipper-rate0", "vskipper, RandomSkip rate 0", 0.0),
           System("vskipper", "vskipper, RandomSkip 0.5", 0.5))
GPU = {"decode": "128,512,128,64", "prefill": "4096,16,64,8", "rounds": 3, "call_s": 300}
SMOKE = {"decode": "16,32,8,4", "prefill": "256,8,8,2", "rounds": 1, "call_s": 120}


def workload(name: str, text: str) -> Workload:
    try:
        i, o, n, c = (int(v) for v in text.split(","))
    except ValueError:
        raise BadInput(f"--{name.split('-')[0]} {text!r}: expected INPUT,OUTPUT,PROMPTS,CONCURRENCY "
                         f"(four integers)") from None
    try:
        return Workload(name, i, o, n, c)
    except ValueError as e:
        raise BadInput(str(e)) from None


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.sglang_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="logs, model directory, results.json, sglang-check.md")
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama on CPU (the vskipper_cpu platform)")
    ap.add_argument("--model-path", help="serve this model directory (default: a Llama-3-8B-shaped config written "
                                         "under --out; --smoke: a tiny one)")
    ap.add_argument("--load-format", default="dummy", help="SGLang's --load-format (default dummy: random weights)")
    ap.add_argument("--port", type=int, default=31000, help="the servers' ports: PORT, PORT+1, PORT+2")
    ap.add_argument("--execution", default="routed", choices=("routed", "auto", "dense", "routed-mlp"),
                    help="vskipper's body at the routed layers (auto: measures a cost calibration at the first "
                         "start when there is none)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--decode", help="decode-heavy workload INPUT,OUTPUT,PROMPTS,CONCURRENCY (default 128,512,128,64)")
    ap.add_argument("--prefill", help="prefill-heavy workload (default 4096,16,64,8)")
    ap.add_argument("--kv-tokens", type=int, help="KV pool per server (default: on a GPU what three servers leave "
                                                  "room for, at most 65536; on CPU 8192)")
    ap.add_argument("--time-limit", type=float, default=1800.0, help="seconds for everything")
    ap.add_argument("--sglang-args", default="", help="more flags for every server, one string (shlex-split)")
    args = ap.parse_args(argv)
    d = SMOKE if args.smoke else GPU
    args.workloads = [workload("decode-heavy", args.decode or d["decode"]),
                      workload("prefill-heavy", args.prefill or d["prefill"])]
    args.rounds = d["rounds"] if args.rounds is None else args.rounds
    if args.rounds < 1:
        raise BadInput(f"--rounds {args.rounds} must be >= 1")
    args.call_s = d["call_s"]
    return args


# --- the model and the GPU's memory ----------------------------------------------------------------
def model_dir(args) -> tuple[Path, Path, dict]:
    """(model directory, tokenizer directory, its config): --model-path, else a config written under
    --out; the word-level tokenizer of its vocabulary always written under --out (sglang_model.py)."""
    from benchmarks.gpu import sglang_model as M
    from benchmarks.gpu.harness import LLAMA3_8B, Shape

    if args.model_path is None:
        s, dtype = (M.SMOKE_SHAPE, "float32") if args.smoke else (LLAMA3_8B, "bfloat16")
        path = M.write_model_dir(args.out / "model", s, dtype)
    else:
        path = Path(args.model_path)
        if not (path / "config.json").is_file():
            raise BadInput(f"--model-path {path}: no config.json there (a model directory is expected)")
    cfg = json.loads((path / "config.json").read_text())
    missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
               if not isinstance(cfg.get(k), int)]
    if missing:
        raise BadInput(f"{path}/config.json lacks {', '.join(missing)} (a Llama-like config is "
                         f"expected)")
    vocab = Shape(1, 1, 1, 1, 1, int(cfg["vocab_size"]), ())
    tok = args.out / "tokenizer"
    M.write_model_dir(tok, vocab, "float32")
    (tok / "config.json").unlink()  # a tokenizer only
    return path, tok, cfg


def model_bytes(cfg: dict) -> tuple[float, float]:
    """(weight bytes, KV bytes per token) of a Llama-like config in its dtype."""
    H, I, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kvh = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or H // heads
    size = 4 if cfg.get("torch_dtype") == "float32" else 2
    per_layer = H * heads * d * 2 + H * kvh * d * 2 + 3 * H * I + 2 * H
    embed = V * H * (1 if cfg.get("tie_word_embeddings") else 2)
    return float(size * (L * per_layer + embed + H)), float(size * L * kvh * d * 2)


def gpu_kv_tokens(args, cfg: dict) -> tuple[int, str]:
    """KV tokens per server on this GPU: what three servers (weights, WORKSPACE_GIB, the pool) leave
    room for in 92% of the free memory, at most 65536, in steps of 1024. BadInput (exit 2)
    when that is below what the workloads hold in flight."""
    probe = subprocess.run([sys.executable, "-c", "import torch; f, t = torch.cuda.mem_get_info(); "
                            "print(f, t, torch.cuda.get_device_name())"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        raise BadInput(f"could not read the GPU's free memory: {probe.stderr.strip()[-500:]}")
    free, total, gpu = probe.stdout.split(maxsplit=2)
    free = float(free)
    weights, per_token = model_bytes(cfg)
    room = 0.92 * free - 3 * (weights + WORKSPACE_GIB * 2**30)
    tokens = min(65536, int(room / (3 * per_token)) // 1024 * 1024)
    need = max(w.kv_tokens for w in args.workloads)
    what = (f"{gpu.strip()}: {free / 2**30:.1f} GiB free; three servers of {weights / 2**30:.1f} GiB of weights and "
            f"{WORKSPACE_GIB:g} GiB of workspace each leave {max(tokens, 0)} KV tokens each")
    if args.kv_tokens is not None:
        tokens = args.kv_tokens
    if tokens < need:
        raise BadInput(f"{what}; the workloads hold up to {need} in flight (concurrency x (input + "
                         f"output)): lower --decode/--prefill's concurrency, or free GPU memory")
    return tokens, what


# --- servers ---------------------------------------------------------------------------------------
def plugins_but_vskipper() -> str:
    """SGLANG_PLUGINS for upstream: every general SGLang plugin installed except vskipper's (a name
    that matches none when it is the only one: SGLang then loads none)."""
    from importlib.metadata import entry_points

    names = sorted({ep.name for ep in entry_points(group="sglang.srt.plugins")} - {"vskipper"})
    return ",".join(names) or "none-but-not-vskipper"


def server_command(s: System, args, port: int, model: Path, tok: Path, layers: str, kv_tokens: int,
                   max_bs: int) -> tuple[list[str], dict]:
    import shlex

    from vskipper.serve import CPU_DEFAULTS

    flags = ["--tokenizer-path", str(tok), "--load-format", args.load_format, "--host", "127.0.0.1", "--port",
             str(port), "--max-total-tokens", str(kv_tokens), "--enable-metrics", "--sleep-on-idle",
             "--log-level", "info"]
    from benchmarks.serving.servers import unused_model_modules

    env = {k: v for k, v in os.environ.items() if not k.startswith("VSKIPPER_")}
    if "SGLANG_DISABLED_MODEL_ARCHS" not in env and (unused := unused_model_modules(str(model))):
        env["SGLANG_DISABLED_MODEL_ARCHS"] = ",".join(unused)  # start-up only: SGLang imports no unused model module
    env["SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"] = f"file://{(args.out / 'logs' / f'dist-store-{port}').resolve()}"
    if args.smoke:
        env.update(SGLANG_PLATFORM="vskipper_cpu", OMP_NUM_THREADS="1")
        flags += [a for flag, value in CPU_DEFAULTS.items() if flag != "--max-total-tokens" for a in (flag, value)]
        flags += ["--mem-fraction-static", "0.95"]  # servers start at once: the others' loading eats the slack
    else:
        flags += ["--mem-fraction-static", "0.9", "--cuda-graph-max-bs-decode", str(max_bs)]
    flags += shlex.split(args.sglang_args)
    if s.rate is None:
        env["SGLANG_PLUGINS"] = plugins_but_vskipper()
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), *flags], env
    skipper = f"random:rate={s.rate:g},layers={layers},seed=0"
    return [sys.executable, "-m", "vskipper.cli", "serve", "--model-path", str(model), "--skipper", skipper,
            "--execution", args.execution, *flags], env


class Servers:
    """The servers of one run; each in a session of its own, its process group id appended to
    <out>/servers.pids as it starts (so that sglang_check.sh's trap stops it even if this process is
    killed), stopped by `stop_all`."""

    def __init__(self, out: Path) -> None:
        self.out, self.procs = out, {}
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, name: str, cmd: list[str], env: dict) -> None:
        log_path = self.out / "logs" / f"server-{name}.log"
        with open(log_path, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        with open(self.out / "servers.pids", "a") as f:
            f.write(f"{proc.pid} {name}\n")
        self.procs[name] = proc

    def wait(self, name: str, url: str, timeout: float) -> None:
        from benchmarks.serving.servers import wait_healthy

        problem = wait_healthy(url, self.procs[name], timeout)
        if problem is not None:
            tail = (self.out / "logs" / f"server-{name}.log").read_text(errors="replace").splitlines()[-25:]
            raise RuntimeError(f"server {name} {problem}; its log's last lines:\n" + "\n".join(tail))

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def get(url: str, path: str) -> str:
    import requests

    r = requests.get(url + path, timeout=30)
    r.raise_for_status()
    return r.text


# --- SGLang's benchmark client ---------------------------------------------------------------------
class Timeout(Exception):
    pass


def bench_argv(port: int, w: Workload, tok: Path, seed: int, out_file: Path, prompts: int, output_len: int):
    return ["--backend", "sglang", "--host", "127.0.0.1", "--port", str(port), "--dataset-name", "random-ids",
            "--tokenize-prompt", "--tokenizer", str(tok), "--random-input-len", str(w.input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "1.0", "--num-prompts", str(prompts),
            "--max-concurrency", str(w.concurrency), "--seed", str(seed), "--flush-cache", "--disable-tqdm",
            "--output-file", str(out_file)]


def run_bench(argv: list[str], log_path: Path, limit: float) -> dict | None:
    """One `python -m sglang.benchmark.serving ARGV` (SGLang's cli_main, in this process: its imports
    paid once), its output to log_path, under a SIGALRM of `limit` s; its JSONL record, or None."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang's quantization modules warn on import without a GPU
        import sglang.benchmark.serving as sb
    out_file = Path(argv[argv.index("--output-file") + 1])
    out_file.unlink(missing_ok=True)

    def alarm(signum, frame):
        raise Timeout(f"over {limit:.0f} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(max(1, int(limit)))
    saved = sys.argv
    try:
        with open(log_path, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            print("$ python -m sglang.benchmark.serving " + " ".join(argv), flush=True)
            sys.argv = ["python -m sglang.benchmark.serving", *argv]
            try:
                sb.cli_main()
            except (Exception, SystemExit, Timeout) as e:  # noqa: BLE001 - recorded; the run goes on
                print(f"sglang_check: the benchmark call failed: {type(e).__name__}: {e}", flush=True)
                return None
    finally:
        sys.argv = saved
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if not out_file.is_file():
        return None
    record = json.loads(out_file.read_text().strip().splitlines()[-1])
    record.pop("server_info", None)  # the whole server_args: kept once per server instead
    return record


@dataclass
class Run:
    """One run's servers, where they listen, and what it measured."""

    args: argparse.Namespace
    tok: Path
    ports: dict
    t0: float
    calls: list
    counts: dict
    checks: list

    def left(self) -> float:
        return self.args.time_limit - (time.monotonic() - self.t0)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def call(self, s: System, w: Workload, tag: str, seed: int, prompts: int, output_len: int) -> dict | None:
        work = self.args.out / "bench"
        work.mkdir(exist_ok=True)
        argv = bench_argv(self.ports[s.name], w, self.tok, seed, work / f"{tag}.jsonl", prompts, output_len)
        return run_bench(argv, work / f"{tag}.log", min(self.args.call_s, self.left()))

    def warm_up(self) -> None:
        """Each workload once per server, short, unmeasured: the first batches of each shape (Triton's
        first compiles among them) happen here."""
        for w in self.args.workloads:
            for s in SYSTEMS:
                if self.call(s, w, f"warmup-{w.name}-{s.name}", 1, w.concurrency, min(w.output_len, 16)) is None:
                    raise RuntimeError(f"the warm-up call on {s.name} failed; see "
                                       f"{self.args.out}/bench/warmup-{w.name}-{s.name}.log")

    def measure(self) -> None:
        """Per round and workload every server in a shuffled order, one at a time; the route counters
        read before and after each call."""
        order = random.Random(0)
        for r in range(self.args.rounds):
            for w in self.args.workloads:
                for s in order.sample(SYSTEMS, len(SYSTEMS)):
                    tag = f"{w.name}-{s.name}-r{r}"
                    before = rep.parse_counts(get(self.url(s.name), "/metrics"))
                    res = self.call(s, w, tag, 1000 + r, w.prompts, w.output_len)
                    delta = rep.counts_delta(rep.parse_counts(get(self.url(s.name), "/metrics")), before)
                    key = (w.name, s.name)
                    self.counts[key] = rep.add_counts(self.counts[key], delta) if key in self.counts else delta
                    self.calls.append({"workload": w.name, "system": s.name, "round": r, "result": res})
                    self.checks.append(rep.Check(f"{tag}: every request completed",
                                                 res is not None and res.get("completed") == w.prompts,
                                                 "no result (see its log)" if res is None else
                                                 f"{res.get('completed')}/{w.prompts} completed"))
                    log(f"{tag}: " + ("FAILED" if res is None else f"{res['output_throughput']:.1f} output tok/s, "
                                      f"TTFT {res['mean_ttft_ms']:.1f} ms, TPOT {res['mean_tpot_ms']:.2f} ms"))


def main(argv=None) -> int:
    from benchmarks.gpu.sglang_model import routed_range

    try:
        args = parse(argv)
        args.out.mkdir(parents=True, exist_ok=True)
        model, tok, cfg = model_dir(args)
        kv_tokens, memory = (args.kv_tokens or 8192, "CPU") if args.smoke else gpu_kv_tokens(args, cfg)
    except BadInput as e:
        print(f"sglang_check: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # so that `finally` stops the servers
    layers = routed_range(int(cfg["num_hidden_layers"]))
    lo, hi = (int(x) for x in layers.split("-"))
    max_bs = max(w.concurrency for w in args.workloads)
    run = Run(args, tok, {s.name: args.port + i for i, s in enumerate(SYSTEMS)}, time.monotonic(), [], {}, [])
    servers, info = Servers(args.out), {}
    try:
        for s in SYSTEMS:  # on a GPU one after another: each sizes its pool from what the others left
            servers.start(s.name, *server_command(s, args, run.ports[s.name], model, tok, layers, kv_tokens, max_bs))
            log(f"started {s.name} on port {run.ports[s.name]} (log: {args.out}/logs/server-{s.name}.log)")
            if not args.smoke:
                servers.wait(s.name, run.url(s.name), max(10.0, run.left() - 60))
        for s in SYSTEMS:
            servers.wait(s.name, run.url(s.name), max(10.0, run.left() - 60))
            info[s.name] = server_facts(get(run.url(s.name), "/server_info"),
                                        (args.out / "logs" / f"server-{s.name}.log").read_text(errors="replace"))
            log(f"{s.name} ready: {info[s.name]}")
        run.checks += server_checks(info, args.smoke)
        run.warm_up()
        log("warm-up done")
        run.measure()
        for s in SYSTEMS:
            total = None
            for w in args.workloads:
                c = run.counts[w.name, s.name]
                total = c if total is None else rep.add_counts(total, c)
            run.checks += rep.check_counts(s.name, s.rate, list(range(lo, hi + 1)), total)
    except Exception as e:  # noqa: BLE001 - a failed run still writes its page and exits 1
        run.checks.append(rep.Check("run", False, f"{type(e).__name__}: {e}"))
        log(f"FAILED: {type(e).__name__}: {e}")
    finally:
        servers.stop_all()
    head = (f"{'Smoke run on CPU (tiny Llama, fp32): timings mean nothing. ' if args.smoke else ''}"
            f"Model {model} ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
            f"--load-format {args.load_format}); routed layers {layers}; vskipper --execution {args.execution}; "
            f"SGLang {info.get('upstream', {}).get('version', '?')}; KV pool {kv_tokens} tokens per server "
            f"({memory}); decode CUDA graphs: "
            + ", ".join(f"{n} {i.get('decode_graphs', '?')}" for n, i in info.items()) + "; prefill CUDA graphs: "
            + ", ".join(f"{n} {i.get('prefill_graphs', '?')}" for n, i in info.items()) + f"; {args.rounds} round(s).")
    md = rep.report(args.workloads, list(SYSTEMS), run.calls, run.counts, run.checks, head)
    results = {"workloads": [w.__dict__ for w in args.workloads], "systems": [s.__dict__ for s in SYSTEMS],
               "servers": info, "calls": run.calls, "checks": [c.__dict__ for c in run.checks],
               "counts": [{"workload": w, "system": s, "layers": c.layers, "phases": c.phases}
                          for (w, s), c in run.counts.items()], "passed": all(c.ok for c in run.checks)}
    R.write_results(NAME, results, md, args.out, docs=args.out)
    print(md)
    return 0 if results["passed"] else 1


def server_facts(server_info: str, log_text: str) -> dict:
    """What the run states about a server: SGLang's version, KV pool, CUDA graphs (the resolved decode
    and prefill backends, the decode batch sizes, the log's decode capture line), attention backend, and
    vskipper's transform line."""
    d = json.loads(server_info)
    graphs = (d.get("cuda_graph_config") or {}).get("decode") or {}
    prefill = (d.get("cuda_graph_config") or {}).get("prefill") or {}
    transform = [x for x in log_text.splitlines() if "vskipper: transformed" in x]
    return {"version": d.get("version"), "max_total_num_tokens": d.get("max_total_num_tokens"),
            "attention_backend": d.get("attention_backend"), "decode_graphs": graphs.get("backend"),
            "prefill_graphs": prefill.get("backend"),
            "decode_graph_bs": graphs.get("bs"),
            "captured": [x.split("] ", 1)[-1] for x in log_text.splitlines()  # "Capture target decode CUDA graph end."
                         if "Capture " in x and " decode " in x and " end. " in x][-1:],
            "transform": transform[-1].split("vskipper: ", 1)[1] if transform else None}


def server_checks(info: dict, smoke: bool) -> list:
    pools = {i["max_total_num_tokens"] for i in info.values()}
    out = [rep.Check("the servers' KV pools are equal", len(pools) == 1,
                     ", ".join(f"{n} {i['max_total_num_tokens']}" for n, i in info.items()))]
    for n, i in info.items():
        want = i["transform"] is None if n == "upstream" else i["transform"] is not None
        out.append(rep.Check(f"{n}: {'not ' if n == 'upstream' else ''}transformed by vskipper", want,
                             i["transform"] or "no 'vskipper: transformed' line in its log"))
        if not smoke:
            out.append(rep.Check(f"{n}: decode CUDA graphs captured", i["decode_graphs"] not in (None, "disabled")
                                 and bool(i["captured"]), f"backend {i['decode_graphs']}; {'; '.join(i['captured'])}"))
    return out


if __name__ == "__main__":
    sys.exit(main())
