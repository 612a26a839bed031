"""One SGLang ModelRunner in this process, loaded as `sglang.benchmark.one_batch` loads it (SGLang's
scheduler bypassed): for measuring SGLang's own decode and extend steps side by side
(engine_step.py) and for tests that build a batch by hand (a padded decode batch, as the CUDA-graph
runner pads). On a machine without a GPU it uses the vskipper_cpu platform."""
from __future__ import annotations

import os


def with_model_runner(model_path: str, work, max_total_tokens: int = 4096, tokenizer_path: str | None = None) -> None:
    """Load `model_path` into a ModelRunner (the vskipper plugin's load hook runs as in a server),
    then call work(runner), where runner is one_batch's wrapper (.extend(reqs), .decode(ids, batch),
    .clear(); the ModelRunner is runner.torch_runner). one_batch loads a tokenizer: give
    `tokenizer_path` for a model directory without one."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_PLATFORM", "vskipper_cpu")
    cpu = os.environ.get("SGLANG_PLATFORM") == "vskipper_cpu"
    from sglang.srt.plugins import load_plugins

    load_plugins()  # vskipper's architectures and load hook, as every SGLang process loads them
    from sglang.benchmark import one_batch
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=model_path, tokenizer_path=tokenizer_path or model_path, log_level="error",
                             max_total_tokens=max_total_tokens,
                             **(dict(device="cpu", dtype="float32", attention_backend="torch_native",
                                     disable_cuda_graph=True) if cpu else {}))
    bench_args = one_batch.BenchArgs(batch_size=(1,), input_len=(8,), output_len=(8,))

    def latency_test(server_args, port_args, bench_args, gpu_id, tp_rank):  # one_batch's set-up, then `work`
        one_batch.publish(server_args, role="scheduler",
                          ranks=one_batch.SpawnRanks(world_rank=one_batch.spawn_world_rank(server_args, tp_rank=tp_rank,
                                                                                          pp_rank=0), gpu_id=gpu_id))
        one_batch._init_process_global_configs()
        one_batch.configure_logger(server_args, prefix=f" TP{tp_rank}")
        runner, _ = one_batch.load_model(server_args, port_args, gpu_id, tp_rank)
        work(runner)

    saved = one_batch.latency_test
    one_batch.latency_test = latency_test  # one_batch.main resolves the server args, then calls it
    try:
        one_batch.main(server_args, bench_args)
    finally:
        one_batch.latency_test = saved


def use(model, layers, state) -> None:
    """Put one system's decoder layers (and its vskipper state, or none: upstream) in `model`, for
    benchmarks that compare systems over one loaded SGLang model."""
    for i, layer in enumerate(layers):
        model.model.layers[i] = layer
    if hasattr(model, "vskipper"):
        del model.vskipper
    if state is not None:
        model.vskipper = state

