"""The simulated server's configuration, named and defaulted as SGLang 0.5.23's own flags.

`ServerConfig` holds what SGLang's scheduler reads when it forms batches (read in
sglang/srt/managers/scheduler.py, schedule_policy.py, schedule_batch.py and
scheduler_components/new_token_ratio_tracker.py, and the resolved values a CPU server logs:
`max_total_num_tokens=32768, chunked_prefill_size=4096, max_prefill_tokens=16384,
max_running_requests=2048`). `ServerConfig.from_flags(["--max-total-tokens", "32768", ...])` takes
them as a server's command line does; an unknown or malformed flag is a ValueError naming it.

The environment knobs SGLang reads for the new-token ratio are fields too (their env names in the
comments), so a simulated server is configured in one place.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["CLIP_MAX_NEW_TOKENS", "ServerConfig"]

CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: a request's reservation is capped here


@dataclass(frozen=True)
class ServerConfig:
    """SGLang's scheduling flags (same names, dashes for underscores, same defaults where SGLang has a
    fixed one). max_total_tokens is the KV pool in tokens (SGLang sizes it from memory when not given:
    the simulator needs it given). chunked_prefill_size None or -1: no chunking. overlap: SGLang's overlap
    scheduler (on unless --disable-overlap-schedule): the next batch is formed before the last one's
    results are processed, so a request whose last token is in flight is left out of the next decode
    batch (by length) or runs in it once more (ended by EOS); emission is set by the step model's
    `serial_host` (see vskipper/sim/engine.py)."""

    max_total_tokens: int = 32768
    max_running_requests: int = 2048
    chunked_prefill_size: int | None = 4096
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    page_size: int = 1
    overlap: bool = True
    init_new_token_ratio: float = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
    min_new_token_ratio_factor: float = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
    new_token_ratio_decay_steps: int = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
    retract_decode_steps: int = 20  # SGLANG_RETRACT_DECODE_STEPS

    def __post_init__(self):
        for name in ("max_total_tokens", "max_running_requests", "max_prefill_tokens", "new_token_ratio_decay_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ServerConfig.{name}={v!r}: expected an integer >= 1")
        c = self.chunked_prefill_size
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or (c < 1 and c != -1)):
            raise ValueError(f"ServerConfig.chunked_prefill_size={c!r}: expected an integer >= 1, or -1 / None "
                             f"(no chunking)")
        if c == -1:
            object.__setattr__(self, "chunked_prefill_size", None)
        if self.schedule_policy != "fcfs":
            raise ValueError(f"ServerConfig.schedule_policy={self.schedule_policy!r}: only 'fcfs' is simulated "
                             f"(SGLang's default)")
        if self.page_size != 1:
            raise ValueError(f"ServerConfig.page_size={self.page_size!r}: only 1 is simulated (SGLang's default)")
        if not 0 < self.schedule_conservativeness:
            raise ValueError(f"ServerConfig.schedule_conservativeness={self.schedule_conservativeness!r}: expected > 0")
        for name in ("init_new_token_ratio", "min_new_token_ratio_factor"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"ServerConfig.{name}={getattr(self, name)!r}: expected a number in (0, 1]")
        if self.retract_decode_steps < 0:
            raise ValueError(f"ServerConfig.retract_decode_steps={self.retract_decode_steps!r}: expected >= 0")

    # the new-token ratio as NewTokenRatioTracker.from_config derives it
    @property
    def ratio_init(self) -> float:
        return min(self.init_new_token_ratio * self.schedule_conservativeness, 1.0)

    @property
    def ratio_min(self) -> float:
        return min(self.ratio_init * self.min_new_token_ratio_factor, 1.0)

    @property
    def ratio_decay(self) -> float:
        return (self.ratio_init - self.ratio_min) / self.new_token_ratio_decay_steps

    @classmethod
    def from_flags(cls, flags: list[str] | str, **overrides) -> ServerConfig:
        """A config from SGLang flags (`--max-total-tokens 32768 --chunked-prefill-size 512`, a list or one
        string; `--flag=value` too); `--disable-overlap-schedule` takes no value. Other fields keep their
        defaults; overrides (field names) win."""
        import shlex

        argv = shlex.split(flags) if isinstance(flags, str) else list(flags)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        flag_names = {"--" + n.replace("_", "-"): n for n in fields if n not in ("overlap",)}
        values: dict = {}
        i = 0
        while i < len(argv):
            a = argv[i]
            if a == "--disable-overlap-schedule":
                values["overlap"] = False
                i += 1
                continue
            name, _, val = a.partition("=")
            if name not in flag_names:
                raise ValueError(f"server flag {name!r}: not one the simulator reads; known: "
                                 f"{', '.join(sorted(flag_names))}, --disable-overlap-schedule")
            if not _:
                if i + 1 >= len(argv):
                    raise ValueError(f"server flag {name}: expected a value after it")
                val = argv[i + 1]
                i += 1
            i += 1
            field = flag_names[name]
            kind = fields[field].type
            try:
                values[field] = (str(val) if field == "schedule_policy" else
                                 float(val) if "float" in str(kind) else int(val))
            except ValueError:
                raise ValueError(f"server flag {name}={val!r}: expected a number") from None
        values.update(overrides)
        return cls(**values)

    def flags(self) -> list[str]:
        """This config as SGLang flags (what a real server would be started with)."""
        out = ["--max-total-tokens", str(self.max_total_tokens), "--max-running-requests",
               str(self.max_running_requests), "--chunked-prefill-size", str(self.chunked_prefill_size or -1),
               "--max-prefill-tokens", str(self.max_prefill_tokens), "--schedule-policy", self.schedule_policy,
               "--schedule-conservativeness", str(self.schedule_conservativeness)]
        return out + ([] if self.overlap else ["--disable-overlap-schedule"])
