"""`vskipper serve`: its defaults (the bundled model with its shipped skipper; --skipper none), the
real server on 127.0.0.1, an OpenAI-client completion, a clean shutdown; bad input fails before the
server starts or at load, naming what is wrong."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file, save_file

from vskipper.models.hf_loader import save_checkpoint

from tiny import flexidepth_for, tiny_llama

pytestmark = pytest.mark.sglang
VSKIPPER = [sys.executable, "-m", "vskipper.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """What `vskipper serve ARGV` would exec (command line, environment), without starting it."""
    from vskipper import cli

    for k in ("VSKIPPER_SKIPPER", *(environ or {})):
        monkeypatch.delenv(k, raising=False)
    for k, v in (environ or {}).items():
        monkeypatch.setenv(k, v)
    seen = {}

    def fake_execve(path, cmd, env):
        seen.update(cmd=cmd, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", fake_execve)
    with pytest.raises(SystemExit):
        cli.main(["serve", *argv])
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
    with pytest.raises(SystemExit) as e:
        serve_env(monkeypatch, ["--threshold", "1.5"])
    assert e.value.code == 2 and "VSKIPPER_THRESHOLD='1.5'" in capsys.readouterr().err


def test_serve_skipper_none_on_a_skip_aware_checkpoint_fails_naming_why(tmp_path, capsys):
    from vskipper import cli

    base = tiny_llama()
    path = save_checkpoint(tmp_path / "ckpt", base, flexidepth_for(base, [1, 3], gate="soft"))
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--model-path", str(path), "--skipper", "none"])
    assert e.value.code == 2 and "--skipper none cannot remove it" in capsys.readouterr().err


def test_serve_bundled_model_openai_completion_and_clean_shutdown(tmp_path):
    """No arguments: the bundled model with its shipped FlexiDepth skipper, one log line naming it."""
    from openai import OpenAI

    port = free_port()
    log = open(tmp_path / "server.log", "w+")
    env = {k: v for k, v in os.environ.items() if k != "VSKIPPER_SKIPPER"}
    proc = subprocess.Popen(VSKIPPER + ["serve", "--port", str(port), "--stats-interval", "2", "--enable-metrics"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_healthy(port, proc)
        with socket.socket() as s:  # bound to loopback only
            assert s.connect_ex(("127.0.0.1", port)) == 0
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        r = client.completions.create(model="default", prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8 and isinstance(r.choices[0].text, str)
        import requests

        metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'vskipper_routed_layer_tokens_total{layer="15",route="run"}' in metrics, metrics[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("server did not shut down within 60 s of SIGTERM")
    log.seek(0)
    text = log.read()
    assert "--host 127.0.0.1" in text
    line = next((x for x in text.splitlines() if "vskipper: transformed" in x), None)
    assert line is not None, text[-3000:]
    assert "transformed LlamaForCausalLM with FlexiDepth [flexidepth:name=smollm2-135m-flexidepth]" in line
    assert f"routed layers {list(range(15, 30))}" in line and "cost model: " in line
    assert sum("vskipper: transformed" in x for x in text.splitlines()) == 1
    leftover = group_members(proc.pid)
    for _ in range(60):  # SGLang's children exit after the server: wait for the group to empty
        if not leftover:
            break
        time.sleep(0.5)
        leftover = group_members(proc.pid)
    assert not leftover, f"processes left behind: {leftover}"


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
    cmd = VSKIPPER + ["serve", "--model-path", str(path), "--skip-tokenizer-init", "--port", str(free_port())]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, start_new_session=True)
    assert r.returncode != 0
    assert "missing skipper tensor 'model.layers.3.router.router_enc.weight'" in r.stdout + r.stderr
