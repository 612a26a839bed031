"""The real decode path under CUDA graphs: a transformed Llama decoding with one step captured per
batch size and replayed with changing route decisions.

    python -m benchmarks.gpu.model_check             # Llama-3-8B shape, random bf16 weights, on CUDA
    python -m benchmarks.gpu.model_check --smoke     # tiny shapes on CPU (eager stand-in for graphs)

A. The 8B shape (hidden 4096, intermediate 14336, 32/8 heads, 32 layers, vocab 128256, routed
   layers 16-31), transformed with RandomSkip(0.5) and with a FlexiDepth of random router/adapter
   weights (hard and soft gate), Config(execution="routed", static_shapes=True, check_sync=True):
   per batch size a prompt is prefilled eagerly, one decode step is captured (the host-sync guard on
   during capture) and replayed `--steps` times, each on the previous replay's greedy tokens; each
   replay's logits are checked against the eager step on the same inputs (the tests' bf16
   tolerance, `TOL`), and the route decisions must change between replays.
B. A small model in fp32, each skipper: the greedy tokens of the captured decode against
   `vskipper.reference.reference_generate` (full recompute, no cache), sequence by sequence.
Prints one markdown table per part (and writes them to --out, results.json); exits 1 if any check failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from benchmarks import results as R

SKIPPERS = ("random", "flexidepth-hard", "flexidepth-soft")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.model_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", help="8b, tiny, or hidden,intermediate,heads,kv_heads,layers,vocab")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens prefilled before the captured decode")
    p.add_argument("--steps", type=int, default=6, help="replays per captured graph")
    p.add_argument("--skippers", nargs="+", default=list(SKIPPERS), choices=SKIPPERS)
    p.add_argument("--small-shape", default="256,512,8,4,6,512", help="the fp32 model of part B")
    p.add_argument("--small-batch", type=int, default=4)
    p.add_argument("--impl", default="auto", choices=["auto", "torch", "triton"], help="Config.impl")
    R.add_arguments(p, "gpu-model")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks that the script runs")
    a = p.parse_args(argv)
    if a.smoke:
        a.shape, a.small_shape, a.batches, a.prompt, a.steps, a.small_batch = "tiny", "tiny", [1, 3], 5, 3, 2
    return a


ARGS = parse() if __name__ == "__main__" else None

import torch  # noqa: E402

import vskipper  # noqa: E402
from benchmarks.gpu import harness as G  # noqa: E402
from vskipper.reference import reference_generate  # noqa: E402

# A replay against the eager step, per dtype (atol, rtol): the tolerances the tests hold the same
# comparisons to (bf16 on a GPU, fp32 in the --smoke run).
TOL = {torch.float32: (2e-5, 2e-4), torch.bfloat16: (2e-2, 2e-2)}


def close(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    atol, rtol = TOL[b.dtype]
    return bool(torch.isclose(a, b, atol=atol, rtol=rtol).all()), float((a.float() - b.float()).abs().max())


def run_counts(model) -> list[int]:
    return [s["run"] for _, s in sorted(vskipper.stats(model).items())]


def prefill(model, kv, ids: torch.Tensor, C: int) -> torch.Tensor:
    """ids [B, P] through `model` eagerly into the cache; the greedy next tokens [B, 1]."""
    B, P = ids.shape
    pre = G.Step(model, kv, B, C, S=P)
    pre.ids.copy_(ids)
    pre.positions.copy_(torch.arange(P, device=ids.device).expand(B, P))
    return pre()[:, -1].argmax(-1, keepdim=True)


def start_decode(model, kv, ids: torch.Tensor, steps: int):
    """Prefill ids [B, P] into a cache for `steps` more tokens; the first decode step's buffers
    filled, captured. -> (first greedy token [B], step, captured step)."""
    B, P = ids.shape
    C = P + steps + 1
    nxt = prefill(model, kv, ids, C)
    step = G.Step(model, kv, B, C)
    step.ids.copy_(nxt)
    step.positions.fill_(P)
    return nxt, step, G.Captured(step)


def check_replays(model, kv, ids: torch.Tensor, steps: int, impl_dtype) -> dict:
    """Prefill ids [B, P], capture one decode step, replay it `steps` times on its own greedy tokens;
    each replay against the eager step on the same inputs."""
    P = ids.shape[1]
    nxt, step, cap = start_decode(model, kv, ids, steps)
    worst, ok, agree, per_step = 0.0, True, 0, []
    for t in range(steps):
        step.ids.copy_(nxt)
        step.positions.fill_(P + t)
        before = run_counts(model)
        got = cap.replay().clone()
        per_step.append(tuple(a - b for a, b in zip(run_counts(model), before)))
        want = step()  # eager, same inputs (rewrites the same K/V slot)
        good, err = close(got, want)
        ok, worst = ok and good, max(worst, err)
        agree += int(torch.equal(got.argmax(-1), want.argmax(-1)))
        nxt = got[:, -1].argmax(-1, keepdim=True)
    cap.close()
    changed = len(set(per_step)) > 1 or len({c for s in per_step for c in s}) > 1
    return {"ok": ok and changed, "close": ok, "worst": worst, "changed": changed, "agree": agree,
            "runs": per_step}


def part_a(args, device, dtype) -> tuple[str, bool]:
    shape = G.parse_shape(args.shape)
    base = G.build_llama(shape, device, dtype)
    P, S = args.prompt, args.steps
    kv = G.PoolKV(shape, max(args.batches) * (P + S + 1), device, dtype)
    atol, rtol = TOL[dtype]
    head = (f"A. {shape} in {dtype}, routed layers {shape.routed[0]}-{shape.routed[-1]}, prompt {P}, {S} replays "
            f"per graph, Config(execution='routed', static_shapes=True, check_sync=True, impl={args.impl!r}); "
            f"logits vs the eager step within atol={atol}, rtol={rtol}")
    rows = []
    all_ok = True
    gen = torch.Generator().manual_seed(0)
    for name in args.skippers:
        skipper = G.skipper_for(name, shape, device, dtype)
        model = G.transformed(base, skipper, "routed", check_sync=True, impl=args.impl)
        body = model.vskipper.bodies[shape.routed[0]].describe()
        for B in args.batches:
            ids = torch.randint(0, shape.vocab, (B, P), generator=gen).to(device)
            try:
                r = check_replays(model, kv, ids, S, dtype)
            except Exception as e:  # a failure is a row of the table, and the exit status
                traceback.print_exc()
                all_ok = False
                rows.append([name, B, body, "-", "-", "-", "-", "-", failure(e)])
                continue
            all_ok &= r["ok"]
            runs = "; ".join(",".join(map(str, s[:4])) for s in r["runs"][:3])
            rows.append([name, B, body, "yes" if r["close"] else "NO", f"{r['worst']:.3g}",
                         "yes" if r["changed"] else "NO", f"{r['agree']}/{S}", runs, "ok" if r["ok"] else "FAILED"])
            print(*rows[-1], sep=" | ", file=sys.stderr, flush=True)
        del model
    del base, kv
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return head + "\n\n" + R.table(["skipper", "B", "body", "replays close to eager", "max abs diff", "routes changed",
                                     "greedy equal", "RUN rows per replay (first layers)", "check"], rows), all_ok


def failure(e: Exception) -> str:
    """A failed check's cell: the exception's type and first line."""
    return f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def widen(model, std: float = 0.15):
    """Wider random weights (as the tests' tiny models): every layer then moves the logits visibly."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return model


def part_b(args, device) -> tuple[str, bool]:
    shape = G.parse_shape(args.small_shape)
    base = widen(G.build_llama(shape, device, torch.float32, seed=1))
    P, S, B = args.prompt, args.steps + 2, args.small_batch
    kv = G.PoolKV(shape, B * (P + S + 1), device, torch.float32)
    rows = []
    all_ok = True
    gen = torch.Generator().manual_seed(1)
    for name in args.skippers:
        skipper = G.skipper_for(name, shape, device, torch.float32)
        model = G.transformed(base, skipper, "routed", check_sync=True, impl=args.impl)
        ids = torch.randint(0, shape.vocab, (B, P), generator=gen).to(device)
        try:
            nxt, step, cap = start_decode(model, kv, ids, S)
            tokens = [nxt]
            for t in range(S - 1):
                step.ids.copy_(tokens[-1])
                step.positions.fill_(P + t)
                tokens.append(cap.replay()[:, -1].argmax(-1, keepdim=True))
            cap.close()
            got = torch.cat([ids] + tokens, dim=1).cpu()
            equal = sum(int(torch.equal(got[b], reference_generate(base, skipper, ids[b], S)[0].cpu()))
                        for b in range(B))
            ok = equal == B
            rows.append([name, B, S, f"{equal}/{B}", "ok" if ok else "FAILED"])
        except Exception as e:
            traceback.print_exc()
            ok = False
            rows.append([name, B, S, "-", failure(e)])
        all_ok &= ok
        print(*rows[-1], sep=" | ", file=sys.stderr, flush=True)
    return (f"B. {shape} in fp32: greedy tokens of the captured decode vs reference_generate (full recompute)\n\n"
            + R.table(["skipper", "B", "new tokens", "sequences equal", "check"], rows)), all_ok


def main() -> int:
    args = ARGS
    if not G.cuda() and not args.smoke:
        print("gpu_model_check: no CUDA device; this check needs a GPU (or --smoke: tiny shapes on CPU)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda" if G.cuda() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # bf16 matmul is slow on CPU
    text_a, ok_a = part_a(args, device, dtype)
    text_b, ok_b = part_b(args, device)
    text = f"{G.device_line()}\n\n{text_a}\n\n{text_b}\n"
    print(text)
    R.write_results("gpu-model", {"passed": ok_a and ok_b, "args": vars(args)}, text, args.out, R.docs_dir(args))
    return 0 if ok_a and ok_b else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
