"""What arrives at the simulated server: requests with an arrival time, a prompt length and an output
length, drawn from length distributions and Poisson arrivals, or read from a trace.

    Request          one request (times in s, lengths in tokens)
    Lengths          a length distribution from a spec string: fixed:N, uniform:A-B,
                     normal:mean=M,sd=S[,min=,max=], lognormal:mean=M,sd=S[,min=,max=]
    Workload         prompt and output Lengths, how outputs end (EOS, or pinned with ignore_eos), max_new_tokens
    poisson(...)     Poisson arrivals at a rate (the first at 0, then exponential gaps, as SGLang's client)
    read_trace(path) / write_trace(path, requests): JSON lines {"arrival", "prompt", "output"[, "max_new_tokens",
                     "ignore_eos"]}
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Lengths", "Request", "Workload", "poisson", "read_trace", "write_trace"]


@dataclass(frozen=True)
class Request:
    """arrival: s from the trace's start; prompt: its tokens; output: the tokens it generates before it
    ends (EOS, or max_new_tokens if that comes first); max_new_tokens: the cap the server is told (what
    its admission reserves); ignore_eos: the output is pinned at max_new_tokens (SGLang then reserves
    the whole output, new-token ratio 1)."""

    arrival: float
    prompt: int
    output: int
    max_new_tokens: int
    ignore_eos: bool = False

    def __post_init__(self):
        if not (isinstance(self.arrival, (int, float)) and math.isfinite(self.arrival) and self.arrival >= 0):
            raise ValueError(f"Request.arrival={self.arrival!r}: expected a finite number of seconds >= 0")
        for name in ("prompt", "output", "max_new_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Request.{name}={v!r}: expected an integer >= 1")
        if self.output > self.max_new_tokens:
            raise ValueError(f"Request.output={self.output} is over max_new_tokens={self.max_new_tokens}")
        if self.ignore_eos and self.output != self.max_new_tokens:
            raise ValueError(f"Request: ignore_eos pins the output at max_new_tokens={self.max_new_tokens}, "
                             f"got output={self.output}")


class Lengths:
    """A token-length distribution, from a spec: `fixed:128`, `uniform:32-192` (integers, both ends
    included), `normal:mean=500,sd=60[,min=1,max=4096]`, `lognormal:mean=180,sd=90[,min=,max=]`
    (mean and sd of the lengths themselves); draws are rounded and clipped to [min, max] (default
    [1, inf)). `.mean` is the spec's mean before clipping."""

    KINDS = ("fixed", "uniform", "normal", "lognormal")

    def __init__(self, spec: str):
        self.spec = spec
        kind, _, rest = str(spec).partition(":")
        if kind not in self.KINDS or not rest:
            raise ValueError(f"lengths {spec!r}: expected one of fixed:N, uniform:A-B, normal:mean=M,sd=S, "
                             f"lognormal:mean=M,sd=S (optionally ,min=,max=)")
        self.kind = kind
        self.lo, self.hi = 1, math.inf
        if kind == "fixed":
            self.a = self.b = _int(spec, rest)
        elif kind == "uniform":
            a, sep, b = rest.partition("-")
            if not sep:
                raise ValueError(f"lengths {spec!r}: uniform needs A-B")
            self.a, self.b = _int(spec, a), _int(spec, b)
            if self.b < self.a:
                raise ValueError(f"lengths {spec!r}: uniform's A must be <= B")
        else:
            kv = {}
            for part in rest.split(","):
                k, sep, v = part.partition("=")
                if not sep or k not in ("mean", "sd", "min", "max"):
                    raise ValueError(f"lengths {spec!r}: {part!r} is not one of mean=, sd=, min=, max=")
                kv[k] = _num(spec, v)
            if "mean" not in kv or "sd" not in kv:
                raise ValueError(f"lengths {spec!r}: {kind} needs mean= and sd=")
            if kv["mean"] <= 0 or kv["sd"] < 0:
                raise ValueError(f"lengths {spec!r}: expected mean > 0 and sd >= 0")
            self.a, self.b = kv["mean"], kv["sd"]
            self.lo, self.hi = int(kv.get("min", 1)), kv.get("max", math.inf)
            if self.lo < 1 or self.hi < self.lo:
                raise ValueError(f"lengths {spec!r}: expected 1 <= min <= max")
            if kind == "lognormal":
                s2 = math.log(1 + (self.b / self.a) ** 2)
                self._mu, self._s = math.log(self.a) - s2 / 2, math.sqrt(s2)

    @property
    def mean(self) -> float:
        return (self.a + self.b) / 2 if self.kind in ("fixed", "uniform") else self.a

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.randint(self.a, self.b)
        x = rng.gauss(self.a, self.b) if self.kind == "normal" else rng.lognormvariate(self._mu, self._s)
        return int(min(max(round(x), self.lo), self.hi))

    def __repr__(self) -> str:
        return f"Lengths({self.spec!r})"


