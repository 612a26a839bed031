"""`vskipper calibrate`: measure the bodies of one routed layer (dense-masked, routed, routed-mlp) on
this device, over a grid of batch sizes and RUN fractions, and cache the table (see cost.py).

The layer is a transformers Llama decoder layer of the given shape with a FlexiDepth adapter,
timed, the bodies side by side (see side_by_side), in each phase: a decode step (one new token per
sequence, each attending a KV cache of c resident tokens, over the context axis cost.GRID_C) and a
prefill (an extend of one prompt of T tokens). The break-even resident K/V V* (cost.Calibration.
break_even) is read off the decode table and printed for the batch sizes timed.
With --sublayers it times a sublayer skipper's bodies instead (no adapter; attention and MLP decided
apart, each with the cell's RUN fraction), cached beside the whole-layer tables: only a server of a
sublayer skipper (SkipGPT) needs them, so a whole-layer calibration does not time them."""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from vskipper import cost, ops


class PoolCache:
    """A preallocated KV cache, like a serving engine's pool: a decode step writes its token's K/V in
    place at the last position (no allocation per step; transformers' DynamicCache concatenates,
    and on CPU those large fresh allocations page-fault, which would time glibc, not the layer)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v  # [T, kv_heads, context, d]: the new token's K/V go to the last position

    def update(self, k, v, layer_idx, *args, **kwargs):
        self.k[:, :, -1:].copy_(k)
        self.v[:, :, -1:].copy_(v)
        return self.k, self.v


class LayerBench:
    """One routed decoder layer of a given shape, ready to time either body at (T, f): a whole-layer
    skipper's bodies, or (sublayers) a sublayer skipper's, whose attention and MLP RUN fractions are
    both the cell's f (independent rows)."""

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, device, dtype=torch.float32,
                 context: int = 128, seed: int = 0, sublayers: bool = False) -> None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        from vskipper.config import Config
        from vskipper.engines.hf import HFMLP, HFAttention
        from vskipper.routed_layer import (
            DenseBody,
            RoutedLayer,
            SublayerDenseBody,
            resolve_plan,
            routed_body,
            sublayer_routed_body,
        )
        from vskipper.skippers.flexidepth import FlexiDepthAdapter

        torch.manual_seed(seed)
        self.cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=8)
        self.cfg._attn_implementation = "sdpa"
        self.layer = LlamaDecoderLayer(self.cfg, 0).to(device, dtype).eval()
        adapter = FlexiDepthAdapter(hidden, max(1, intermediate // 16)).to(device, dtype)
        # the bodies as transform makes them on this device: where shapes are fixed (CUDA) and an attention
        # part had no fixed-shape masked form, "routed" would run attention for every row, as "routed-mlp"
        plan = resolve_plan(Config(execution="routed"), torch.device(device), hidden, intermediate, dtype)
        routed = "routed-mlp" if plan.fixed_shapes and not HFAttention.masks_rows else "routed"
        if sublayers:  # a sublayer skipper's layer: hard-gated, no adapter
            adapter = None
            self.bodies = {"dense": SublayerDenseBody(), "routed": sublayer_routed_body(plan, routed),
                           "routed-mlp": sublayer_routed_body(plan, "routed-mlp")}
        else:
            self.bodies = {"dense": DenseBody(), "routed": routed_body(plan, routed),
                           "routed-mlp": routed_body(plan, "routed-mlp")}
        self.body = RoutedLayer(0, HFAttention(self.layer.self_attn), self.layer.post_attention_layernorm,
                                HFMLP(self.layer.mlp), adapter, "hard" if sublayers else "soft", self.bodies["routed"])
        self.sublayers = sublayers
        self.rope = LlamaRotaryEmbedding(self.cfg).to(device)
        self.device, self.dtype, self.context = torch.device(device), dtype, context
        self.gen = torch.Generator().manual_seed(seed)
        self._graphs: dict[str, tuple] = {}  # body name -> (body, graph, output), captured on _graph_args
        self._graph_args = None

    def inputs(self, T: int, f: float, phase: str = "decode", context: int | None = None):
        """A cell's inputs: a decode step of T rows, each attending `context` resident K/V tokens (its own
        new one included; default the bench's), or (prefill) an extend of one prompt of T tokens."""
        if phase == "prefill":
            return self.prefill_inputs(T, f)
        c = self.context if context is None else context
        if c < 1:
            raise ValueError(f"LayerBench.inputs: context={c!r}: expected an integer >= 1 (resident K/V tokens)")
        H, d = self.cfg.hidden_size, self.cfg.hidden_size // self.cfg.num_attention_heads
        kv = torch.randn(T, self.cfg.num_key_value_heads, c, d, device=self.device, dtype=self.dtype)
        cache = PoolCache(kv, kv.clone())
        h = torch.randn(T, 1, H, device=self.device, dtype=self.dtype)
        run = self._run(T, f, (T, 1))
        pos = torch.full((T, 1), c - 1, device=self.device)
        ctx = dict(attention_mask=None, position_embeddings=self.rope(h, pos), position_ids=pos,
                   past_key_values=cache, use_cache=True)
        return self._args(h, run, ctx)

    def _run(self, T: int, f: float, shape: tuple) -> torch.Tensor:
        """Decisions [*shape] (a sublayer layer's: [*shape, 2], attention and MLP apart), run_rows(T, f)
        rows RUN at random positions (per sublayer, independently)."""
        cols = []
        for _ in range(2 if self.sublayers else 1):
            run = torch.zeros(T, dtype=torch.bool)
            run[torch.randperm(T, generator=self.gen)[:cost.run_rows(T, f)]] = True
            cols.append(run.view(shape))
        return (torch.stack(cols, -1) if self.sublayers else cols[0]).to(self.device)

    def _args(self, h, run, ctx):
        """The routed layer's arguments: h, x, g, run, valid, route maps (a sublayer layer's: the MLP's), ctx."""
        valid = torch.ones(h.shape[:-1], dtype=torch.bool, device=self.device)
        g = torch.where(run, 0.75, 0.25).to(self.dtype)
        mask = run[..., 1] if self.sublayers else run
        x = self.layer.input_layernorm(h)
        return h, x, g, run, valid, ops.route_maps(mask, valid, impl=self.bodies["routed"].maps_impl), ctx

    def prefill_inputs(self, T: int, f: float):
        """An extend of one prompt of T tokens (no prefix, no cache to write: the K/V of every row are
        computed either way), run_rows(T, f) of them RUN at random positions."""
        h = torch.randn(1, T, self.cfg.hidden_size, device=self.device, dtype=self.dtype)
        run = self._run(T, f, (1, T))
        pos = torch.arange(T, device=self.device)[None]
        ctx = dict(attention_mask=None, position_embeddings=self.rope(h, pos), position_ids=pos,
                   past_key_values=None, use_cache=False)
        return self._args(h, run, ctx)

    def add_auto(self, calibration: cost.Calibration):
        """Add (or replace) body "auto": a fresh chooser over this bench's bodies that `calibration` times."""
        from vskipper.routed_layer import AutoBody

        self.bodies["auto"] = AutoBody({b: self.bodies[b] for b in calibration.bodies()}, cost.Chooser(calibration))
        return self.bodies["auto"]

    @torch.no_grad()
    def time(self, body: str, args, sync, inner: int = 3) -> float:
        """Mean ms of `inner` back-to-back decode steps of `body` (each rewrites the same cache slot),
        after one untimed step: timing bodies side by side, the first step after another body pays
        for the caches that body left, and which body follows which would bias the comparison
        (measured: +10-30 us on a 0.3 ms step).

        On CUDA a decode step is timed as SGLang runs it: captured into a CUDA graph (`captured`)
        and replayed, each replay between CUDA events (`sync` is not used). Called eagerly, a step
        would price Python and kernel launches, not the layer. A prefill is timed eagerly, as SGLang
        runs it (it captures decode steps only, by default), and so is every step on CPU (no graphs):
        each call between `sync`s on the wall clock."""
        h, x, g, run, valid, maps, ctx = args
        if self.device.type == "cuda" and isinstance(ctx["past_key_values"], PoolCache):  # a decode step's inputs
            graph, _ = self.captured(body, args)
            graph.replay()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(inner)]
            for start, end in events:
                start.record()
                graph.replay()
                end.record()
            events[-1][1].synchronize()
            return sum(start.elapsed_time(end) for start, end in events) / inner
        self.body.body = self.bodies[body]
        self.body(h, x, g, run, valid, maps, **ctx)
        total = 0.0
        for _ in range(inner):
            sync()
            t0 = time.perf_counter()
            self.body(h, x, g, run, valid, maps, **ctx)
            sync()
            total += time.perf_counter() - t0
        return total / inner * 1e3

    @torch.no_grad()
    def captured(self, body: str, args) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """`body`'s step on `args` (a CUDA device's) captured into a CUDA graph, and the tensor its
        replays write the layer's output to. A graph is kept per body until other args come: the
        grid times each body once per round on the same args, and a capture costs warm-up steps and
        a flush of the allocator's cache; so at most one cell's graphs hold memory. A body that
        cannot be captured (a host sync) raises here. "auto" is captured as a server captures it: its
        chooser reads no counts inside a graph and plans the body for T (cost.Chooser.planned), so
        it is timed as that body."""
        if args is not self._graph_args:
            self._graphs.clear()
            self._graph_args = args  # held, so that no later args can reuse its id
        fn = self.bodies[body]
        kept = self._graphs.get(body)
        if kept is None or kept[0] is not fn:  # add_auto replaces "auto"
            h, x, g, run, valid, maps, ctx = args
            self.body.body = fn
            # warm up on a side stream, as torch.cuda.graphs prescribes (kernels compiled, lazy state made)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.body(h, x, g, run, valid, maps, **ctx)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.body(h, x, g, run, valid, maps, **ctx)
            kept = self._graphs[body] = (fn, graph, out)
        return kept[1], kept[2]


def repeats_at(T: int, repeats: int, short: int = 16) -> int:
    """Rounds for batch size T: `repeats`, times short / T below T = short, where a step is short
    (the noise is relative and the time cheap)."""
    return max(repeats, -(-repeats * short // T))


def lower_quartile(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 4]


def side_by_side(bench: LayerBench, bodies, args, sync, repeats: int, rng: random.Random) -> dict[str, list[float]]:
    """Each body's times (ms) at the same inputs over `repeats` rounds; every round runs each body
    once, in a random order (measured on this shared machine: with a fixed order, whichever body
    follows the slowest one more often or more closely is up to 5% slower at small T, whatever it is).
    Compare bodies by paired_ratio: the machine's slow spells last longer than a round and cancel."""
    samples = {b: [] for b in bodies}
    order = list(bodies)
    for _ in range(repeats):
        rng.shuffle(order)
        for b in order:
            samples[b].append(bench.time(b, args, sync))
    return samples


def paired_ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of a's time over b's in the same round."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))


BODIES = ("dense", "routed", "routed-mlp")  # what a calibration times, side by side


def context_grid(ts, contexts, device, max_resident: int | None = None, context_ts=cost.CONTEXT_T,
                 context_fs=cost.CONTEXT_F, fs=cost.GRID_F) -> list[tuple[int, tuple, tuple]]:
    """The decode grid per context: [(context, ts, fs)]. The first context over the whole (ts, fs);
    each further one over the batch sizes of `context_ts` within ts's range whose T x context is at
    most `max_resident` (default cost.MAX_RESIDENT for the device type), at `context_fs`; a context
    with fewer than two such batch sizes is left out (the table reads it linearly past the last)."""
    contexts = sorted(set(int(c) for c in contexts))
    if not contexts or contexts[0] < 1:
        raise ValueError(f"contexts {contexts}: expected resident K/V tokens per row, integers >= 1")
    cap = max_resident if max_resident is not None else cost.MAX_RESIDENT.get(torch.device(device).type,
                                                                               cost.MAX_RESIDENT["cuda"])
    grid = [(contexts[0], tuple(ts), tuple(fs))]
    for c in contexts[1:]:
        ts_c = tuple(T for T in context_ts if min(ts) <= T <= max(ts) and T * c <= cap)
        if len(ts_c) >= 2:
            grid.append((c, ts_c, tuple(context_fs)))
    return grid


def measure(hidden: int, intermediate: int, heads: int, kv_heads: int, device="cpu", dtype=torch.float32, ts=None,
            fs=cost.GRID_F, repeats: int = 6, passes: int = 3, contexts=None, max_resident: int | None = None,
            progress=True, phase: str = "decode", sublayers: bool = False) -> tuple[cost.Calibration, LayerBench]:
    """The calibration table: per cell, dense's lower quartile, and each routed body as that times
    its paired body/dense ratio (the ratio is what the choice needs; see side_by_side). The grid is
    swept `passes` times, each with its share of the rounds, and a cell's ratio is the median of
    its passes' ratios: measured here, a slow spell of the machine can move a cell's ratio by 30%
    (the bodies do not slow down alike), and a spell shorter than a sweep hits one pass only.
    phase: "decode" (ts default cost.GRID_T; over the context axis `contexts`, default cost.GRID_C,
    gridded by context_grid with `max_resident`) or "prefill" (cost.PREFILL_T; no context axis: one
    prompt). sublayers: time a sublayer skipper's bodies, a cell's attention and MLP both at its f
    (LayerBench). A step is timed as the server runs it (LayerBench.time): on CUDA a decode step as a
    CUDA-graph replay, otherwise eagerly."""
    if phase not in cost.PHASES:
        raise ValueError(f"phase={phase!r} is not one of {list(cost.PHASES)}")
    ts = ts if ts is not None else cost.GRID_T if phase == "decode" else cost.PREFILL_T
    device = torch.device(device)
    if phase == "decode":
        grid = context_grid(ts, cost.GRID_C if contexts is None else contexts, device, max_resident, fs=fs)
    else:
        grid = [(0, tuple(ts), tuple(fs))]  # (an extend attends its own prompt: no context of its own)
    bench = LayerBench(hidden, intermediate, heads, kv_heads, device, dtype=dtype, context=max(1, grid[0][0]),
                       sublayers=sublayers)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng = random.Random(0)
    # rounds per pass: more where a step is short (repeats_at), a step of T rows at context c as long as
    # one of T c / c0 rows at the first context c0 (at long contexts the K/V reads are the step)
    c0 = max(1, grid[0][0])
    rounds = {(c, T): -(-repeats_at(max(1, T * max(c, c0) // c0), repeats, short=32) // passes)
              for c, ts_c, _ in grid for T in ts_c}
    cells = [(c, T, f) for c, ts_c, fs_c in grid for T in ts_c for f in fs_c]
    dense = {cell: [] for cell in cells}
    ratios = {(b, *cell): [] for b in BODIES[1:] for cell in cells}
    work = {(c, T): rounds[c, T] * (T * (1 + c / 1024) + 8) * len(fs_c)  # a rough cost per row, for the ETA
            for c, ts_c, fs_c in grid for T in ts_c}
    t_start, done, total = time.perf_counter(), 0, passes * sum(work.values())
    for p in range(passes):
        for c, ts_c, fs_c in grid:
            for T in ts_c:
                for f in fs_c:
                    s = side_by_side(bench, BODIES, bench.inputs(T, f, phase, context=c or None), sync,
                                     rounds[c, T], rng)
                    dense[c, T, f] += s["dense"]
                    for b in BODIES[1:]:
                        ratios[b, c, T, f].append(paired_ratio(s, b, "dense"))
                done += work[c, T]
                if progress:
                    frac, el = done / total, time.perf_counter() - t_start
                    cols = "  ".join(f"{b}/dense {min(rs):.2f}-{max(rs):.2f}" for b in BODIES[1:]
                                     for rs in [[ratios[b, c, T, f][-1] for f in fs_c]])
                    where = f" C={c:<5}" if phase == "decode" else ""
                    print(f"calibrate: {'sublayer ' if sublayers else ''}{phase} pass {p + 1}/{passes}{where} "
                          f"T={T:<4} {cols}  [{frac:.0%}, ETA {el / frac - el:.0f} s]", file=sys.stderr, flush=True)

    def tables(c, ts_c, fs_c):
        d = tuple(tuple(lower_quartile(dense[c, T, f]) for f in fs_c) for T in ts_c)  # a neighbour only adds time
        r = {b: tuple(tuple(d[i][j] * statistics.median(ratios[b, c, T, f]) for j, f in enumerate(fs_c))
                      for i, T in enumerate(ts_c)) for b in BODIES[1:]}
        return d, r["routed"], r["routed-mlp"]

    d, r, rm = tables(*grid[0])
    more = tuple(cost.ContextTable(c, ts_c, fs_c, *tables(c, ts_c, fs_c)) for c, ts_c, fs_c in grid[1:])
    cal = cost.Calibration(cost.device_name(device), cost.versions(), hidden, intermediate, tuple(ts), tuple(fs), d,
                           r, cost.dtype_name(dtype), rm, phase, sublayers, grid[0][0], more)
    return cal, bench


def break_even_line(cal: cost.Calibration, f: float, sizes=None) -> str:
    """V*, the break-even resident K/V (tokens), per batch size: where the routed body starts to cost no
    more than the dense one at RUN fraction f, read off the decode table's context axis."""
    if cal.phase != "decode":
        raise ValueError(f"break_even_line: a {cal.phase!r} table has no context axis")
    if len(cal.contexts) < 2:
        return (f"V*: not measured (the decode table has one context, {cal.context} tokens per row: run "
                f"`vskipper calibrate` for its context axis)")
    routed = "routed" if "routed" in cal.bodies() else "routed-mlp"
    parts = [f"{T}:{format_tokens(cal.break_even(T, f, routed), T * cal.contexts[0], T * 64 * cal.contexts[-1])}"
             for T in (sizes if sizes is not None else cal.ts)]
    return (f"V* (resident K/V tokens from which routed costs no more than dense, at RUN fraction {f:g}; "
            f"batch size:tokens) {' '.join(parts)}")


def format_tokens(v: float | None, lo: int, hi: int) -> str:
    """A break-even K/V volume in words: '<=2k' (pays at every context timed), '>1M' (not within the
    search), '37k'."""
    def k(n: float) -> str:
        return f"{n / 2 ** 20:.1f}M" if n >= 2 ** 20 else f"{n / 1024:.0f}k" if n >= 1024 else f"{n:.0f}"

    if v is None:
        return "?"
    return f"<={k(lo)}" if v == 0 else f">{k(hi)}" if v == float("inf") else k(v)


def shape_of(model_path: str) -> tuple[int, int, int, int]:
    from vskipper.models.checkpoint import read_config

    c = read_config(model_path)
    heads = c["num_attention_heads"]
    return c["hidden_size"], c["intermediate_size"], heads, c.get("num_key_value_heads", heads)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="vskipper calibrate", description=__doc__)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--model", help="a model directory: its hidden/intermediate/heads")
    g.add_argument("--shape", help="hidden,intermediate[,heads,kv_heads]")
    ap.add_argument("--repeats", type=int, default=6, help="rounds per cell at T >= 32 (more below), over all passes")
    ap.add_argument("--passes", type=int, default=3, help="sweeps of the grid; a cell's ratio is their median")
    ap.add_argument("--threads", type=int, help="torch threads to measure with (a calibration is kept per thread "
                                                "count; default: this process's, %d)" % torch.get_num_threads())
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="dtype to time the layer in, as the model runs (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--phase", choices=["both", *cost.PHASES], default="both",
                    help="what to time: decode steps, prefill (an extend of one prompt), or both (default)")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="decode: time batch sizes of the grid up to this only (default: all, up to %d; beyond the "
                         "table the cost model scales its last row linearly)" % cost.GRID_T[-1])
    ap.add_argument("--contexts", type=int, nargs="+", default=list(cost.GRID_C),
                    help=f"decode: the context axis, resident K/V tokens per row (default: {list(cost.GRID_C)}); the "
                         f"first is timed over the whole grid, the others over batch sizes {list(cost.CONTEXT_T)} "
                         f"and RUN fractions {list(cost.CONTEXT_F)}")
    ap.add_argument("--max-resident", type=int, default=None,
                    help="decode: time only cells of at most this many resident K/V tokens, batch x context "
                         "(default: %d on cuda, %d on cpu)" % (cost.MAX_RESIDENT["cuda"], cost.MAX_RESIDENT["cpu"]))
    ap.add_argument("--run-fraction", type=float, default=0.5,
                    help="the RUN fraction V* (the break-even resident K/V) is reported at (default: %(default)s)")
    ap.add_argument("--sublayers", action="store_true",
                    help="time a sublayer skipper's bodies (attention and MLP decided apart: SkipGPT) instead of "
                         "whole layers; cached beside the whole-layer tables")
    ap.add_argument("--export", help="also write the calibration to this directory (to ship it)")
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads {args.threads}: expected an integer >= 1")
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        ap.error(f"--device {device!r}: expected cpu or cuda")
    if args.shape:
        try:
            dims = [int(v) for v in args.shape.split(",")]
        except ValueError:
            ap.error(f"--shape {args.shape!r}: expected integers hidden,intermediate[,heads,kv_heads]")
        if len(dims) == 2:
            dims += [max(1, dims[0] // 64)] * 2
        if len(dims) != 4 or min(dims) <= 0 or dims[0] % dims[2] or dims[2] % dims[3]:
            ap.error(f"--shape {args.shape!r}: expected positive hidden,intermediate[,heads,kv_heads] with heads "
                     f"dividing hidden and kv_heads dividing heads")
    elif args.model:
        dims = list(shape_of(args.model))
    else:
        from vskipper.models.smollm2 import smollm2_dir

        dims = list(shape_of(str(smollm2_dir())))
    print(f"calibrate: {cost.device_name(device)}, hidden={dims[0]} intermediate={dims[1]} heads={dims[2]}/{dims[3]}",
          file=sys.stderr)
    if args.repeats < 1 or args.passes < 1:
        ap.error(f"--repeats and --passes must be >= 1 (got {args.repeats} and {args.passes})")
    ts = None
    if args.max_batch is not None:
        ts = tuple(t for t in cost.GRID_T if t <= args.max_batch)
        if len(ts) < 2:
            ap.error(f"--max-batch {args.max_batch}: expected an integer >= {cost.GRID_T[1]} (two batch sizes of the "
                     f"grid {list(cost.GRID_T)} at least)")
    if min(args.contexts) < 1:
        ap.error(f"--contexts {args.contexts}: expected resident K/V tokens per row, integers >= 1")
    if args.max_resident is not None and args.max_resident < 1:
        ap.error(f"--max-resident {args.max_resident}: expected an integer >= 1")
    if not 0.0 <= args.run_fraction <= 1.0:
        ap.error(f"--run-fraction {args.run_fraction}: expected a number in [0, 1]")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    for phase in cost.PHASES if args.phase == "both" else (args.phase,):
        cal, _ = measure(*dims, device=device, dtype=dtype, repeats=args.repeats, passes=args.passes, phase=phase,
                         ts=ts if phase == "decode" else None, sublayers=args.sublayers,
                         contexts=args.contexts if phase == "decode" else None, max_resident=args.max_resident)
        print(f"{'sublayer ' if args.sublayers else ''}{phase} calibration cached in {cost.save(cal)}")
        if cal.phase == "decode":
            print(f"{cost.device_name(device)}: {break_even_line(cal, args.run_fraction)}")
        if args.export:
            print(f"exported to {cost.save(cal, __import__('pathlib').Path(args.export))}")


if __name__ == "__main__":
    main()
