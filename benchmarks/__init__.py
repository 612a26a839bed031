"""The benchmarks of vskipper, run from the repository root: `python -m benchmarks.<module>` (benchmarks/README.md)."""
