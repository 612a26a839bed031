"""The quality bound: how much of the base model's answers a per-token router could keep on this model at
a given routed-layer skip on generated tokens, estimated by an oracle that sees the base model's output.

    python -m benchmarks.quality_oracle --limit 24 --threads 1
    python -m benchmarks.quality_oracle --adapters flexidepth:name=smollm2-135m-flexidepth --skipper ... --quick

Held-out teacher-forced sequences (a chat prompt, then the base model's greedy answer), one at a time,
fp32. Every system here is a set of route decisions per (routed layer, position), and every figure
comes from one teacher-forced forward over the sequence under them:
    top-1     share of scored positions (those predicting the answer's tokens) whose most likely next
              token is the base's, mean over sequences +- stderr
    KL        KL(base || system) per scored position, full vocabulary, nats, mean +- stderr
    prefix    the agreeing prefix: answer positions before the first whose most likely next token is
              not the base's. For a router (its decisions a causal function of the text: trained, random,
              static) it is the greedy agreeing prefix a free-running generation would give (both decode
              the base's answer token by token until they part), up to floating-point ties
    skip      PROJECT share of routed-layer work at the generated positions (those a generation feeds
              back: training.data.generated) and, apart, at the prompt's positions

The oracle (benchmarks/oracle.py `Oracle`): every prompt token runs every layer (prefill untouched);
the answer is walked left to right and each generated token, in the context the earlier tokens' choices
made, starts with every layer run and, from the deepest routed layer up, skips each layer whose skipping
keeps its own next-token distribution within a KL budget tau of the base's, KL(base || q) <= tau, and
keeps the base's most likely next token. A skipped layer is the identity, or the skipper's own adapter
(--adapters): a FlexiDepth PROJECT row. The budgets --taus map out the curve; the bound's table takes, at
each skip level, the budget whose skip on generated tokens is nearest.

What it sees that no router does: the base model's output at every position (its whole next-token
distribution), and each choice's exact effect on the token's own prediction. What it does not: a choice's
effect on later tokens (they meet it in their context, and then skip less), any adapter but the one given,
and any decision set its greedy walk does not reach (a fixed order, no look-ahead, no going back). So it is
not an upper bound on what a router could keep: it is a decision set that exists, a lower bound on the best
one, and a ceiling only for routers that decide as it does. Writes results.json and
docs/results/quality-curve-bound.md (the quality curve's page includes its tables).
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks import results as res
from benchmarks.oracle import Oracle, Seq, Stack, evaluate

BOUND_LEVELS = (0.10, 0.15, 0.20, 0.30)  # the bound's table
TAUS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)  # the oracle's KL budgets (nats per token)


# --- the systems beside the oracle, as decisions per sequence -----------------------------------------------
def phase_only(run: torch.Tensor, seq: Seq, where: str) -> torch.Tensor:
    """A router's decisions kept only at the `where` positions ("generated", "prompt"; "both": as they
    are): every other position RUNs."""
    if where == "both":
        return run
    keep = seq.gen if where == "generated" else torch.arange(len(seq.ids)) < seq.n
    return run | ~keep


def router_decide(skipper, where: str = "both"):
    """decide_for(seq) of a skipper's own routers (RandomSkip, a trained FlexiDepth at its threshold)."""
    from vskipper.skippers.base import sanitize_gate

    def decide_for(seq: Seq):
        pos = torch.arange(len(seq.ids))

        def decide(i, x):
            _, run, _ = sanitize_gate(skipper.router(i)(x, pos, seq.ids), skipper.threshold)
            return phase_only(run, seq, where)
        return decide
    return decide_for


def static_decide(dropped: list[int], where: str = "generated"):
    """decide_for(seq) of a static drop of `dropped` at the `where` positions."""
    def decide_for(seq: Seq):
        return lambda i, x: phase_only(torch.full((len(seq.ids),), i not in dropped), seq, where)
    return decide_for


