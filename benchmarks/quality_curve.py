"""Quality against skip fraction, one curve per way of skipping: a trained skipper at several router
thresholds, RandomSkip and a static layer drop chosen the way ShortGPT chooses, all on the same
routed layers, beside the base model. In-process with transformers, fp32 (every execution path
computes the same function, so the served model's quality is this one's; `vskipper eval` measures a
served endpoint).

    python -m benchmarks.quality_curve --skipper flexidepth:name=smollm2-135m-flexidepth
    python -m benchmarks.quality_curve --skipper flexidepth:path=DIR --thresholds 0.3 0.5 0.7 --quick
    python -m benchmarks.quality_curve --sublayer-skipper /tmp/skipgpt-run      # a SkipGPT checkpoint beside it

Per point (a skipper at a setting):
    skip      PROJECT share of routed-layer token work on the held-out sequences (vskipper.stats); for a
              sublayer skipper (SkipGPT) the skipped share of routed-layer work, attention and MLP weighted
              by their linear-layer FLOPs (vskipper.training.sublayer_work: SmolLM2-135M 0.25 and 0.75),
              with each sublayer's skipped share of tokens beside it
    top-1, KL teacher-forced over the base's greedy answers to the held-out chat prompts
              (vskipper.eval.agreement.teacher_forced), mean over prompts with its standard error
    prefix    greedy agreement on the hand-written everyday prompts: tokens of the base's answer
              (up to --max-new-tokens) reproduced before the first divergence; mean +- stderr,
              median, share identical in full
    arith     accuracy on the first --arithmetic questions of the arithmetic task (last integer),
              greedy, chat template, +- stderr
    facts     accuracy on the multiple-choice facts task, by log-likelihood of each choice as the
              start of the assistant's answer, +- stderr
Baselines at each trained point's measured skip: RandomSkip(rate=skip) over the routed layers, and
a static drop of round(skip x L) of the L routed layers with the lowest block influence
(ShortGPT: 1 - mean cos(layer input, layer output) of the base model over the training prompts).
A SkipGPT checkpoint (--sublayer-skipper, e.g. `vskipper train --family skipgpt`'s output) is one point
at its own routers' decisions, with RandomSublayerSkip at its measured attention and MLP shares.
Writes results.json and docs/results/quality-curve.md (benchmarks/results.py), and a figure.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from benchmarks import results as res


def block_influence(base, seqs: list[list[int]], layers: list[int]) -> dict[int, float]:
    """ShortGPT's block influence of each routed layer: 1 - mean over tokens of cos(h_in, h_out)."""
    cos = {l: [] for l in layers}
    hooks = [base.model.layers[l].register_forward_hook(
        lambda m, args, out, l=l: cos[l].append(torch.nn.functional.cosine_similarity(
            args[0][0].float(), (out[0] if isinstance(out, tuple) else out)[0].float(), dim=-1)))
        for l in layers]
    try:
        with torch.no_grad():
            for s in seqs:
                base(torch.tensor([s]))
    finally:
        for h in hooks:
            h.remove()
    return {l: float(1 - torch.cat(cos[l]).mean()) for l in layers}


def static_drop(influence: dict[int, float], k: int) -> list[int]:
    """The k routed layers of least influence (ShortGPT's choice)."""
    return sorted(sorted(influence, key=influence.get)[:k])


@torch.no_grad()
def greedy_answers(model, tok, prompts: list[list[int]], n: int, batch: int = 32) -> list[list[int]]:
    from vskipper.training.data import generate_greedy

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    return generate_greedy(model, prompts, n, tok.eos_token_id, pad, batch)


@torch.no_grad()
def mc_accuracy(model, tok, items: list[dict]) -> list[float]:
    """1.0 where the gold choice has the highest log-likelihood as the start of the answer."""
    from vskipper.training.data import chat_ids

    out = []
    for it in items:
        ctx = chat_ids(tok, it["prompt"])
        scores = []
        for c in it["choices"]:
            cont = tok(c, add_special_tokens=False).input_ids
            ids = torch.tensor([ctx + cont])
            logp = torch.log_softmax(model(ids).logits[0, len(ctx) - 1:-1].float(), -1)
            scores.append(float(logp.gather(1, torch.tensor(cont)[:, None]).sum()))
        out.append(float(max(range(len(scores)), key=scores.__getitem__) == it["gold"]))
    return out


