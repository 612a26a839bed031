"""benchmarks/gpu/gpu_check.sh cannot rot: its --smoke run (every step at tiny shapes on CPU, the
Triton interpreter where Triton runs, the guarded eager step in place of CUDA-graph capture), its
bad-input exits, and the ideal model of benchmarks/gpu/decode.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu" / "gpu_check.sh"
STEPS = ("model", "calibrate", "tune", "kernels", "decode", "prefill", "profile", "ops", "props")


def run_check(*args, out: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_smoke_run_passes_every_step(tmp_path):
    r = run_check("--smoke", out=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = (tmp_path / "summary.md").read_text()
    for step in STEPS:
        assert f"| {step} | ok |" in summary, summary
    pages = {p.name for p in (tmp_path / "results").iterdir()}
    assert pages == {"gpu-model.md", "calibration.md", "gpu-decode.md", "gpu-kernels.md", "gpu-prefill.md",
                     "gpu-profile.md"}
    runs = {p.parent.name for p in (tmp_path / "runs").glob("*/results.json")}
    assert runs == {"model", "calibration", "decode", "kernels", "prefill", "profile"}
    prefill = (tmp_path / "results" / "gpu-prefill.md").read_text()
    assert "| P | B | base ms | dense ms | routed ms | auto ms |" in prefill and "FAILED" not in prefill
    assert "| grouped MLP side |" in (tmp_path / "results" / "gpu-profile.md").read_text()
    assert "FAILED" not in (tmp_path / "results" / "gpu-model.md").read_text()
    assert json.loads((tmp_path / "runs" / "model" / "results.json").read_text())["results"]["passed"] is True
    decode = (tmp_path / "results" / "gpu-decode.md").read_text()
    assert "| base tok/s | dense tok/s | routed tok/s | auto tok/s |" in decode
    assert "calibration 'cpu" in decode  # auto found the calibration the step before made
    assert "| routed0 tok/s | base-eager tok/s |" in decode and "| auto replayed |" in decode
    assert "V* (resident K/V tokens" in decode and "tau (routed at RandomSkip 0 less base" in decode  # (timed in-run)
    assert "FAILED" not in decode and "compiled (torch.compile aot_eager, regional)" in decode
    assert list((tmp_path / "vskipper" / "kernel_configs").glob("*.json"))
    assert all((tmp_path / "logs" / f"{s}.log").is_file() for s in STEPS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this would run the real check")
def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    r = run_check(out=tmp_path, timeout=120)
    assert r.returncode == 2
    assert "no CUDA device: this check needs a GPU" in r.stderr
    assert "--smoke" in r.stderr


def test_bad_arguments_exit_2(tmp_path):
    r = run_check("--fast", out=tmp_path, timeout=60)
    assert r.returncode == 2 and "unknown argument '--fast'" in r.stderr
    r = run_check("--smoke", "--only", out=tmp_path, timeout=60)
    assert r.returncode != 0


def test_missing_package_is_named(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # -S: no site-packages, so no torch
    fake.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(fake)}
    r = subprocess.run(["bash", str(SCRIPT), "--smoke"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "missing python package(s): torch" in r.stderr


def test_ideal_model():
    from benchmarks.gpu import decode as D
    from benchmarks.gpu import harness as G

    m, s = D.Machine(4.8e12, 989e12), G.LLAMA3_8B
    assert D.ideal_speedups(s, 16, 1024, m, 0.0) == (1.0, 1.0)  # nothing skipped: nothing saved
    ideal, mlp_only = D.ideal_speedups(s, 1, 1024, m, 0.5)
    assert ideal > mlp_only > 1.0  # one sequence: a skipped layer need not stream its weights
    ideal, mlp_only = D.ideal_speedups(s, 16, 1024, m, 0.5)
    assert mlp_only == pytest.approx(1.0, abs=1e-3)  # 16 rows: some row runs the MLP, its weights stream
    assert D.ideal_speedups(s, 64, 4096, m, 0.5)[0] > D.ideal_speedups(s, 64, 1024, m, 0.5)[0]  # KV reads saved
    base_ms = D.step_time(s, 1, 1024, m) * 1e3
    assert 3.0 < base_ms < 3.6  # about 16 GB of bf16 weights at 4.8 TB/s


def test_full_mask_step_takes_the_unmasked_attention_and_matches(monkeypatch):
    """benchmarks/gpu/decode.py times Step(full=True): SDPA without a mask (GQA left to SDPA); it must
    compute what the masked step computes, for the base model and a transformed one."""
    import vskipper
    from benchmarks.gpu import harness as G

    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k.get("attn_mask")) or real(*a, **k))
    shape = G.TINY
    base = G.build_llama(shape, torch.device("cpu"), torch.float32, std=0.15)
    kv = G.PoolKV(shape, 3 * 8, torch.device("cpu"), torch.float32)
    routed = G.transformed(base, vskipper.RandomSkip(0.5, shape.routed), "routed")
    for model in (base, routed):
        kv.view(3, 8, None)
        kv.randomize(seed=1)
        out = {}
        for full in (False, True):
            step = G.Step(model, kv, 3, 8, full=full)
            step.ids.copy_(torch.tensor([[5], [7], [9]]))
            step.positions.fill_(7)
            calls.clear()
            out[full] = step()
            # the routed layers attend through vskipper's cache_decode_attention, the others through SDPA
            stock = shape.layers - (len(shape.routed) if model is routed else 0)
            assert len(calls) == stock and all((m is None) == full for m in calls)
        torch.testing.assert_close(out[True], out[False], atol=2e-5, rtol=2e-4)
