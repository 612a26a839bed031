"""Quality of a trained skipper against the base model and RandomSkip at the same skip ratio.

    python -m benchmarks.quality_hf [--quick] [--skipper DIR|NAME] [--checkpoint DIR] [--out results.json]

For the base model (SmolLM2-135M-Instruct), the trained skipper (default: the one shipped in the
package, joined with the base by vskipper.training.shipped.build_checkpoint and loaded with
vskipper.from_pretrained) and vskipper.RandomSkip over the same routed layers at the skip ratio the
trained skipper measured on the held-out prompts:

  held-out prompts (ids with number % 5 == 0, never trained on), base greedy answer teacher-forced:
    skip      PROJECT share over routed layers and real tokens (vskipper.stats)
    top-1     share of answer positions where the model's argmax is the base's greedy token
    KL        mean KL(base || model) per answer token, full vocabulary, nats
  held-out prompts, free-running greedy (model.generate):
    prefix    share of the base's answer tokens reproduced before the first divergence
  arithmetic set (200 questions with integer answers), free-running greedy:
    acc       last integer in the answer == the answer
    skip      PROJECT share during that generation (prefill and decode tokens)
One markdown table, every row measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import vskipper
from benchmarks.results import table
from benchmarks.serving.report import last_integer, prefix_share  # a reply's answer; greedy agreement
from vskipper.data import load
from vskipper.training.data import chat_ids, generate_greedy, right_pad, split_prompts


@dataclass(frozen=True)
class Result:
    name: str
    skip_heldout: float | None  # None for the base model
    top1: float
    kl: float
    prefix: float
    acc: float
    skip_arith: float | None
    correct: int
    questions: int


def skip_ratio(model) -> float | None:
    if not hasattr(model, "vskipper"):
        return None
    st = vskipper.stats(model, reset=True)
    tokens = sum(s["tokens"] for s in st.values())
    return sum(s["project"] for s in st.values()) / max(1, tokens)


@torch.no_grad()
def teacher_forced(models: dict, base, seqs: list[list[int]], n_prompt: list[int], batch_size: int) -> dict:
    """Per model: (top-1 agreement, mean KL) over answer positions, and the skip ratio."""
    sums = {name: [0, 0.0, 0] for name in models}  # agree, kl, positions
    for m in models.values():
        skip_ratio(m)  # reset counters
    for b in range(0, len(seqs), batch_size):
        idx = range(b, min(b + batch_size, len(seqs)))
        ids, valid = right_pad([torch.tensor(seqs[i]) for i in idx])
        mask = valid.long()
        ans = torch.zeros_like(valid)  # positions that predict an answer token
        for r, i in enumerate(idx):
            ans[r, n_prompt[i] - 1: len(seqs[i]) - 1] = True
        target = ids[:, 1:][ans[:, :-1]]  # the base's greedy tokens
        p = torch.log_softmax(base(ids, attention_mask=mask).logits[ans].float(), -1)
        for name, m in models.items():
            q = torch.log_softmax(m(ids, attention_mask=mask).logits[ans].float(), -1)
            s = sums[name]
            s[0] += int((q.argmax(-1) == target).sum())
            s[1] += float((p.exp() * (p - q)).sum())
            s[2] += int(ans.sum())
    return {name: (s[0] / s[2], s[1] / s[2], skip_ratio(models[name])) for name, s in sums.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 held-out prompts, 40 questions, 64 new tokens")
    ap.add_argument("--skipper", default="smollm2-135m-flexidepth", help="skipper dir or shipped name")
    ap.add_argument("--checkpoint", help="a skip-aware checkpoint dir (instead of --skipper)")
    ap.add_argument("--heldout", type=int, default=80, help="held-out prompts to use")
    ap.add_argument("--questions", type=int, default=200, help="arithmetic questions to use")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--random-seed", type=int, default=0)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.heldout, args.questions, args.max_new_tokens = min(args.heldout, 16), min(args.questions, 40), 64
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vskipper.models.smollm2 import smollm2_dir
    from vskipper.training.shipped import build_checkpoint

    t_start = time.perf_counter()
    log = lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)  # noqa: E731
    base_dir = smollm2_dir()
    ckpt = Path(args.checkpoint) if args.checkpoint else build_checkpoint(skipper=args.skipper)
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    pad, eos = tok.pad_token_id if tok.pad_token_id is not None else 0, tok.eos_token_id
    fresh = lambda: AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()  # noqa: E731
    base = fresh()
    trained = vskipper.from_pretrained(ckpt)
    layers = list(trained.vskipper.skipper.layers)

    _, heldout = split_prompts(load("prompts"))
    heldout = heldout[: args.heldout]
    questions = load("arithmetic")[: args.questions]
    h_prompts = [chat_ids(tok, r["prompt"]) for r in heldout]
    q_prompts = [chat_ids(tok, r["prompt"]) for r in questions]

    log(f"base: greedy answers to {len(heldout)} held-out prompts")
    base_ans = generate_greedy(base, h_prompts, args.max_new_tokens, eos, pad, args.batch_size)
    seqs = [p + a for p, a in zip(h_prompts, base_ans)]
    n_prompt = [len(p) for p in h_prompts]

    log("trained skipper: teacher-forced skip ratio on the held-out answers")
    tf = teacher_forced({"trained": trained}, base, seqs, n_prompt, args.batch_size)
    rate = tf["trained"][2]
    random_model = vskipper.transform(fresh(), vskipper.RandomSkip(rate, layers, seed=args.random_seed))
    models = {"trained": trained, "random": random_model}
    log(f"RandomSkip at rate {rate:.3f} over layers {layers[0]}..{layers[-1]}; teacher-forced metrics")
    tf = teacher_forced(models, base, seqs, n_prompt, args.batch_size)

    results = []
    for name, m in [("base", base), *models.items()]:
        if name == "base":
            prefix = 1.0
        else:
            log(f"{name}: free-running greedy on the held-out prompts")
            prefix = prefix_share(generate_greedy(m, h_prompts, args.max_new_tokens, eos, pad, args.batch_size),
                                  base_ans)
        skip_ratio(m)
        log(f"{name}: {len(questions)} arithmetic questions")
        answers = generate_greedy(m, q_prompts, args.max_new_tokens, eos, pad, args.batch_size)
        correct = sum(last_integer(tok.decode(a, skip_special_tokens=True)) == int(r["answer"])
                      for a, r in zip(answers, questions))
        top1, kl, skip = tf[name] if name != "base" else (1.0, 0.0, None)
        results.append(Result(name, skip, top1, kl, prefix, correct / len(questions), skip_ratio(m), correct,
                              len(questions)))

    label = {"base": "base model (SmolLM2-135M-Instruct)", "trained": f"trained FlexiDepth ({ckpt.name})",
             "random": f"RandomSkip (rate {rate:.3f}, seed {args.random_seed})"}
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    print(f"Quality on {len(heldout)} held-out prompts and {len(questions)} arithmetic questions, greedy, "
          f"{args.max_new_tokens} new tokens max; routed layers {layers[0]}..{layers[-1]}; "
          f"{time.strftime('%Y-%m-%d')}, {platform.machine()} CPU x{torch.get_num_threads()} threads, f32, "
          f"{time.perf_counter() - t_start:.0f} s\n")
    print(table(["model", "skip (held-out)", "top-1 agree", "mean KL (nats)", "greedy prefix agree", "arithmetic acc",
                 "skip (arithmetic)"],
                [[label[r.name], pct(r.skip_heldout), pct(r.top1), f"{r.kl:.4f}", pct(r.prefix),
                  f"{pct(r.acc)} ({r.correct}/{r.questions})", pct(r.skip_arith)] for r in results]))
    if args.out:
        Path(args.out).write_text(json.dumps({"checkpoint": str(ckpt), "args": vars(args),
                                              "results": [asdict(r) for r in results]}, indent=2))


if __name__ == "__main__":
    main()
