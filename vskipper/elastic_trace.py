"""Elastic depth's trace: every event a scheduler hands its controller (vskipper/elastic.py), one JSON line
each, so another rule can be replayed over the steps a server really ran (benchmarks/serving/elastic_replay.py).

On when VSKIPPER_ELASTIC_TRACE names a directory: each scheduler process appends to
<directory>/tp<rank>-<pid>.jsonl. The first line is the header (the target, the ladder's budgets, the step
model's calibration and shape); each next line is [event, args, kwargs, level after it], event one of
EVENTS. A decode step is one short line: cheap beside the step itself; a debugging and tuning aid."""
from __future__ import annotations

import json
from pathlib import Path

from vskipper import elastic
from vskipper.elastic import Controller, StepModel, Target

EVENTS = ("decode_step", "prefill", "first_token", "idle", "tick", "follow")


def header(controller: Controller, now: float) -> dict:
    m = controller.model
    t = controller.target
    return {"target": [t.tpot_ms, t.ttft_ms, t.period_s], "budgets": list(controller.budgets), "now": now,
            "model": None if m is None else {"calibration": m.cal.to_json(), "bodies": list(m.bodies),
                                             "n_layers": m.n_layers, "n_routed": m.n_routed, "run_fraction": m.f}}


def _plain(x):
    return x.item() if hasattr(x, "item") else str(x)


class Recorder:
    """Stands in for a Controller: each event of EVENTS is handed on, then written with the level after it;
    everything else is the controller's own."""

    def __init__(self, controller: Controller, path: Path, now: float) -> None:
        self._controller = controller
        path.parent.mkdir(parents=True, exist_ok=True)
        self._out = path.open("a", buffering=1)
        self._write(header(controller, now))

    def _write(self, row) -> None:
        self._out.write(json.dumps(row, separators=(",", ":"), default=_plain) + "\n")

    def __getattr__(self, name):
        attr = getattr(self._controller, name)
        if name not in EVENTS:
            return attr

        def recorded(*args, **kwargs):
            out = attr(*args, **kwargs)
            self._write([name, list(args), kwargs, self._controller.level])
            return out

        return recorded


def read(path) -> list[tuple[dict, list]]:
    """Each controller's life in a trace file as (header, events): a process that made its controller
    again (the model reloaded) appended a second header and its events to the same file."""
    lives: list[tuple[dict, list]] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            row = json.loads(line)
            if isinstance(row, dict):
                lives.append((row, []))
            elif not lives or not (isinstance(row, list) and len(row) == 4 and row[0] in EVENTS):
                raise ValueError(f"{path}:{n}: not an elastic-depth trace line (a header, then "
                                 f"[event, args, kwargs, level] with event one of {', '.join(EVENTS)})")
            else:
                lives[-1][1].append(row)
    if not lives:
        raise ValueError(f"{path}: empty; a trace starts with its header")
    return lives


def controller(head: dict) -> Controller:
    """A fresh Controller like the traced one (the rule as vskipper.elastic's constants now stand)."""
    from vskipper.cost import Calibration

    m = head["model"]
    model = None if m is None else StepModel(Calibration.from_json(m["calibration"]), tuple(m["bodies"]),
                                             m["n_layers"], m["n_routed"], m["run_fraction"])
    return Controller(Target(*head["target"]), tuple(head["budgets"]), model, head["now"])


def replay(head: dict, events: list, **constants) -> list[tuple[float, int, int, int, str]]:
    """Every tick of `events` replayed through a fresh controller under vskipper.elastic's constants
    changed by `constants` (e.g. DEBT=4; restored after): (time, rows running and queued, the level the
    server had after it, the replayed level, the replayed reason). The events are the server's: its
    steps ran at its levels, so once the replayed level differs the replay says what the rule would have
    decided from those steps, not what would then have run."""
    unknown = [k for k in constants if not (k.isupper() and isinstance(getattr(elastic, k, None), (int, float)))]
    if unknown:
        raise ValueError(f"not a constant of vskipper.elastic: {', '.join(unknown)}")
    saved = {k: getattr(elastic, k) for k in constants}
    try:
        for k, v in constants.items():
            if isinstance(saved[k], int) and v != int(v):
                raise ValueError(f"{k}={v:g}: a count of steps, give a whole number")
            setattr(elastic, k, type(saved[k])(v))
        c, out = controller(head), []
        for name, args, kwargs, level in events:
            getattr(c, name)(*args, **kwargs)
            if name == "tick":
                out.append((args[0], len(args[1]) + args[2], level, c.level, c.reason))
        return out
    finally:
        for k, v in saved.items():
            setattr(elastic, k, v)
