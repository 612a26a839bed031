"""The main job (`make demo`): the quick serving benchmark on the bundled SmolLM2-135M.

Converts the bundled model once, measures this CPU's cost model once (`vskipper calibrate` over
the demo's batch sizes, cached), then runs `vskipper bench serve --quick` (vskipper/bench/quick.py): upstream SGLang,
SGLang + vskipper with nothing skipped, with RandomSkip(0.5) over the second half of the layers,
and with the trained FlexiDepth skipper shipped for this model, in paired rounds on the same
requests through SGLang's own benchmark client, plus the shipped arithmetic questions through
every server. Prints the tables, one verdict line and the figure's path (out/bench-serve-quick/).
Options are those of `vskipper bench serve` (default here: --quick)."""
from __future__ import annotations

import sys
import time

DEMO_CALIBRATION = ("--max-batch", "64", "--repeats", "3")


def main(argv=None) -> None:
    import torch

    from vskipper import calibrate, cost
    from vskipper.bench import quick, serving
    from vskipper.models.smollm2 import smollm2_dir

    t0 = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    path = str(smollm2_dir())
    hidden, inter, heads, kv = calibrate.shape_of(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # the cost model is keyed on the thread count: measure it as the servers will run
        torch.set_num_threads(quick.Settings().server_threads)
    if cost.load(device, hidden, inter) is None:
        # What the demo's servers need, in what fits its 10 minutes: their decode batches stay <= 32
        # (the table goes to 64) and 3 rounds per cell instead of 6 (measured on the 2-CPU AMD VM,
        # 2026-12-01: the full grid took ~220 s; the decode table to 64 at 6 rounds ~65 s, the
        # prefill table ~75 s). `vskipper calibrate` measures the full grid, for the next runs too.
        print(f"[{time.strftime('%H:%M:%S')}] demo: measuring this device's cost model once (vskipper calibrate "
              f"{' '.join(DEMO_CALIBRATION)}: the demo's batch sizes; cached for the next runs)", file=sys.stderr, flush=True)
        calibrate.main(["--model", path, "--device", device, *DEMO_CALIBRATION])
    serving.main((["--quick"] if not argv else []) + argv, started=t0)
    print(f"demo: {time.perf_counter() - t0:.0f} s in all", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