class SublayerCounts:
    """A transformed model with a sublayer skipper, as teacher_forced calls it, adding up its attention and
    MLP skips per call (vskipper.stats) so that the skip is weighted by each sublayer's work."""

    def __init__(self, model) -> None:
        import vskipper

        self.model, self.stats = model, vskipper.stats
        self.tokens = self.attention = self.mlp = 0
        self.stats(model, reset=True)

    def __call__(self, ids):
        out = self.model(ids)
        for s in self.stats(self.model, reset=True).values():
            self.tokens, self.attention, self.mlp = (self.tokens + s["tokens"], self.attention + s["attention_skip"],
                                                     self.mlp + s["mlp_skip"])
        return out

    def shares(self) -> tuple[float, float, float] | tuple[None, None, None]:
        """(skipped work, attention's skipped share of tokens, the MLP's)."""
        from vskipper.training import sublayer_work

        if not self.tokens:
            return None, None, None
        a, m = self.attention / self.tokens, self.mlp / self.tokens
        wa, wm = sublayer_work(self.model.config)
        return wa * a + wm * m, a, m


def evaluate(name: str, model, base_data: dict, tok, args, share: float = 1.0) -> dict:
    """share: the model's routed layers over the curve's (a static drop routes only what it drops), so
    that every skip fraction is of the same routed-layer work."""
    from vskipper.eval.agreement import teacher_forced
    from vskipper.eval.scoring import agreement, last_integer, mean_stderr
    from vskipper.training.data import chat_ids

    t0 = time.perf_counter()
    skipper = getattr(getattr(model, "vskipper", None), "skipper", None)
    counted = SublayerCounts(model) if skipper is not None and skipper.sublayers else None
    tf = teacher_forced(base_data["base"], counted or model, base_data["seqs"], base_data["n_prompt"])
    ans = greedy_answers(model, tok, base_data["everyday"], args.max_new_tokens)
    ag = agreement(ans, base_data["everyday_base"])
    qs = base_data["arith"]
    replies = greedy_answers(model, tok, [chat_ids(tok, q["prompt"]) for q in qs], args.arith_tokens)
    arith = [float(last_integer(tok.decode(r, skip_special_tokens=True)) == int(q["answer"]))
             for r, q in zip(replies, qs)]
    facts = mc_accuracy(model, tok, base_data["facts"])
    (am, ase), (fm, fse) = mean_stderr(arith), mean_stderr(facts)
    skip = None if tf["skip"] is None else tf["skip"] * share
    skip_a = skip_m = None
    if counted is not None:
        skip, skip_a, skip_m = counted.shares()
    row = {"name": name, "skip": skip, "skip_attention": skip_a, "skip_mlp": skip_m, "top1": tf["top1_mean"],
           "top1_se": tf["top1_stderr"], "kl": tf["kl_mean"], "kl_se": tf["kl_stderr"], "prefix": ag["prefix_mean"],
           "prefix_se": ag["prefix_mean_stderr"], "prefix_median": ag["prefix_median"],
           "identical": ag["identical"], "arith": am, "arith_se": ase, "facts": fm, "facts_se": fse,
           "seconds": time.perf_counter() - t0}
    sub = "" if skip_a is None else f" (attention {_pct(skip_a)}, MLP {_pct(skip_m)})"
    res.log(f"{name}: skip {_pct(row['skip'])}{sub}, top-1 {_pct(row['top1'])}, KL {row['kl']:.3f}, prefix "
            f"{row['prefix']:.1f}, arithmetic {_pct(am)}, facts {_pct(fm)} ({row['seconds']:.0f} s)")
    return row


