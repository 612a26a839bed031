"""The simulator's benchmarks: its CPU step tables, its validation against real SGLang servers, the GPU projection."""
