"""Quality against skip fraction, one curve per way of skipping: trained skippers at several router
thresholds, RandomSkip and a static layer drop chosen the way ShortGPT chooses, all on the same
routed layers, beside the base model and (--bound) the oracle's bound (benchmarks/quality_oracle.py).
In-process with transformers, fp32 (every execution path computes the same function, so the served
model's quality is this one's; `vskipper eval` measures a served endpoint).

    python -m benchmarks.quality_curve --skipper flexidepth:name=smollm2-135m-flexidepth
    python -m benchmarks.quality_curve --skipper flexidepth:path=A --skipper flexidepth:path=B \
        --bound out/quality-curve-bound
    python -m benchmarks.quality_curve --skipper flexidepth:path=DIR --thresholds 0.3 0.5 --quick
    python -m benchmarks.quality_curve --sublayer-skipper /tmp/skipgpt-run      # a SkipGPT checkpoint beside it

Per point (a skipper at a setting):
    skip      PROJECT share of routed-layer token work, on generated tokens unless it says otherwise:
              teacher-forced over the held-out sequences, at the generated positions (the answer's tokens
              a generation feeds back) and, apart, at the prompt's; and in the greedy generations of the
              everyday prompts, on the tokens decoded (vskipper.stats' decode counts). For a sublayer
              skipper (SkipGPT) the skipped share of routed-layer work over every position, attention and MLP
              weighted by their linear-layer FLOPs (vskipper.training.sublayer_work: SmolLM2-135M 0.25 and
              0.75), with each sublayer's skipped share of tokens beside it
    top-1, KL teacher-forced over the base's greedy answers to the held-out chat prompts
              (vskipper.eval.agreement.teacher_forced), mean over prompts with its standard error
    prefix    greedy agreement on the hand-written everyday prompts: tokens of the base's answer
              (up to --max-new-tokens) reproduced before the first divergence; mean +- stderr,
              median, share identical in full
    arith     accuracy on the first --arithmetic questions of the arithmetic task (last integer),
              greedy, chat template, +- stderr
    facts     accuracy on the multiple-choice facts task, by log-likelihood of each choice as the
              start of the assistant's answer, +- stderr
Baselines at each of --baselines (skip levels): RandomSkip(rate) over the routed layers, and a static
drop of round(rate x L) of the L routed layers with the lowest block influence (ShortGPT: 1 - mean
cos(layer input, layer output) of the base model over the training prompts); both skip prompt and
generated tokens alike, as they do in serving (the bound's page has them on generated tokens only).
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
        self.vskipper = model.vskipper  # its route counters (teacher_forced reads the decisions per position)
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
    import vskipper
    from vskipper.counters import skipped_share
    from vskipper.eval.agreement import teacher_forced
    from vskipper.eval.scoring import agreement, last_integer, mean_stderr
    from vskipper.training.data import chat_ids

    t0 = time.perf_counter()
    skipper = getattr(getattr(model, "vskipper", None), "skipper", None)
    counted = SublayerCounts(model) if skipper is not None and skipper.sublayers else None
    tf = teacher_forced(base_data["base"], counted or model, base_data["seqs"], base_data["n_prompt"])
    if skipper is not None:
        vskipper.stats(model, reset=True)
    ans = greedy_answers(model, tok, base_data["everyday"], args.max_new_tokens)
    decode = skipped_share(vskipper.stats(model), "decode") if skipper is not None else None
    ag = agreement(ans, base_data["everyday_base"])
    qs = base_data["arith"]
    replies = greedy_answers(model, tok, [chat_ids(tok, q["prompt"]) for q in qs], args.arith_tokens)
    arith = [float(last_integer(tok.decode(r, skip_special_tokens=True)) == int(q["answer"]))
             for r, q in zip(replies, qs)]
    facts = mc_accuracy(model, tok, base_data["facts"])
    (am, ase), (fm, fse) = mean_stderr(arith), mean_stderr(facts)
    scale = (lambda v: None if v is None else v * share)  # noqa: E731
    skip, gen, prompt = scale(tf["skip"]), scale(tf["skip_generated"]), scale(tf["skip_prompt"])
    skip_a = skip_m = None
    if counted is not None:  # a sublayer skipper: its work-weighted skip, over every position
        skip, skip_a, skip_m = counted.shares()
        gen, prompt, decode = skip, None, None
    row = {"name": name, "skip_all": skip, "skip": gen, "skip_prompt": prompt, "skip_decode": scale(decode),
           "skip_attention": skip_a, "skip_mlp": skip_m, "top1": tf["top1_mean"],
           "top1_se": tf["top1_stderr"], "kl": tf["kl_mean"], "kl_se": tf["kl_stderr"], "prefix": ag["prefix_mean"],
           "prefix_se": ag["prefix_mean_stderr"], "prefix_median": ag["prefix_median"],
           "identical": ag["identical"], "arith": am, "arith_se": ase, "facts": fm, "facts_se": fse,
           "seconds": time.perf_counter() - t0}
    sub = "" if skip_a is None else f" (attention {_pct(skip_a)}, MLP {_pct(skip_m)})"
    res.log(f"{name}: skip {_pct(row['skip'])} of generated tokens, {_pct(row['skip_prompt'])} of the prompt's, "
            f"{_pct(row['skip_decode'])} decoded{sub}, top-1 {_pct(row['top1'])}, KL {row['kl']:.3f}, prefix "
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


def figure(rows: list[dict], path, bound: list[dict] | None = None) -> None:
    """Top-1, agreeing prefix and facts against the skip on generated tokens; the bound's oracle (its
    teacher-forced figures) on the first two."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    keys = (("top1", "teacher-forced top-1 agreement"), ("prefix", "greedy agreeing prefix (tokens)"),
            ("facts", "facts accuracy"))
    trained = sorted({r["setting"].split(",")[0] for r in rows if r["kind"] == "trained"})
    series = [(f"trained {t}" if len(trained) > 1 else "trained", [r for r in rows if r["kind"] == "trained"
                                                                    and r["setting"].startswith(t)], "o")
              for t in trained]
    series += [(kind, [r for r in rows if r["kind"] == kind], m) for kind, m in (
        ("random", "s"), ("static", "^"), ("skipgpt", "D"), ("random-sublayer", "v"))]
    for o, m in (("oracle", "*"), ("oracle-adapters", "P")):
        series.append((f"{o} (bound, teacher-forced)", [r for r in bound or [] if r["kind"] == o], m))
    for label, pts, marker in series:
        pts = sorted((r for r in pts if r.get("skip_generated", r.get("skip")) is not None),
                     key=lambda r: r.get("skip_generated", r.get("skip")))
        if not pts:
            continue
        for ax, (key, title) in zip(axes, keys):
            if key not in pts[0]:
                continue
            ax.errorbar([100 * r.get("skip_generated", r.get("skip")) for r in pts], [r[key] for r in pts],
                        yerr=[r.get(key + "_se", 0) for r in pts], marker=marker, label=label, capsize=2)
            ax.set_xlabel("skipped routed-layer work on generated tokens (%)")
            ax.set_title(title, fontsize=9)
    base = next(r for r in rows if r["kind"] == "base")
    for ax, (key, _) in zip(axes, keys):
        ax.axhline(base[key], color="gray", linestyle="--", linewidth=1, label="base")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skipper", action="append", metavar="SPEC",
                    help="a trained skipper (a flexidepth spec), at each --thresholds; repeatable (default the "
                         "shipped one); the first one's routed layers are the baselines' too")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.35, 0.4, 0.45, 0.5])
    ap.add_argument("--baselines", type=float, nargs="*", default=[0.1, 0.15, 0.2, 0.3],
                    help="skip levels of RandomSkip and the static drop (default %(default)s)")
    ap.add_argument("--merge", metavar="DIR", action="append", default=[],
                    help="an earlier run's --out, measured on the same prompts and questions: its rows (all but the "
                         "base's) join this run's page as they are; repeatable")
    ap.add_argument("--bound", metavar="DIR", help="benchmarks/quality_oracle.py's --out directory: its tables on "
                                                   "this page, its oracle on the figure")
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
    specs = args.skipper or ["flexidepth:name=smollm2-135m-flexidepth"]
    if args.quick:
        args.limit, args.arithmetic, args.facts = 8, 16, 24
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import vskipper
    from vskipper.models.smollm2 import smollm2_dir
    from vskipper.training import sublayer_work

    trained = [vskipper.parse_skipper(spec) for spec in specs]
    for spec, sk in zip(specs, trained):
        if not isinstance(sk, vskipper.FlexiDepth):
            raise SystemExit(f"--skipper {spec!r}: expected a flexidepth spec (a trained router has a threshold)")
    bound = _bound(args.bound)  # refused before anything slow, as the rest
    merged = [r for d in args.merge for r in _merged(d, args)]
    sublayer = [sublayer_checkpoint(d) for d in args.sublayer_skipper]
    layers = list(trained[0].layers)
    path = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    res.log("base model: greedy answers to the held-out prompts, block influence")
    data = base_data(base, tok, args)
    influence = block_influence(base, data["influence_seqs"], layers)
    rows = [{**evaluate("base", base, data, tok, args), "kind": "base", "setting": "-"}]

    def transformed(skipper):
        return vskipper.transform(copy.deepcopy(base), skipper, vskipper.Config(execution="dense"))

    for spec, sk in zip(specs, trained):
        for t in args.thresholds:
            sk = copy.deepcopy(sk)
            sk.threshold = t
            rows.append({**evaluate(f"{spec}, threshold {t:g}", transformed(sk), data, tok, args), "kind": "trained",
                         "setting": f"{spec}, threshold {t:g}"})
    dropped = set()
    for rate in args.baselines:
        rows.append({**evaluate(f"RandomSkip {rate:g}", transformed(vskipper.RandomSkip(rate, layers, seed=0)),
                                data, tok, args), "kind": "random", "setting": f"rate {rate:g}"})
        k = round(rate * len(layers))
        if k and k not in dropped:  # levels a layer apart or less share their drop
            dropped.add(k)
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
    rows += merged
    if args.compare:
        rows.append({**evaluate(f"compared: {args.compare}", transformed(vskipper.parse_skipper(args.compare)), data,
                                tok, args), "kind": "compared", "setting": args.compare})
    sub = any(r.get("skip_attention") is not None for r in rows)
    header = ["system", "setting", "skip, generated (tf)", "skip, prompt (tf)", "skip, decoded (greedy)"] + (
        ["attention / MLP skipped"] if sub else []) + [
        "top-1 (tf)", "KL (tf)", "agreeing prefix", "median", "identical", "arithmetic", "facts"]
    body = [[r["kind"], r["setting"], _pct(r["skip"]), _pct(r["skip_prompt"]), _pct(r["skip_decode"])] + (
        ["-" if r.get("skip_attention") is None else f"{_pct(r['skip_attention'])} / {_pct(r['skip_mlp'])}"]
        if sub else []) + [
        f"{_pct(r['top1'])} +- {100 * r['top1_se']:.1f}", f"{r['kl']:.3f} +- {r['kl_se']:.3f}",
        f"{r['prefix']:.1f} +- {r['prefix_se']:.1f}", f"{r['prefix_median']:.0f}", _pct(r["identical"]),
        f"{_pct(r['arith'])} +- {100 * r['arith_se']:.1f}", f"{_pct(r['facts'])} +- {100 * r['facts_se']:.1f}"]
        for r in rows]
    n = len(data["seqs"])
    specs_shown = specs + [r["setting"].rsplit(", threshold", 1)[0] for r in merged if r["kind"] == "trained"]
    head = (f"Quality against skip, {', '.join(dict.fromkeys(specs_shown))} (routed layers {layers[0]}-{layers[-1]}), "
            f"SmolLM2-135M-Instruct, fp32, in process. Skip is the PROJECT share of routed-layer work on generated "
            f"tokens unless it says otherwise: teacher-forced (tf) over the base's greedy answers to {n} held-out "
            f"chat prompts at the generated positions (the answer's tokens a generation feeds back) and, apart, "
            f"at the prompt's; and on the tokens decoded in the greedy agreement. Greedy agreement on "
            f"{len(data['everyday'])} everyday prompts, {args.max_new_tokens} new tokens; {len(data['arith'])} "
            f"arithmetic questions; {len(data['facts'])} multiple-choice facts. RandomSkip and the static drop "
            f"skip prompt and generated tokens alike. Block influence (ShortGPT) of the routed layers: "
            + ", ".join(f"{l}: {v:.3f}" for l, v in sorted(influence.items())))
    if sublayer:
        wa, wm = sublayer_work(base.config)
        head += (f". SkipGPT (sublayer) points: skip is the skipped share of routed-layer work over every position, "
                 f"attention weighted {wa:.2f} and MLP {wm:.2f} (their linear-layer FLOPs per token); the attention / "
                 f"MLP column gives each sublayer's skipped share of tokens. Every token still writes its K/V, in "
                 f"both families")
    md = f"{head}\n\n{res.table(header, body)}"
    if bound is not None:
        from benchmarks.quality_oracle import tables

        rec = bound["results"]
        md += (f"\n\n## The bound (benchmarks/quality_oracle.py, {bound['date']}: `{bound['command']}`)\n\n"
               + tables(rec["rows"], rec["sequences"], len(layers)))
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    oracle = None if bound is None else bound["results"]["rows"]
    figure(rows, args.out / "quality-curve.png", oracle)
    docs = res.docs_dir(args)
    if docs is not None:  # the figure beside its page
        docs.mkdir(parents=True, exist_ok=True)
        figure(rows, docs / "quality-curve.png", oracle)
    res.write_results("quality-curve", {"rows": rows, "influence": influence, "args": vars(args)}, md, args.out,
                      docs)


