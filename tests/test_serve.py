"""`vskipper serve`: its defaults (the bundled model with its shipped skipper; --skipper none), the
real server on 127.0.0.1, an OpenAI-client completion, a clean shutdown; bad input fails before the
server starts or at load, naming what is wrong."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file, save_file

from vskipper.eval.server import free_port
from vskipper.models.hf_loader import save_checkpoint

from helpers import readme_blocks, run_block
from tiny import flexidepth_for, synthetic_calibration, tiny_llama

pytestmark = pytest.mark.sglang
VSKIPPER = [sys.executable, "-m", "vskipper.cli"]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    import requests

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode} before it was healthy")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise AssertionError("server not healthy in time")


def serve_env(monkeypatch, argv: list[str], environ: dict | None = None) -> tuple[list[str], dict]:
    """What `vskipper serve ARGV` would run (command line, environment), without starting it; a cost
    calibration is found in a fresh cache, so nothing is measured."""
    from vskipper import cli, first_start

    for k in ("VSKIPPER_SKIPPER", *(environ or {})):
        monkeypatch.delenv(k, raising=False)
    for k, v in (environ or {}).items():
        monkeypatch.setenv(k, v)
    seen = {}

    def fake_run(cmd, env, host, port, announce):
        seen.update(cmd=cmd, env=env, announce=announce)
        return 0

    monkeypatch.setattr(first_start, "run", fake_run)
    monkeypatch.setattr(first_start, "ensure_calibration", lambda *a, **k: (synthetic_calibration(576, 1536),
                                                                              synthetic_calibration(576, 1536),
                                                                              "reused from a test"))
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", *argv])
    assert e.value.code == 0
    return seen["cmd"], seen["env"]


def test_serve_default_is_the_bundled_model_with_its_shipped_skipper(monkeypatch):
    from vskipper.models.smollm2 import smollm2_dir

    cmd, env = serve_env(monkeypatch, [])
    assert cmd[cmd.index("--model-path") + 1] == str(smollm2_dir())
    assert env["VSKIPPER_SKIPPER"] == "flexidepth:name=smollm2-135m-flexidepth"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_serve_skipper_none_is_the_plain_model_even_over_the_environment(monkeypatch):
    cmd, env = serve_env(monkeypatch, ["--skipper", "none"], {"VSKIPPER_SKIPPER": "random:rate=0.5,layers=1"})
    assert "VSKIPPER_SKIPPER" not in env and "--model-path" in cmd


def test_serve_explicit_skipper_or_model_path_replaces_the_default(monkeypatch, tmp_path):
    _, env = serve_env(monkeypatch, ["--skipper", "random:rate=0.5,layers=15-29,seed=0"])
    assert env["VSKIPPER_SKIPPER"] == "random:rate=0.5,layers=15-29,seed=0"
    _, env = serve_env(monkeypatch, [], {"VSKIPPER_SKIPPER": "random:rate=0.25,layers=3"})
    assert env["VSKIPPER_SKIPPER"] == "random:rate=0.25,layers=3"  # the environment's choice is kept
    from vskipper.models.smollm2 import smollm2_dir

    _, env = serve_env(monkeypatch, ["--model-path", str(smollm2_dir())])
    assert "VSKIPPER_SKIPPER" not in env  # a model path given: served as it is unless --skipper says otherwise


def test_serve_passes_sglang_flags_that_prefix_its_own_to_sglang(monkeypatch):
    """SGLang's --tp is a prefix of vskipper's --tpot-ms: it must reach SGLang, not turn elastic depth on."""
    cmd, env = serve_env(monkeypatch, ["--tp", "2", "--thr", "x"])
    assert cmd[cmd.index("--tp") + 1] == "2" and "--thr" in cmd
    assert "VSKIPPER_TPOT_MS" not in env and "VSKIPPER_THRESHOLD" not in env


def test_serve_threshold_and_autotune_settings(monkeypatch, capsys):
    from vskipper.integrations.sglang.settings import Settings

    _, env = serve_env(monkeypatch, ["--threshold", "0.65"])
    assert env["VSKIPPER_THRESHOLD"] == "0.65" and Settings.from_env(env).threshold == 0.65
    assert Settings.from_env({}).tuned_kernels and not Settings.from_env({"VSKIPPER_AUTOTUNE": "0"}).tuned_kernels
    assert not Settings.from_env({"VSKIPPER_AUTOTUNE": "0"}).config().tuned_kernels
    for env, msg in (({"VSKIPPER_THRESHOLD": "2"}, r"VSKIPPER_THRESHOLD='2' must be a number in \[0, 1\]"),
                     ({"VSKIPPER_THRESHOLD": "high"}, r"VSKIPPER_THRESHOLD='high' must be a number"),
                     ({"VSKIPPER_THRESHOLD": "0.6", "VSKIPPER_SKIPPER": "random:rate=0.5,layers=1"},
                      "applies to a FlexiDepth router's gate"),
                     ({"VSKIPPER_AUTOTUNE": "yes"}, r"VSKIPPER_AUTOTUNE='yes' is not one of 0, 1")):
        with pytest.raises(ValueError, match=msg):
            Settings.from_env(env)
    from vskipper import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--threshold", "1.5"])
    assert e.value.code == 2 and "VSKIPPER_THRESHOLD='1.5'" in capsys.readouterr().err


def test_serve_threads_reach_the_server_and_the_calibration(monkeypatch):
    """The server's CPU threads: --threads, else OMP_NUM_THREADS, else torch's default; the server gets
    them as OMP_NUM_THREADS, and the cost calibration is looked up (and measured) at that count."""
    import torch

    from vskipper import first_start

    _, env = serve_env(monkeypatch, ["--threads", "3"])
    assert env["OMP_NUM_THREADS"] == "3"
    _, env = serve_env(monkeypatch, [])
    assert env["OMP_NUM_THREADS"] == str(torch.get_num_threads())
    assert first_start.serve_threads(None) == torch.get_num_threads() and first_start.serve_threads(2) == 2
    with pytest.raises(ValueError, match="--threads 0: expected an integer >= 1"):
        first_start.serve_threads(0)


def test_serve_skipper_none_on_a_skip_aware_checkpoint_fails_naming_why(tmp_path, capsys):
    from vskipper import cli

    base = tiny_llama()
    path = save_checkpoint(tmp_path / "ckpt", base, flexidepth_for(base, [1, 3], gate="soft"))
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--model-path", str(path), "--skipper", "none"])
    assert e.value.code == 2 and "--skipper none cannot remove it" in capsys.readouterr().err


def wait_line(path, text: str, timeout: float = 30) -> None:
    """Until the log at `path` holds `text` (or `timeout` seconds have passed: the caller's asserts say why)."""
    t0 = time.time()
    while time.time() - t0 < timeout and text not in path.read_text(errors="replace"):
        time.sleep(0.5)


def fresh_cache(tmp_path):
    """A vskipper cache with the bundled model already converted (linked) and nothing measured."""
    from vskipper.models.smollm2 import smollm2_dir

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / smollm2_dir().name).symlink_to(smollm2_dir())
    return cache


