"""The main job (`make demo`): the quick serving benchmark on the bundled SmolLM2-135M.

Converts the bundled model once, measures this CPU's cost model once (`vskipper calibrate` over
the demo's batch sizes, cached), then runs the quick serving benchmark (benchmarks/serving/quick.py):
upstream SGLang, SGLang + vskipper with nothing skipped, with RandomSkip(0.5) over the second half
of the layers, and with the trained FlexiDepth skipper shipped for this model, in paired rounds on
the same requests through SGLang's own benchmark client, plus the shipped arithmetic questions
through every server. Prints the tables, one verdict line and the figure's path; writes
out/serving-quick/results.json and the page docs/results/serving-quick.md.
Options are those of `python -m benchmarks.serving.serving` (default here: --quick).
"""
from __future__ import annotations

import sys
import time

# What the demo's servers need, in what fits its 10 minutes: their decode batches stay <= 32 (the
# table goes to 64) and 3 rounds per cell instead of 6 (the full grid takes about 220 s on 2 CPUs;
# `vskipper calibrate` measures it, for the next runs too).
DEMO_CALIBRATION = ("--max-batch", "64", "--repeats", "3")


def main(argv=None) -> None:
    t0 = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:  # the options, without loading the model or measuring anything
        from benchmarks.serving import serving

        print(__doc__)
        serving.main(["--help"])
        return
    import torch

    from benchmarks.results import log
    from benchmarks.serving import serving
    from benchmarks.serving.servers import SERVER_THREADS
    from vskipper import calibrate, cost
    from vskipper.models.smollm2 import smollm2_dir

    path = str(smollm2_dir())
    hidden, inter, heads, kv = calibrate.shape_of(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # the cost model is keyed on the thread count: measure it as the servers will run
        torch.set_num_threads(SERVER_THREADS)
    if cost.load(device, hidden, inter) is None:
        log(f"demo: measuring this device's cost model once (vskipper calibrate {' '.join(DEMO_CALIBRATION)}: "
            f"the demo's batch sizes; cached for the next runs)")
        calibrate.main(["--model", path, "--device", device, *DEMO_CALIBRATION])
    serving.main((["--quick"] if not argv else []) + argv, started=t0)
    print(f"demo: {time.perf_counter() - t0:.0f} s in all", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
