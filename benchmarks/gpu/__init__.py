"""The GPU check (gpu_check.sh) and what it runs: the model under CUDA graphs, decode, kernel timings."""
