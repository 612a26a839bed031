"""vskipper under SGLang's parallel modes, on CPU: tensor parallelism (TP=2, gloo) and data
parallelism (DP=2) serve the eager reference's greedy tokens, every rank routing alike."""
from __future__ import annotations

import os

import pytest

from vskipper.models.hf_loader import save_checkpoint

from sglang_util import calibrated_cache, check_against_reference, engine
from tiny import flexidepth_for, tiny_llama, tiny_qwen3

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
TWO_RANKS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1" if (os.cpu_count() or 1) >= 2 else "0|0"}


def checkpoint(tmp_path, family):
    base = tiny_llama() if family == "llama" else tiny_qwen3(heads=4, kv_heads=2)  # heads that shard over 2 ranks
    sk = flexidepth_for(base, [1, 3, 4, 5], gate="soft" if family == "llama" else "hard")
    return save_checkpoint(tmp_path / "ckpt", base, sk), base, sk


def digests(directory) -> dict[str, list[str]]:
    return {p.name.split("-")[0]: p.read_text().splitlines() for p in sorted(directory.glob("tp*.txt"))}


@pytest.mark.parametrize("family, execution", [("llama", "routed"), ("qwen3", "routed"), ("llama", "dense")])
def test_tensor_parallel_2_serves_the_reference_and_ranks_route_alike(tmp_path, family, execution):
    path, base, sk = checkpoint(tmp_path, family)
    with engine(path, engine_args={"tp_size": 2}, VSKIPPER_EXECUTION=execution,
                VSKIPPER_ROUTE_DIGEST=str(tmp_path / "routes"), **TWO_RANKS) as eng:
        check_against_reference(eng, base, sk)
    d = digests(tmp_path / "routes")
    assert set(d) == {"tp0", "tp1"}, d.keys()
    assert d["tp0"] and d["tp0"] == d["tp1"], "ranks made different route decisions"


def test_tensor_parallel_2_fixed_shape_body(tmp_path):
    path, base, sk = checkpoint(tmp_path, "llama")
    with engine(path, engine_args={"tp_size": 2}, VSKIPPER_EXECUTION="routed", VSKIPPER_STATIC_SHAPES="1",
                **TWO_RANKS) as eng:
        check_against_reference(eng, base, sk)


def test_data_parallel_2_serves_the_reference(tmp_path):
    path, base, sk = checkpoint(tmp_path, "llama")
    with engine(path, engine_args={"dp_size": 2}, VSKIPPER_EXECUTION="routed",
                VSKIPPER_ROUTE_DIGEST=str(tmp_path / "routes"), **TWO_RANKS) as eng:
        check_against_reference(eng, base, sk)
    replicas = list((tmp_path / "routes").glob("tp0-*.txt"))
    assert len(replicas) == 2, replicas  # each replica loaded the plugin, transformed its copy and routed


def test_stock_model_through_the_hook_with_auto_under_tensor_parallel_2(tmp_path):
    import vskipper

    base = tiny_llama()
    base.save_pretrained(tmp_path / "stock", safe_serialization=True)
    spec = "random:rate=0.5,layers=1-5,seed=3"
    with engine(tmp_path / "stock", engine_args={"tp_size": 2}, VSKIPPER_SKIPPER=spec, VSKIPPER_EXECUTION="auto",
                **calibrated_cache(tmp_path, base), **TWO_RANKS) as eng:
        check_against_reference(eng, base, vskipper.parse_skipper(spec))


def test_pipeline_parallel_is_refused_naming_the_flag(monkeypatch):
    from types import SimpleNamespace

    import sglang.srt.runtime_context as rc

    from vskipper.models import sglang as fam

    monkeypatch.setattr(rc, "get_parallel", lambda: SimpleNamespace(tp_size=1, pp_group=SimpleNamespace(world_size=2)))
    with pytest.raises(NotImplementedError, match=r"pipeline parallelism \(--pp-size 2\) is not supported"):
        fam.make_stacks(SimpleNamespace(model=SimpleNamespace(layers=[])), [0])


