"""The interim main job: build a FlexiDepth-layout checkpoint from the bundled SmolLM2-135M,
load it with `vskipper.from_pretrained`, generate, and print per-layer skip ratios.

The skipper's router weights are random (seeded), so the skipped tokens are arbitrary; the
point is the path checkpoint -> transform -> generate -> stats, on a real model, offline."""
from __future__ import annotations

import argparse
import time

import torch

import vskipper
from vskipper.models.smollm2 import cache_root, smollm2_dir


def build_checkpoint(layers: list[int], seed: int = 0):
    from transformers import AutoModelForCausalLM

    from vskipper.models.hf_loader import save_checkpoint

    out = cache_root() / f"demo-flexidepth-{layers[0]}-{layers[-1]}-s{seed}"
    if (out / "model.safetensors").is_file():
        return out
    src = smollm2_dir()
    base = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    c = base.config
    torch.manual_seed(seed)
    sk = vskipper.FlexiDepth(layers, c.hidden_size, c.intermediate_size, c.rms_norm_eps, gate="soft")
    with torch.no_grad():  # small adapters: a skipped token mostly keeps its hidden state
        for a in sk.adapters.values():
            a.up_proj.weight.mul_(0.1)
    save_checkpoint(out, base, sk)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--execution", default="auto", choices=["auto", "dense", "routed"])
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    layers = list(range(24, 30))
    path = build_checkpoint(layers)
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    model = vskipper.from_pretrained(path, vskipper.Config(execution=args.execution))
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    dt = time.perf_counter() - t0
    print(f"checkpoint: {path}")
    print(f"prompt:     {args.prompt}")
    print(f"output:     {tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")
    print(f"            {out.shape[1] - ids.shape[1]} tokens in {dt:.2f} s\n")
    print("| layer | tokens | run | project | skip ratio |\n|---|---|---|---|---|")
    for l, s in vskipper.stats(model).items():
        print(f"| {l} | {s['tokens']} | {s['run']} | {s['project']} | {s['project'] / max(1, s['tokens']):.2f} |")


if __name__ == "__main__":
    main()
