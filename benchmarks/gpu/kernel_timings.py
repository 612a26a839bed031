"""Time vskipper's grouped-execution ops: Triton kernel vs the fixed-shape torch reference vs plain
torch/cuBLAS on exactly the gathered rows, side by side in one run. Prints one markdown table.

    python -m benchmarks.gpu.kernel_timings                  # T in {16, 64, 256, 1024}, H=4096, I=14336, bf16, 75% RUN
    python -m benchmarks.gpu.kernel_timings --out DIR        # results.json into DIR (default out/gpu-kernels[-untuned])
    python -m benchmarks.gpu.kernel_timings --tune DIR       # sweep configs per token bucket: DIR/<gpu>.json
    python -m benchmarks.gpu.kernel_timings --smoke          # tiny shapes on CPU (Triton interpreter): the script runs
    python -m benchmarks.gpu.kernel_timings --smoke --tune DIR   # the sweep too, a few candidates (unused on CPU)

Legend: T = rows in the batch (the captured capacity), n = rows that RUN (the device-side count),
H = hidden, I = MLP width. Times are microseconds per call, the median of 7 replays of a CUDA graph
holding `reps` calls (what a captured decode step pays), and for Triton also the eager time of one
call (Python and launch overhead included). "base" is plain torch on the n gathered rows, exact
count and pre-gathered (cuBLAS for the GEMMs): the best a dynamic-shape path could do. The results
are named gpu-kernels with the tuned table (if one is found), gpu-kernels-untuned with --untuned.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import results as R


@dataclasses.dataclass(frozen=True)
class Config:
    op: str
    T: int
    n: int


@dataclasses.dataclass(frozen=True)
class Result:
    config: Config
    triton_us: float
    triton_eager_us: float
    ref_us: float
    base_us: float | None
    check: str
    figure: str  # the figure people care about: TFLOP/s for GEMMs, GB/s for memory-bound ops


# route and routed_swiglu_ are what a fixed-shape routed layer launches at decode (decisions + maps + counts;
# the MLP side with the adapter's cohort); cache_decode_attention its attention on transformers' cache,
# masked_decode_attention on SGLang's pool; route_maps and grouped_swiglu_ the unfused forms
OPS = ("route", "routed_swiglu_", "cache_decode_attention", "masked_decode_attention", "route_maps", "grouped_swiglu_")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.kernel_timings", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("NH", "KVH", "D"))
    p.add_argument("--context", type=int, default=1024, help="decode context length for attention")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--run-fraction", type=float, default=0.75)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    R.add_arguments(p, None)
    p.add_argument("--tune", type=Path, metavar="DIR", help="sweep configs and write a stamped table into DIR")
    p.add_argument("--max-candidates", type=int, default=0,
                   help="with --tune: at most this many candidates per sweep stage, evenly spaced, besides the "
                        "defaults (0: all)")
    p.add_argument("--untuned", action="store_true",
                   help="the ops' untuned default launch configs (as VSKIPPER_AUTOTUNE=0 in SGLang)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    a = p.parse_args()
    if a.smoke:
        a.tokens, a.hidden, a.inter, a.heads, a.context, a.dtype = [4, 16], 64, 96, [4, 2, 16], 40, "fp32"
    return a


ARGS = parse()
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vskipper import kernel_configs, ops  # noqa: E402

CUDA = torch.cuda.is_available() and not ARGS.smoke
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[ARGS.dtype]
REPLAYS = 7
TUNED = not ARGS.untuned  # launch configs: this GPU's tuned table where one is trusted, else the defaults


# --- timing ------------------------------------------------------------------------------------
def eager_us(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    if not CUDA:
        t = []
        for _ in range(3):
            s = time.perf_counter()
            fn()
            t.append((time.perf_counter() - s) * 1e6)
        return statistics.median(t)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def graph_us(fn, budget_us: float = 3000.0) -> float:
    """Per-call time inside a CUDA graph of `reps` calls (reps sized to about budget_us)."""
    if not CUDA:
        return eager_us(fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    reps = int(min(50, max(3, budget_us / max(eager_us(fn, 5), 1.0))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    del graph
    return statistics.median(times)


def compare(a: torch.Tensor, b: torch.Tensor) -> str:
    scale = b.float().abs().max().clamp(min=1e-6)
    err = ((a.float() - b.float()).abs().max() / scale).item()
    return "ok" if err < (2e-2 if DTYPE != torch.float32 else 1e-4) else f"MISMATCH {err:.2g}"


# --- one case per op ---------------------------------------------------------------------------
def make_batch(T: int, n: int):
    g = torch.Generator().manual_seed(T)
    run = torch.zeros(T, dtype=torch.bool)
    run[torch.randperm(T, generator=g)[:n]] = True
    run = run.to(DEV)
    rows, _, counts = ops.route_maps(run, impl="torch")
    return g, run, rows, counts[0:1]


def rnd(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DTYPE).to(DEV)


def case(op: str, T: int, n: int):
    """(fn(impl), base() | None, output-of-fn getter, flops, bytes) for op at capacity T with n RUN rows."""
    H, I = ARGS.hidden, ARGS.inter
    g, run, rows, count = make_batch(T, n)
    rn = rows[:n].long()  # host-side slice: only the baselines use it
    if op == "route_maps":
        return ((lambda impl: ops.route_maps(run, impl=impl, tuned=TUNED)), None, (lambda r: r[0][:n]), 0,
                T * (1 + 2 * 4))
    if op == "grouped_swiglu_":
        x, out, res = rnd(g, T, H), rnd(g, T, H), rnd(g, T, H)
        wg, wu, wd = rnd(g, I, H, scale=H ** -0.5), rnd(g, I, H, scale=H ** -0.5), rnd(g, H, I, scale=I ** -0.5)
        w = torch.rand(T, generator=g).to(DEV)
        xg = x.index_select(0, rn)
        return (lambda impl: ops.grouped_swiglu_(out, res, x, rows, count, wg, wu, wd, w, impl=impl,
                                                 tuned=TUNED) or out), \
            (lambda: (F.silu(xg @ wg.T) * (xg @ wu.T)) @ wd.T), (lambda r: r.clone()), 6 * n * H * I, \
            3 * wg.numel() * wg.element_size()
    if op == "masked_decode_attention":
        nh, kvh, d = ARGS.heads
        C = ARGS.context
        P = T * C
        q, k, v = rnd(g, T, nh, d), rnd(g, P, kvh, d), rnd(g, P, kvh, d)
        req_to_token = torch.randperm(P, generator=g).to(torch.int32).view(T, C).to(DEV)
        rpi = torch.arange(T, device=DEV)
        lens = torch.full((T,), C, device=DEV)
        return (lambda impl: ops.masked_decode_attention(q, k, v, req_to_token, rpi, lens, run, d ** -0.5, impl=impl,
                                                           tuned=TUNED)), \
            None, \
            (lambda r: r), 4 * n * nh * C * d, 2 * n * C * kvh * d * k.element_size()
    if op == "route":  # a router's gates: sanitized, thresholded, mapped and counted
        gate = torch.rand(T, generator=g).to(DTYPE).to(DEV)
        counter, phase = torch.zeros(2, 3, dtype=torch.int64, device=DEV), torch.tensor([0, 1], device=DEV)
        return ((lambda impl: ops.route(gate, None, counter, phase, 0.5, impl=impl, tuned=TUNED)[2]), None,
                (lambda r: r[2]), 0, T * (gate.element_size() + 1 + 2 * 4))
    if op == "routed_swiglu_":  # n RUN rows through the MLP, T - n PROJECT rows through an I/16 adapter
        Ia = max(1, I // 16)
        h, a, out = rnd(g, T, H), rnd(g, T, H), rnd(g, T, H)
        mlp = (rnd(g, I, H, scale=H ** -0.5), rnd(g, I, H, scale=H ** -0.5), rnd(g, H, I, scale=I ** -0.5))
        ad = (rnd(g, Ia, H, scale=H ** -0.5), rnd(g, Ia, H, scale=H ** -0.5), rnd(g, H, Ia, scale=Ia ** -0.5))
        nw, w = rnd(g, H).abs() + 0.5, torch.rand(T, generator=g).to(DTYPE).to(DEV)
        maps = ops.route_maps(run, impl="torch")
        pn = (~run).nonzero().squeeze(1)
        hg, hp = (h + a).index_select(0, rn), h.index_select(0, pn)

        def base():  # cuBLAS on exactly the rows of each cohort (their norms and combines not counted)
            return ((F.silu(hg @ mlp[0].T) * (hg @ mlp[1].T)) @ mlp[2].T,
                    (F.silu(hp @ ad[0].T) * (hp @ ad[1].T)) @ ad[2].T)
        return (lambda impl: ops.routed_swiglu_(out, h, a, maps, mlp, ad, nw, 1e-5, w, None, impl=impl,
                                                tuned=TUNED) or out), base, (lambda r: r.clone()), \
            6 * H * (n * I + (T - n) * Ia), 3 * (I + Ia) * H * h.element_size()
    if op == "cache_decode_attention":  # T rows over their own contiguous caches of --context positions
        nh, kvh, d = ARGS.heads
        C = ARGS.context
        q, k, v = rnd(g, T, nh, d), rnd(g, T, kvh, C, d), rnd(g, T, kvh, C, d)
        return (lambda impl: ops.cache_decode_attention(q, k, v, None, run, d ** -0.5, impl=impl, tuned=TUNED)), \
            None, (lambda r: r), 4 * n * nh * C * d, 2 * n * C * kvh * d * k.element_size()
    raise ValueError(f"unknown op {op!r}")


def measure(cfg: Config) -> Result:
    fn, base, view, flops, nbytes = case(cfg.op, cfg.T, cfg.n)
    triton_fn, torch_fn = (lambda: fn("triton")), (lambda: fn("torch"))
    got = view(triton_fn())
    t_eager = eager_us(triton_fn)
    t_triton = graph_us(triton_fn)
    check = compare(got, view(torch_fn()))
    t_ref = graph_us(torch_fn)
    t_base = graph_us(base) if base is not None else None
    if flops:
        figure = f"{flops / t_triton / 1e6:.0f} TFLOP/s"
    else:
        figure = f"{nbytes / t_triton / 1e3:.0f} GB/s"
    return Result(cfg, t_triton, t_eager, t_ref, t_base, check, figure)


def table(results: list[Result]) -> str:
    rows = []
    for r in results:
        c = r.config
        base = f"{r.base_us:.1f}" if r.base_us is not None else "-"
        vs_base = f"{r.triton_us / r.base_us:.2f}" if r.base_us else "-"
        rows.append([c.op, c.T, c.n, f"{r.triton_us:.1f}", f"{r.ref_us:.1f}", base, vs_base,
                     f"{r.triton_us / r.ref_us:.2f}", f"{r.triton_eager_us:.1f}", r.figure, r.check])
    return R.table(["op", "T", "n", "triton (us)", "torch ref (us)", "base: torch on n rows (us)", "triton / base",
                    "triton / ref", "triton eager (us)", "triton achieves", "check"], rows)


# --- tuning ------------------------------------------------------------------------------------
def gemm_candidates(bucket: int) -> list[dict]:
    """A sweep around the defaults (about a second each to compile; --max-candidates thins it evenly)."""
    m = min(max(bucket, 16), 128)
    rows = sorted({m, max(16, m // 2)} | ({256} if bucket >= 1024 else set()))  # the cuBLAS-sized tile at T >= 1024
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": w, "num_stages": st}
            for bm, bn, bk, w, st in itertools.product(rows, [64, 128, 256], [32, 64, 128], [4, 8], [3, 4])
            if bm * bn <= 128 * 256]


def sweeps(op: str, bucket: int, best: dict) -> list[list[dict]]:
    """Stages of candidate overrides for op; a later stage builds on the best of the one before."""
    if op == "route_maps":
        return [[{"BLOCK": b, "num_warps": w} for b, w in itertools.product([256, 512, 1024, 2048], [2, 4, 8])]]
    if op == "masked_decode_attention":
        return [[{"BLOCK_N": bn, "num_warps": w, "num_stages": st}
                 for bn, w, st in itertools.product([32, 64, 128], [2, 4, 8], [1, 2, 3])]]
    if op in ("grouped_swiglu_", "routed_swiglu_"):  # gate/up first (down at its default), then down
        return [[{"gate_up": c} for c in gemm_candidates(bucket)],
                [{"down": c} for c in gemm_candidates(bucket)]]
    if op == "cache_decode_attention":
        return sweeps("masked_decode_attention", bucket, best)
    if op == "route":
        return sweeps("route_maps", bucket, best)
    return []


def thin(cands: list[dict], n: int) -> list[dict]:
    """At most n of cands, evenly spaced (0: all), after the defaults (the empty override): a sweep
    cut short to fit a time box still never keeps a config slower than the defaults."""
    if n > 0 and len(cands) > n:
        step = len(cands) / n
        cands = [cands[int(i * step)] for i in range(n)]
    return [{}] + cands


def tune(directory: Path) -> None:
    """Per op and token bucket, time each candidate in a CUDA graph and keep the fastest; write a
    table stamped with this GPU and these versions, after every op and bucket (a sweep stopped by a
    time limit leaves what it found)."""
    gpu = torch.cuda.get_device_name() if CUDA else "CPU (Triton interpreter)"
    found: dict[str, dict[str, dict]] = {}
    real_lookup = kernel_configs.lookup
    for op, T in itertools.product(ARGS.ops, ARGS.tokens):
        b = kernel_configs.bucket(T)
        fn = case(op, T, max(1, round(T * ARGS.run_fraction)))[0]
        best: dict = {}
        for stage in range(len(sweeps(op, b, best))):
            winner = (float("inf"), None)
            for cand in thin(sweeps(op, b, best)[stage], ARGS.max_candidates):
                over = {**best, **cand}
                kernel_configs.lookup = lambda o, t, d, default, tuned=True, _o=over: {
                    **default(kernel_configs.bucket(t)), **_o}
                try:
                    t_us = graph_us(lambda: fn("triton"), budget_us=1000.0)
                except Exception as e:  # a config that does not compile or fit (shared memory): skipped
                    print(f"  {op} T={T} {cand}: {type(e).__name__}", file=sys.stderr)
                    continue
                finally:
                    kernel_configs.lookup = real_lookup
                winner = min(winner, (t_us, over), key=lambda w: w[0])
            if winner[1] is not None:
                best = winner[1]
                print(f"{op} T={T} stage {stage}: {best or 'defaults'} {winner[0]:.1f} us", file=sys.stderr, flush=True)
        if best:
            found.setdefault(op, {})[str(b)] = best
        path = kernel_configs.save(found, gpu, directory)
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    if ARGS.tune:
        if not CUDA and not ARGS.smoke:
            raise SystemExit("--tune needs a CUDA device (or --smoke: the sweep under the Triton interpreter)")
        tune(ARGS.tune)
        return
    results = []
    for T, op in itertools.product(ARGS.tokens, ARGS.ops):
        n = max(1, round(T * ARGS.run_fraction))
        results.append(measure(Config(op, T, n)))
        print(f"  {op} T={T}: {results[-1].triton_us:.1f} us ({results[-1].check})", file=sys.stderr, flush=True)
    name = torch.cuda.get_device_name() if CUDA else "CPU (Triton interpreter; timings meaningless)"
    text = (f"Kernels on {name}, {ARGS.dtype}, H={ARGS.hidden}, I={ARGS.inter}, heads {ARGS.heads}, context "
            f"{ARGS.context}, n = {ARGS.run_fraction:.0%} of T; torch {torch.__version__}, configs: "
            f"{'tuned table if present' if TUNED else 'defaults (--untuned)'}\n\n"
            + table(results) + "\n")
    print(text)
    name = "gpu-kernels" if TUNED else "gpu-kernels-untuned"
    R.write_results(name, {"args": vars(ARGS), "results": results}, text, ARGS.out or Path("out") / name,
                    R.docs_dir(ARGS))


if __name__ == "__main__":
    main()