def start_serve(tmp_path, name: str, args: list[str], env: dict) -> tuple[subprocess.Popen, object, int]:
    port = free_port()
    log = open(tmp_path / f"{name}.log", "w+")
    proc = subprocess.Popen(VSKIPPER + ["serve", "--port", str(port), *args], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    return proc, log, port


def stop_serve(proc: subprocess.Popen, log) -> str:
    """SIGTERM to `vskipper serve`, which passes it on to SGLang; its log once every process is gone."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("server did not shut down within 60 s of SIGTERM")
    leftover = group_members(proc.pid)
    for _ in range(60):  # SGLang's children exit after the server: wait for the group to empty
        if not leftover:
            break
        time.sleep(0.5)
        leftover = group_members(proc.pid)
    assert not leftover, f"processes left behind: {leftover}"
    log.seek(0)
    return log.read()


def test_serve_bundled_model_first_start_calibrates_then_reuses(tmp_path):
    """No arguments, an empty calibration cache (a fresh clone): `vskipper serve` measures this CPU's
    cost model before the port opens, says in one line what the server does, and the first request's
    routed layers run the routed body (auto's choice, in the stats log line); an OpenAI-client
    completion, /metrics, the README's client examples, a clean shutdown. A second start reuses the
    calibration."""
    from openai import OpenAI

    env = {**{k: v for k, v in os.environ.items() if k != "VSKIPPER_SKIPPER"},
           "VSKIPPER_CACHE": str(fresh_cache(tmp_path))}
    proc, log, port = start_serve(tmp_path, "first", ["--stats-interval", "2", "--enable-metrics"], env)
    try:
        wait_healthy(port, proc, timeout=600)
        with socket.socket() as s:  # bound to loopback only
            assert s.connect_ex(("127.0.0.1", port)) == 0
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        r = client.completions.create(model="default", prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8 and isinstance(r.choices[0].text, str)
        import requests

        metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'vskipper_routed_layer_tokens_total{layer="15",route="run"}' in metrics, metrics[-3000:]
        assert 'vskipper_routed_layer_phase_tokens_total{phase="decode",route="run"}' in metrics, metrics[-3000:]
        for block in readme_blocks(server=True):  # the README's client examples, as pasted, on this server
            out = run_block(block.replace("127.0.0.1:30000", f"127.0.0.1:{port}"), tmp_path, timeout=300)
            assert out.strip(), block
    finally:
        text = stop_serve(proc, log)
    lines = text.splitlines()
    assert "--host 127.0.0.1" in text
    assert any("no cost calibration for" in x and "measuring decode and prefill before the server starts" in x
               for x in lines), text[-3000:]
    ready = [x for x in lines if x.startswith("vskipper: serving ") and "ready in" in x]
    assert len(ready) == 1 and "with flexidepth:name=smollm2-135m-flexidepth on layers 15-29" in ready[0], text[-3000:]
    assert "calibration measured now" in ready[0] and "decode batch" in ready[0], ready[0]
    line = next((x for x in lines if "vskipper: transformed" in x), None)
    assert line is not None, text[-3000:]
    assert "transformed LlamaForCausalLM with FlexiDepth [flexidepth:name=smollm2-135m-flexidepth]" in line
    assert "cost model: calibrated for this device" in line, line
    assert sum("vskipper: transformed" in x for x in lines) == 1
    ran = re.findall(r"auto ran .*routed (\d+)", text)
    assert ran and int(ran[0]) > 0, "the routed body never ran: " + "\n".join(x for x in lines if "auto ran" in x)

    proc, log, port = start_serve(tmp_path, "second", [], env)  # the same cache: nothing measured
    try:
        wait_healthy(port, proc)
        wait_line(tmp_path / "second.log", "ready in")  # (its own /health poll may answer after ours)
    finally:
        text = stop_serve(proc, log)
    assert "no cost calibration for" not in text and "calibrate: decode pass" not in text, text[-3000:]
    assert any(x.startswith("vskipper: serving ") and "calibration reused" in x for x in text.splitlines())


def test_serve_no_calibrate_serves_dense_and_says_so(monkeypatch, tmp_path, capsys):
    """--no-calibrate with no calibration: nothing is measured, and the startup line says that the
    server computes every row (and how to make it skip fast)."""
    from vskipper import cli, first_start

    monkeypatch.setenv("VSKIPPER_CACHE", str(fresh_cache(tmp_path)))
    monkeypatch.setattr(first_start, "ensure_calibration", lambda *a, **k: pytest.fail("measured"))
    seen = {}
    monkeypatch.setattr(first_start, "run", lambda cmd, env, host, port, announce: seen.update(line=announce) or 0)
    with pytest.raises(SystemExit):
        cli.main(["serve", "--no-calibrate", "--threads", "1"])
    assert "NOT CALIBRATED" in seen["line"] and "runs dense-masked" in seen["line"], seen["line"]
    assert "vskipper calibrate --model" in seen["line"] and "--threads 1" in seen["line"]


def group_members(pgid: int) -> list[str]:
    return subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()


def test_malformed_spec_fails_before_the_server_starts():
    r = subprocess.run(VSKIPPER + ["serve", "--skipper", "random:rate=0.5,layers=1,speed=9"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert "unknown field 'speed'" in r.stderr and "sglang.launch_server" not in r.stderr  # SGLang never started


def test_checkpoint_missing_skipper_tensor_fails_at_load_naming_the_key(tmp_path):
    base = tiny_llama()
    path = save_checkpoint(tmp_path / "ckpt", base, flexidepth_for(base, [1, 3], gate="soft"))
    t = load_file(str(path / "model.safetensors"))
    del t["model.layers.3.router.router_enc.weight"]
    save_file(t, str(path / "model.safetensors"))
    cmd = VSKIPPER + ["serve", "--model-path", str(path), "--skip-tokenizer-init", "--no-calibrate", "--port",
                      str(free_port())]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, start_new_session=True)
    assert r.returncode != 0
    assert "missing skipper tensor 'model.layers.3.router.router_enc.weight'" in r.stdout + r.stderr
