"""The main job (`make demo`): the quick serving benchmark on the bundled SmolLM2-135M.

Converts the bundled model once, measures this CPU's cost model once (`vskipper calibrate`,
cached), then runs upstream SGLang, SGLang + vskipper with nothing skipped, with RandomSkip(0.5)
over the second half of the layers, and with the trained FlexiDepth skipper shipped for this
model, on the same requests, and prints the table and the plot's path (out/bench-serve-quick/).
Options are those of `vskipper bench serve` (default here: --quick)."""
from __future__ import annotations

import sys


def main(argv=None) -> None:
    import torch

    from vskipper import calibrate, cost
    from vskipper.bench import serving
    from vskipper.models.smollm2 import smollm2_dir

    argv = sys.argv[1:] if argv is None else list(argv)
    path = str(smollm2_dir())
    hidden, inter, heads, kv = calibrate.shape_of(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if cost.load(device, hidden, inter) is None:
        print("demo: measuring this device's cost model once (vskipper calibrate)", file=sys.stderr, flush=True)
        calibrate.main(["--model", path, "--device", device])
    serving.main((["--quick", "--out", "out/bench-serve-quick"] if not argv else []) + argv)


if __name__ == "__main__":
    main()