def heldout(base, tok, limit: int | None, max_new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """The held-out sequences: chat prompts (everyday and the chat set's held-out split), each answered by
    the base greedily, one at a time (no padding). -> (prompt + answer ids, prompt lengths)."""
    from vskipper.eval.agreement import heldout_prompts
    from vskipper.training.data import chat_ids, generate_greedy

    prompts = [chat_ids(tok, r["prompt"]) for r in heldout_prompts(["everyday", "chat"], limit)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    answers = generate_greedy(base, prompts, max_new_tokens, tok.eos_token_id, pad, batch_size=1)
    return [p + a for p, a in zip(prompts, answers)], [len(p) for p in prompts]


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _row(name: str, setting: str, s: dict) -> list:
    return [name, setting, _pct(s["skip_generated"]), _pct(s["skip_prompt"]),
            f"{_pct(s['top1'])} +- {100 * s['top1_se']:.1f}", f"{s['kl']:.3f} +- {s['kl_se']:.3f}",
            f"{s['prefix']:.1f} +- {s['prefix_se']:.1f}", f"{s['prefix_median']:.0f}", _pct(s["identical"])]


HEADER = ["system", "setting", "skip, generated", "skip, prompt", "top-1", "KL", "agreeing prefix", "median",
          "identical"]


def nearest(rows: list[dict], kind: str, level: float) -> dict | None:
    pts = [r for r in rows if r["kind"] == kind and r["skip_generated"] is not None]
    return min(pts, key=lambda r: abs(r["skip_generated"] - level)) if pts else None


def tables(rows: list[dict], n_seq: int, n_layers: int) -> str:
    """The page's three tables from `rows` ({kind, name, setting, **score})."""
    bound = []
    for level in BOUND_LEVELS:
        for kind in ("oracle", "oracle-adapters", "random-generated", "static-generated", "trained"):
            r = nearest(rows, kind, level)
            if r is not None and (kind != "trained" or abs(r["skip_generated"] - level) <= 0.05):
                bound.append(_row(f"**{level:.0%}**: {r['name']}", r["setting"], r))
    curve = [_row(r["name"], r["setting"], r) for r in rows if r["kind"].startswith("oracle")]
    prompt = [_row(r["name"], r["setting"], r) for r in rows if r["kind"] in ("trained", "trained-generated",
                                                                             "trained-prompt", "random-prompt")]
    base = next(r for r in rows if r["kind"] == "base")
    lead = (f"Teacher-forced over {n_seq} held-out sequences (a chat prompt, then the base's greedy answer), fp32; "
            f"skip is the PROJECT share of the {n_layers} routed layers' work at the generated positions (the "
            f"answer's tokens a generation feeds back) and, apart, at the prompt's. The base scores top-1 "
            f"{100 * base['top1']:.1f}% and an agreeing prefix of {base['prefix']:.1f} tokens against itself here.")
    return (f"{lead}\n\n### The bound: the oracle beside the routers at the same skip on generated tokens\n\n"
            f"At each level: the oracle (layers skipped as the identity; with adapters: a FlexiDepth skipper's "
            f"PROJECT rows), RandomSkip and the ShortGPT static drop on generated tokens only (the prompt runs, as "
            f"the oracle's does), and the trained skipper's point nearest that level (within 5 points; it skips "
            f"prompt tokens too, as it does in serving).\n\n{res.table(HEADER, bound)}\n\n"
            f"### The oracle at every budget\n\n{res.table(HEADER, curve)}\n\n"
            f"### What skipping prompt tokens costs\n\nEach trained point as it is, with its prompt tokens all "
            f"run (generated only), and with its generated tokens all run (prompt only); RandomSkip on prompt "
            f"tokens only.\n\n{res.table(HEADER, prompt)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="15-29", help="the routed layers (default %(default)s: SmolLM2-135M's second "
                                                     "half, the shipped skipper's)")
    ap.add_argument("--skipper", action="append", default=[], metavar="SPEC",
                    help="a trained FlexiDepth skipper (spec) on those layers, at each --thresholds; repeatable")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.35, 0.4, 0.45, 0.5])
    ap.add_argument("--adapters", metavar="SPEC", help="a hard-gated FlexiDepth skipper: the oracle again, its layers' "
                                                       "PROJECT rows that skipper's adapter")
    ap.add_argument("--limit", type=int, default=24, help="held-out prompts per set (everyday, chat)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="the base's greedy answer length")
    ap.add_argument("--taus", type=float, nargs="+", default=list(TAUS),
                    help="the oracle's KL budgets, nats per generated token (default %(default)s)")
    ap.add_argument("--influence-prompts", type=int, default=64, help="training prompts for ShortGPT's influence")
    ap.add_argument("--reuse-oracle", metavar="DIR", help="an earlier run's --out: its identity oracle's rows are "
                                                          "taken as they are (same --limit, --max-new-tokens and "
                                                          "--taus, or refused), and not computed again")
    ap.add_argument("--quick", action="store_true", help="a look, not a result: 4 prompts a set, budgets 0.01, 0.05")
    ap.add_argument("--threads", type=int)
    res.add_arguments(ap, "quality-curve-bound")
    args = ap.parse_args(argv)
    if args.quick:
        args.limit, args.taus = 4, [0.01, 0.05]
    if not all(t >= 0 for t in args.taus):
        raise SystemExit(f"--taus {args.taus}: expected KL budgets >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import vskipper
    from benchmarks.quality_curve import block_influence, static_drop
    from vskipper.data import load
    from vskipper.models.smollm2 import smollm2_dir
    from vskipper.skippers.spec import parse_layers
    from vskipper.training.data import chat_ids, split_prompts

    layers = parse_layers(args.layers, "--layers")
    trained = [(spec, vskipper.parse_skipper(spec)) for spec in args.skipper]
    adapters = vskipper.parse_skipper(args.adapters) if args.adapters else None
    for spec, sk in trained + ([(args.adapters, adapters)] if adapters else []):
        if not isinstance(sk, vskipper.FlexiDepth) or list(sk.layers) != layers or sk.gate != "hard":
            raise SystemExit(f"{spec}: expected a hard-gated FlexiDepth skipper on layers {args.layers}")
    path = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    t0 = time.perf_counter()
    ids, n_prompt = heldout(base, tok, args.limit, args.max_new_tokens)
    plain = Stack(base, layers)
    seqs = [plain.prepare(s, n) for s, n in zip(ids, n_prompt)]
    res.log(f"{len(seqs)} held-out sequences ({time.perf_counter() - t0:.0f} s)")
    train = split_prompts(load("chat"))[0][: args.influence_prompts]
    influence = block_influence(base, [chat_ids(tok, r["prompt"]) for r in train], layers)
    rows = [{"kind": "base", "name": "base", "setting": "-",
             **evaluate(plain, seqs, lambda s: lambda i, x: torch.ones(len(s.ids), dtype=torch.bool))}]

    def add(kind, name, setting, stack, decide_for):
        t = time.perf_counter()
        rows.append({"kind": kind, "name": name, "setting": setting, **evaluate(stack, seqs, decide_for)})
        r = rows[-1]
        res.log(f"{name} ({setting}): generated {r['skip_generated']:.1%}, prompt {r['skip_prompt']:.1%} skipped; "
                f"top-1 {r['top1']:.1%}, KL {r['kl']:.3f}, prefix {r['prefix']:.1f} ({time.perf_counter() - t:.0f} s)")

    for rate in BOUND_LEVELS:
        add("random-generated", "RandomSkip, generated tokens only", f"rate {rate:g}", plain,
            router_decide(vskipper.RandomSkip(rate, layers, seed=0), "generated"))
    for k in range(1, 6):
        drop = static_drop(influence, k)
        add("static-generated", "static drop, generated tokens only", f"layers {drop}", plain, static_decide(drop))
    for rate in (0.25, 0.5):
        add("random-prompt", "RandomSkip, prompt tokens only", f"rate {rate:g}", plain,
            router_decide(vskipper.RandomSkip(rate, layers, seed=0), "prompt"))
    for spec, sk in trained:
        stack = Stack(base, layers, sk)
        for t in args.thresholds:
            sk.threshold = t
            for kind, where, what in (("trained", "both", "as it is"), ("trained-generated", "generated",
                                                                          "generated only"),
                                      ("trained-prompt", "prompt", "prompt only")):
                add(kind, f"{spec}, {what}", f"threshold {t:g}", stack, router_decide(sk, where))
    reused = _reused(args)
    rows += reused
    for kind, stack, what in (("oracle", plain, "identity"), ("oracle-adapters", Stack(base, layers, adapters),
                                                             f"adapters of {args.adapters}")):
        if (kind == "oracle-adapters" and adapters is None) or (kind == "oracle" and reused):
            continue
        t = time.perf_counter()
        for s in Oracle(stack, seqs).run(args.taus):
            rows.append({"kind": kind, "name": f"oracle ({what})", "setting": f"KL budget {s['tau']:g}", **s})
        res.log(f"oracle ({what}): {time.perf_counter() - t:.0f} s")
    md = tables(rows, len(seqs), len(layers))
    print(md)
    res.write_results("quality-curve-bound", {"rows": rows, "influence": influence, "args": vars(args),
                                              "sequences": len(seqs), "seconds": time.perf_counter() - t0}, md,
                      args.out, res.docs_dir(args))


def _reused(args) -> list[dict]:
    """The identity oracle's rows of --reuse-oracle's run; SystemExit naming the flag if it was not run alike."""
    import json
    from pathlib import Path

    if not args.reuse_oracle:
        return []
    f = Path(args.reuse_oracle) / "results.json"
    try:
        rec = json.loads(f.read_text())["results"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"--reuse-oracle {args.reuse_oracle}: no results.json of benchmarks.quality_oracle ({e})")
    then = {k: rec["args"].get(k) for k in ("limit", "max_new_tokens", "taus", "layers")}
    now = {k: getattr(args, k) for k in then}
    if then != now:
        raise SystemExit(f"--reuse-oracle {args.reuse_oracle}: that run's settings {then} are not these {now}")
    rows = [r for r in rec["rows"] if r["kind"] == "oracle"]
    if not rows:
        raise SystemExit(f"--reuse-oracle {args.reuse_oracle}: that run has no identity oracle's rows")
    return rows


if __name__ == "__main__":
    main()
