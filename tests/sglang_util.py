"""Start a real SGLang engine on CPU (the vskipper_cpu platform) for a test module."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from vskipper.reference import reference_generate

from tiny import VOCAB, synthetic_calibration

NEW = 16  # greedy tokens per prompt in the reference comparisons
ENGINE_ARGS = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_total_tokens=4096,
                   attention_backend="torch_native", disable_cuda_graph=True, log_level="warning",
                   mem_fraction_static=0.5)


@contextlib.contextmanager
def engine(model_path, log_level="warning", engine_args=None, **env):
    """An sgl.Engine with SGLANG_PLATFORM=vskipper_cpu, the given environment variables (VSKIPPER_*)
    and engine arguments (e.g. tp_size) over ENGINE_ARGS."""
    sgl = pytest.importorskip("sglang")
    env = {"SGLANG_PLATFORM": "vskipper_cpu", **env}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    eng = None
    try:
        eng = sgl.Engine(model_path=str(model_path), **{**ENGINE_ARGS, "log_level": log_level, **(engine_args or {})})
        yield eng
    finally:
        if eng is not None:
            eng.shutdown()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def greedy(eng, prompts, n):
    outs = eng.generate(input_ids=[p.tolist() for p in prompts],
                        sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    return [o["output_ids"] for o in outs], [o["meta_info"].get("cached_tokens", 0) for o in outs]


def run_script(script: str, checkpoint, out, **env) -> dict:
    """Run tests/<script> CHECKPOINT OUT in its own process (a ModelRunner of its own, with the given
    VSKIPPER_* environment) and return the JSON it wrote to OUT."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import vskipper

    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join([str(Path(vskipper.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(Path(__file__).parent / script), str(checkpoint), str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(Path(out).read_text())


def prompt_set(seed=5):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(1, VOCAB, (9,), generator=g)
    first = [torch.randint(1, VOCAB, (n,), generator=g) for n in (3, 17, 1, 8)] + [shared]
    # second wave: prompts that extend earlier ones, so the radix cache has their prefixes
    second = [torch.cat([shared, torch.randint(1, VOCAB, (n,), generator=g)]) for n in (2, 6)]
    second += [torch.cat([first[1], torch.randint(1, VOCAB, (4,), generator=g)]),
               torch.randint(1, VOCAB, (12,), generator=g)]
    return first, second


def check_against_reference(eng, base, skipper):
    first, second = prompt_set()
    out1, _ = greedy(eng, first, NEW)
    out2, cached = greedy(eng, second, NEW)
    assert sum(cached) > 0, "the second wave should hit the radix cache"
    for p, out in zip(first + second, out1 + out2):
        ref, _ = reference_generate(base, skipper, p, NEW)
        want = ref[len(p):].tolist()
        assert out == want, f"prompt of {len(p)} tokens: sglang {out} != reference {want}"


def calibrated_cache(tmp_path, base) -> dict:
    """A VSKIPPER_CACHE with a synthetic calibration for this CPU at every thread count (the
    scheduler process may run another count than the test), so that auto uses both bodies."""
    from vskipper import cost

    root = tmp_path / "cache"
    c = base.config
    for n in range(1, (os.cpu_count() or 1) + 1):
        torch.set_num_threads(n)
        cost.save(synthetic_calibration(c.hidden_size, c.intermediate_size), root / "cost")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return {"VSKIPPER_CACHE": str(root)}