def _int(spec: str, s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise ValueError(f"lengths {spec!r}: {s!r} is not an integer") from None
    if v < 1:
        raise ValueError(f"lengths {spec!r}: lengths must be >= 1, got {v}")
    return v


def _num(spec: str, s: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"lengths {spec!r}: {s!r} is not a number") from None


@dataclass(frozen=True)
class Workload:
    """Prompt and output length distributions. ignore_eos=True pins every output at its drawn length
    (what SGLang's benchmark client does by default: the request's max_new_tokens is that length);
    otherwise a request ends at its drawn length (EOS) and max_new_tokens is the cap it is sent with
    (its draw is clipped to it)."""

    prompt: Lengths
    output: Lengths
    max_new_tokens: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", Lengths(self.prompt))
        if isinstance(self.output, str):
            object.__setattr__(self, "output", Lengths(self.output))
        if not self.ignore_eos and (self.max_new_tokens is None or self.max_new_tokens < 1):
            raise ValueError(f"Workload.max_new_tokens={self.max_new_tokens!r}: requests that end at EOS need the "
                             f"cap they are sent with (an integer >= 1), or ignore_eos=True")

    def request(self, arrival: float, rng: random.Random) -> Request:
        p, o = self.prompt.draw(rng), self.output.draw(rng)
        if self.ignore_eos:
            return Request(arrival, p, o, o, True)
        return Request(arrival, p, min(o, self.max_new_tokens), self.max_new_tokens, False)

    def requests(self, arrivals: list[float], seed: int) -> list[Request]:
        rng = random.Random(seed)
        return [self.request(t, rng) for t in arrivals]


def poisson(rate: float, *, n: int | None = None, duration: float | None = None, seed: int = 0) -> list[float]:
    """Arrival times at `rate` req/s: the first at 0, then exponential gaps of mean 1/rate (as SGLang's
    client draws them); n of them, or all before `duration` s."""
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate={rate!r}: expected a number of requests per second > 0")
    if (n is None) == (duration is None):
        raise ValueError("poisson: give exactly one of n= and duration=")
    if n is not None and n < 1:
        raise ValueError(f"poisson: n={n} must be >= 1")
    if duration is not None and not duration > 0:
        raise ValueError(f"poisson: duration={duration} must be > 0")
    rng = random.Random(seed)
    out, t = [0.0], 0.0
    while True:
        t += rng.expovariate(rate)
        if (n is not None and len(out) >= n) or (duration is not None and t >= duration):
            return out
        out.append(t)


def read_trace(path: str | Path) -> list[Request]:
    """Requests from a JSON-lines trace; each line {"arrival": s, "prompt": tokens, "output": tokens,
    optional "max_new_tokens" (default: output) and "ignore_eos" (default: true when max_new_tokens is
    absent)}. Sorted by arrival. A bad line is a ValueError naming the line and the field."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
        missing = [k for k in ("arrival", "prompt", "output") if k not in d]
        if missing:
            raise ValueError(f"{path}:{i}: missing {', '.join(missing)}")
        try:
            out.append(Request(float(d["arrival"]), d["prompt"], d["output"], d.get("max_new_tokens", d["output"]),
                               bool(d.get("ignore_eos", "max_new_tokens" not in d))))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}:{i}: {e}") from None
    if not out:
        raise ValueError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.arrival)


def write_trace(path: str | Path, requests: list[Request]) -> None:
    Path(path).write_text("".join(json.dumps({"arrival": r.arrival, "prompt": r.prompt, "output": r.output,
                                              "max_new_tokens": r.max_new_tokens, "ignore_eos": r.ignore_eos}) + "\n"
                                  for r in requests))