def test_tensor_parallel_2_elastic_depth_every_rank_applies_the_same_level(tmp_path, capfd):
    """Elastic depth under a target no step meets: rank 0 raises the level under a queue, stamps the
    requests it receives and hands the level on; rank 1 gets both through SGLang's broadcast, stamps the
    waiting queue alike and routes alike (equal digests); a request admitted at the top level, and the
    queue's last one (it arrived at level 0), get the skipper alone."""
    import asyncio

    import torch

    from vskipper.reference import reference_generate

    from tiny import VOCAB

    path, base, sk = checkpoint(tmp_path, "llama")
    g = torch.Generator().manual_seed(3)
    wave = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in [3, 7, 5, 9] * 5]
    probe = torch.randint(1, VOCAB, (6,), generator=g)
    sp = lambda n: {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}  # noqa: E731
    with engine(path, log_level="info", engine_args={"tp_size": 2, "max_running_requests": 4},
                VSKIPPER_EXECUTION="routed", VSKIPPER_TPOT_MS="0.001", VSKIPPER_CONTROL_PERIOD_MS="1",
                VSKIPPER_ROUTE_DIGEST=str(tmp_path / "routes"), **calibrated_cache(tmp_path, base), **TWO_RANKS) as eng:
        capfd.readouterr()

        async def under_load():
            load = asyncio.ensure_future(eng.async_generate(input_ids=wave, sampling_params=sp(24)))
            log = ""
            for _ in range(900):  # until the level has risen (at most 45 s)
                await asyncio.sleep(0.05)
                log += capfd.readouterr().err
                if "elastic depth level 0 -> 4" in log:
                    break
            out = (await eng.async_generate(input_ids=probe.tolist(), sampling_params=sp(8)))["output_ids"]
            return log, out, await load

        log, out, waited = eng.loop.run_until_complete(under_load())
    assert "elastic depth level 0 -> 4" in log, log[-3000:]
    assert out == reference_generate(base, sk, probe, 8)[0][len(probe):].tolist(), "top level: the skipper alone"
    last = torch.tensor(wave[-1])
    alone, full = (reference_generate(base, sk, last, 24, budget=b)[0][len(last):].tolist() for b in (None, 0))
    assert waited[-1]["output_ids"] == alone != full, "queued at level 0, admitted at the top: the skipper alone"
    d = digests(tmp_path / "routes")
    assert set(d) == {"tp0", "tp1"} and d["tp0"] and d["tp0"] == d["tp1"], "ranks applied different levels"


def test_data_parallel_2_elastic_depth_each_replica_decides_for_itself(tmp_path, capfd):
    """Elastic depth under DP=2 and a target no step meets: each replica's scheduler runs a controller
    of its own (two `elastic depth on` lines), a queue on them raises the level, and every request
    is answered in full."""
    import torch

    from tiny import VOCAB

    path, base, sk = checkpoint(tmp_path, "llama")
    g = torch.Generator().manual_seed(4)
    wave = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in [3, 7, 5, 9] * 4]
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}  # > 32 steps: a stream's length
    with engine(path, log_level="info", engine_args={"dp_size": 2, "max_running_requests": 4},
                VSKIPPER_EXECUTION="routed", VSKIPPER_TPOT_MS="0.001", VSKIPPER_CONTROL_PERIOD_MS="1",
                **calibrated_cache(tmp_path, base), **TWO_RANKS) as eng:
        out = eng.generate(input_ids=wave, sampling_params=sp)
        log = capfd.readouterr().err
    assert [len(o["output_ids"]) for o in out] == [40] * len(wave)
    on = [x for x in log.splitlines() if "elastic depth on: target TPOT 0.001 ms" in x]
    assert len(on) == 2, "\n".join(on) or log[-3000:]
    assert "elastic depth level 0 -> " in log, log[-3000:]