def sublayer_checkpoint(path):
    """A SkipGPT checkpoint directory -> (its base model, its SkipGPT skipper); SystemExit naming the flag."""
    from pathlib import Path

    from vskipper.models.checkpoint import CheckpointError, read_config
    from vskipper.skippers.skipgpt import ARCHITECTURE, load_skipgpt

    try:
        arch = (read_config(Path(path)).get("architectures") or [None])[0]
        if arch != ARCHITECTURE:
            raise CheckpointError(f"config.json architectures[0]={arch!r}, expected {ARCHITECTURE!r}")
        return load_skipgpt(path)
    except (CheckpointError, OSError) as e:
        raise SystemExit(f"--sublayer-skipper {path}: not a SkipGPT checkpoint directory: {e}") from None


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def base_data(base, tok, args) -> dict:
    from vskipper.data import load
    from vskipper.eval.agreement import heldout_prompts
    from vskipper.training.data import chat_ids, split_prompts

    tf_recs = heldout_prompts(["everyday", "chat"], args.limit)
    tf_prompts = [chat_ids(tok, r["prompt"]) for r in tf_recs]
    answers = greedy_answers(base, tok, tf_prompts, args.max_new_tokens)
    everyday = [chat_ids(tok, r["prompt"]) for r in heldout_prompts(["everyday"], args.limit)]
    train = split_prompts(load("chat"))[0][: args.influence_prompts]
    return {"base": base, "seqs": [p + a for p, a in zip(tf_prompts, answers)],
            "n_prompt": [len(p) for p in tf_prompts], "everyday": everyday,
            "everyday_base": answers[: len(everyday)], "arith": load("arithmetic")[: args.arithmetic],
            "facts": load("facts_mc")[: args.facts],
            "influence_seqs": [chat_ids(tok, r["prompt"]) for r in train]}