SAME_DATA = ("limit", "arithmetic", "facts", "max_new_tokens", "arith_tokens", "influence_prompts", "quick")


def _merged(path, args) -> list[dict]:
    """The rows (all but the base's) of an earlier run in `path`, measured on this run's prompts and questions
    (SAME_DATA), or SystemExit naming the flag."""
    import json
    from pathlib import Path

    try:
        rec = json.loads((Path(path) / "results.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--merge {path}: no results.json of benchmarks.quality_curve there ({e})") from None
    if rec.get("name") != "quality-curve":
        raise SystemExit(f"--merge {path}: it holds {rec.get('name')!r}'s results, not the quality curve's")
    then = rec["results"]["args"]
    diff = {k: (then.get(k), getattr(args, k)) for k in SAME_DATA if then.get(k) != getattr(args, k)}
    if diff:
        raise SystemExit(f"--merge {path}: measured on other prompts or questions {diff} (then, now)")
    return [r for r in rec["results"]["rows"] if r["kind"] != "base"]


def _bound(path) -> dict | None:
    """The bound's results.json record (benchmarks/quality_oracle.py), or None; SystemExit naming the flag."""
    import json
    from pathlib import Path

    if path is None:
        return None
    f = Path(path) / "results.json"
    try:
        rec = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--bound {path}: no results.json of benchmarks.quality_oracle there ({e})") from None
    if rec.get("name") != "quality-curve-bound":
        raise SystemExit(f"--bound {path}: {f} is {rec.get('name')!r}'s, not benchmarks.quality_oracle's")
    return rec


if __name__ == "__main__":
    main()
