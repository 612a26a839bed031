"""RandomSkip and Static: skippers with no learned weights.

RandomSkip decides per (seed, layer, position, token id) with an integer hash, so a token's
route never depends on what else is in the batch. All arithmetic stays below 2**49 in int64
(16-bit halves), so CPU and GPU give the same bits with no overflow anywhere.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vskipper.skippers.base import Skipper

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without int64 overflow."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons): a well-mixed 32-bit hash, on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hash_uniform(seed: int, layer: int, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """A pure function of (seed, layer, position, token id) -> u in [0, 1), float32, shape of positions."""
    h = _mix32(torch.full_like(positions, seed & _M32, dtype=torch.int64))
    h = _mix32(h ^ (layer & _M32))
    h = _mix32(h ^ (positions.to(torch.int64) & _M32))
    h = _mix32(h ^ (token_ids.to(torch.int64) & _M32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


class RandomSkipRouter(nn.Module):
    def __init__(self, rate: float, layer: int, seed: int) -> None:
        super().__init__()
        self.rate, self.layer, self.seed = rate, layer, seed

    def forward(self, x: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        if positions is None or token_ids is None:
            raise ValueError("RandomSkip needs token ids and positions; it cannot route inputs_embeds alone")
        u = hash_uniform(self.seed, self.layer, positions, token_ids)
        return (u >= self.rate).to(x.dtype)  # [T]: 1 = RUN, 0 = skip

    def extra_repr(self) -> str:
        return f"rate={self.rate}, layer={self.layer}, seed={self.seed}"


class RandomSkip(Skipper):
    """Each token skips routed layer l with probability `rate` (hard gate, identity for skipped
    rows, K/V still written). Deterministic and batch-invariant."""

    def __init__(self, rate: float, layers: Iterable[int], seed: int = 0) -> None:
        super().__init__(layers, gate="hard", threshold=0.5)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"RandomSkip: rate={rate!r} must be a number in [0, 1]")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"RandomSkip: seed={seed!r} must be an integer >= 0")
        self.rate, self.seed = float(rate), seed
        self.routers = nn.ModuleDict({str(l): RandomSkipRouter(self.rate, l, seed) for l in self.layers})

    def router(self, layer: int) -> nn.Module:
        return self.routers[str(layer)]

    def extra_repr(self) -> str:
        return f"rate={self.rate}, layers={list(self.layers)}, seed={self.seed}"


class StaticRouter(nn.Module):
    def forward(self, x: torch.Tensor, positions=None, token_ids=None) -> torch.Tensor:
        return x.new_zeros(x.shape[:-1])  # [T]: every token skips


class Static(Skipper):
    """The static baseline: the given layers are skipped by every token (identity)."""

    def __init__(self, layers: Iterable[int]) -> None:
        super().__init__(layers, gate="hard", threshold=0.5)
        self.routers = nn.ModuleDict({str(l): StaticRouter() for l in self.layers})

    def router(self, layer: int) -> nn.Module:
        return self.routers[str(layer)]