def figure(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for kind, marker in (("trained", "o"), ("random", "s"), ("static", "^"), ("skipgpt", "D"),
                         ("random-sublayer", "v")):
        pts = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["skip"])
        if not pts:
            continue
        for ax, key, label in zip(axes, ("top1", "prefix", "facts"),
                                  ("teacher-forced top-1 agreement", "greedy agreeing prefix (tokens)",
                                   "facts accuracy")):
            ax.errorbar([100 * r["skip"] for r in pts], [r[key] for r in pts],
                        yerr=[r.get(key + "_se", 0) for r in pts], marker=marker, label=kind, capsize=2)
            ax.set_xlabel("skipped routed-layer work (%)")
            ax.set_title(label, fontsize=9)
    base = next(r for r in rows if r["kind"] == "base")
    for ax, key in zip(axes, ("top1", "prefix", "facts")):
        ax.axhline(base[key], color="gray", linestyle="--", linewidth=1, label="base")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skipper", default="flexidepth:name=smollm2-135m-flexidepth",
                    help="the trained skipper (a flexidepth spec); its routed layers are the baselines' too")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.85])
    ap.add_argument("--sublayer-skipper", metavar="DIR", action="append", default=[],
                    help="a SkipGPT checkpoint directory (config.json architectures [\"SkipGPTLlamaForCausalLM\"], "
                         "e.g. from `vskipper train --family skipgpt`): one point at its routers' decisions, and "
                         "RandomSublayerSkip at its attention and MLP shares; repeatable")
    ap.add_argument("--compare", metavar="SPEC", help="another skipper (e.g. the one shipped now), one row at its "
                                                     "own settings: to choose which to ship")
    ap.add_argument("--limit", type=int, help="at most this many prompts per held-out set")
    ap.add_argument("--arithmetic", type=int, default=100, help="arithmetic questions per point")
    ap.add_argument("--facts", type=int, default=339, help="multiple-choice facts per point")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="greedy answer length for the agreement")
    ap.add_argument("--arith-tokens", type=int, default=96, help="greedy reply length for arithmetic")
    ap.add_argument("--influence-prompts", type=int, default=64, help="training prompts for block influence")
    ap.add_argument("--quick", action="store_true", help="a look, not a result: 8 prompts a set, 16 questions")
    ap.add_argument("--threads", type=int)
    res.add_arguments(ap, "quality-curve")
    args = ap.parse_args(argv)
    if args.quick:
        args.limit, args.arithmetic, args.facts = 8, 16, 24
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import vskipper
    from vskipper.models.smollm2 import smollm2_dir
    from vskipper.training import sublayer_work

    trained = vskipper.parse_skipper(args.skipper)
    if not isinstance(trained, vskipper.FlexiDepth):
        raise SystemExit(f"--skipper {args.skipper!r}: expected a flexidepth spec (a trained router has a threshold)")
    sublayer = [sublayer_checkpoint(d) for d in args.sublayer_skipper]  # refused before anything slow
    layers = list(trained.layers)
    path = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    res.log("base model: greedy answers to the held-out prompts, block influence")
    data = base_data(base, tok, args)
    influence = block_influence(base, data["influence_seqs"], layers)
    rows = [{**evaluate("base", base, data, tok, args), "kind": "base", "setting": "-"}]

    def transformed(skipper):
        return vskipper.transform(copy.deepcopy(base), skipper, vskipper.Config(execution="dense"))

    for t in args.thresholds:
        sk = copy.deepcopy(trained)
        sk.threshold = t
        row = {**evaluate(f"trained, threshold {t:g}", transformed(sk), data, tok, args), "kind": "trained",
               "setting": f"threshold {t:g}"}
        rows.append(row)
        skip = row["skip"] or 0.0
        rows.append({**evaluate(f"RandomSkip {skip:.3f}", transformed(vskipper.RandomSkip(skip, layers, seed=0)),
                                data, tok, args), "kind": "random", "setting": f"rate {skip:.3f}"})
        k = round(skip * len(layers))
        if k:
            drop = static_drop(influence, k)
            rows.append({**evaluate(f"static drop {drop}", transformed(vskipper.Static(drop)), data, tok, args,
                                    share=len(drop) / len(layers)),
                         "kind": "static", "setting": f"layers {drop}"})
    for d, (model, sk) in zip(args.sublayer_skipper, sublayer):
        row = {**evaluate(f"SkipGPT {d}", vskipper.transform(model, sk, vskipper.Config(execution="dense")), data,
                          tok, args), "kind": "skipgpt", "setting": f"layers {sk.layers[0]}-{sk.layers[-1]}"}
        rows.append(row)
        a, m = row["skip_attention"] or 0.0, row["skip_mlp"] or 0.0
        rows.append({**evaluate(f"RandomSublayerSkip {a:.3f}, {m:.3f}",
                                transformed(vskipper.RandomSublayerSkip(a, m, list(sk.layers), seed=0)), data, tok,
                                args), "kind": "random-sublayer", "setting": f"attn_rate {a:.3f}, mlp_rate {m:.3f}"})
    if args.compare:
        rows.append({**evaluate(f"compared: {args.compare}", transformed(vskipper.parse_skipper(args.compare)), data,
                                tok, args), "kind": "compared", "setting": args.compare})
    header = ["system", "setting", "skip", "attention / MLP skipped", "top-1 (tf)", "KL (tf)", "agreeing prefix",
              "median", "identical", "arithmetic", "facts"]
    body = [[r["kind"], r["setting"], _pct(r["skip"]),
             "-" if r.get("skip_attention") is None else f"{_pct(r['skip_attention'])} / {_pct(r['skip_mlp'])}",
             f"{_pct(r['top1'])} +- {100 * r['top1_se']:.1f}",
             f"{r['kl']:.3f} +- {r['kl_se']:.3f}", f"{r['prefix']:.1f} +- {r['prefix_se']:.1f}",
             f"{r['prefix_median']:.0f}", _pct(r["identical"]), f"{_pct(r['arith'])} +- {100 * r['arith_se']:.1f}",
             f"{_pct(r['facts'])} +- {100 * r['facts_se']:.1f}"] for r in rows]
    n = len(data["seqs"])
    head = (f"Quality against skip, {args.skipper} (routed layers {layers[0]}-{layers[-1]}), SmolLM2-135M-Instruct, "
            f"fp32, in process. Teacher-forced (tf) over the base's greedy answers to {n} held-out chat prompts; "
            f"greedy agreement on {len(data['everyday'])} everyday prompts, {args.max_new_tokens} new tokens; "
            f"{len(data['arith'])} arithmetic questions; {len(data['facts'])} multiple-choice facts. Block "
            f"influence (ShortGPT) of the routed layers: "
            + ", ".join(f"{l}: {v:.3f}" for l, v in sorted(influence.items())))
    if sublayer:
        wa, wm = sublayer_work(base.config)
        head += (f". SkipGPT (sublayer) points: skip is the skipped share of routed-layer work, attention weighted "
                 f"{wa:.2f} and MLP {wm:.2f} (their linear-layer FLOPs per token); the next column gives each "
                 f"sublayer's skipped share of tokens. Every token still writes its K/V, in both families")
    md = f"{head}\n\n{res.table(header, body)}"
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    figure(rows, args.out / "quality-curve.png")
    docs = res.docs_dir(args)
    if docs is not None:  # the figure beside its page
        docs.mkdir(parents=True, exist_ok=True)
        figure(rows, docs / "quality-curve.png")
    res.write_results("quality-curve", {"rows": rows, "influence": influence, "args": vars(args)}, md, args.out,
                      docs)


if __name__ == "__main__":
    main()
