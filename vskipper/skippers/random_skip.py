"""RandomSkip, RandomSublayerSkip and Static: skippers with no learned weights.

RandomSkip decides per (seed, layer, position, token id) with an integer hash, so a token's
route never depends on what else is in the batch. The hash is one round of lowbias32 over
(A * position + B * token id + the layer's key) mod 2**32: few ops per layer and step (every op is
paid at every routed layer), its well-mixed high bits deciding. All arithmetic stays below 2**63
in int64 for positions and token ids below 2**32 in magnitude (see _mix32), so CPU and GPU give the
same bits with no overflow anywhere.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from vskipper.skippers.base import SUBLAYERS, Skipper, check_rate

_M32 = 0xFFFFFFFF


def _mul32_int(x: int, c: int) -> int:
    return (x * c) & _M32


def _mix32_int(x: int) -> int:
    """lowbias32 on a Python int (for the constant part of the hash)."""
    x ^= x >> 16
    x = _mul32_int(x, 0x7FEB352D)
    x ^= x >> 15
    x = _mul32_int(x, 0x846CA68B)
    return x ^ (x >> 16)


# (x * c) mod 2**32 for x in [0, 2**32) in int64 without overflow: for c >= 2**31 multiply by
# c - 2**32 instead (same residue, |product| < 2**63); the mask takes the residue of either sign.
_C1, _C2 = 0x7FEB352D, 0x846CA68B - (1 << 32)
# Odd multipliers below 2**30, so |A * p + B * t + key| < 2**63 for |p|, |t| < 2**32.
_A, _B = 0x1E3779B1, 0x2C1B3C6D


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons): a well-mixed 32-bit hash, on an int64 tensor of 32-bit values, which it
    overwrites (in place: the ops are the cost, not the tiny tensors)."""
    x ^= x >> 16
    x.mul_(_C1).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(_C2).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def _layer_key(seed: int, layer: int) -> int:
    return _mix32_int(_mix32_int(seed & _M32) ^ (layer & _M32))


def _long(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 else t.to(torch.int64)


def _hash32(key: int, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    x = torch.add(_long(positions) * _A, _long(token_ids), alpha=_B)  # a fresh tensor, mixed in place
    return _mix32(x.add_(key).bitwise_and_(_M32))


def hash_uniform(seed: int, layer: int, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """A pure function of (seed, layer, position, token id) -> u in [0, 1), float32, shape of positions."""
    return (_hash32(_layer_key(seed, layer), positions, token_ids) >> 8).to(torch.float32) * (1.0 / (1 << 24))


class RandomSkipRouter(nn.Module):
    def __init__(self, rate: float, layer: int, seed: int, key: int | None = None) -> None:
        super().__init__()
        self.rate, self.layer, self.seed = rate, layer, seed
        self._key = _layer_key(seed, layer) if key is None else key  # key: a second hash of the same layer
        # u >= rate with u = (h >> 8) / 2**24 in float32 and rate rounded to float32 (how torch
        # compares a float32 tensor with a Python float) <=> h >= ceil(f32(rate) * 2**24) * 2**8:
        # the same decisions as hash_uniform with two fewer ops per layer.
        self._cut = math.ceil(float(torch.tensor(rate, dtype=torch.float32)) * (1 << 24)) << 8

    def forward(self, x: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        if positions is None or token_ids is None:
            raise ValueError("RandomSkip needs token ids and positions; it cannot route inputs_embeds alone")
        return _hash32(self._key, positions, token_ids) >= self._cut  # [T] decisions: True = RUN

    @property
    def hash_params(self) -> tuple[int, ...]:
        """(key, cut, A, B, C1, C2, 2**32 - 1): this router's decisions as constants, for ops.route to make
        them in the launch that maps them (the same bits: tested against forward)."""
        return (self._key, self._cut, _A, _B, _C1, _C2, _M32)

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
        self.expected_run_fraction = 1.0 - self.rate
        self.routers = nn.ModuleDict({str(l): RandomSkipRouter(self.rate, l, seed) for l in self.layers})

    def router(self, layer: int) -> nn.Module:
        return self.routers[str(layer)]

    def extra_repr(self) -> str:
        return f"rate={self.rate}, layers={list(self.layers)}, seed={self.seed}"


_MLP_SALT = 0x5BD1E995  # any odd 32-bit constant: it only has to make the MLP's key differ from the attention's


class RandomSublayerRouter(nn.Module):
    """RandomSkip's hash, twice: the attention decision with the layer's key (RandomSkip's own), the
    MLP decision with a second key mixed from it, so the two are independent."""

    def __init__(self, attn_rate: float, mlp_rate: float, layer: int, seed: int) -> None:
        super().__init__()
        self.attention = RandomSkipRouter(attn_rate, layer, seed)
        self.mlp = RandomSkipRouter(mlp_rate, layer, seed, key=_mix32_int(_layer_key(seed, layer) ^ _MLP_SALT))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.attention(x, positions, token_ids), self.mlp(x, positions, token_ids)], -1)  # [T, 2]


class RandomSublayerSkip(Skipper):
    """Each token skips the attention of routed layer l with probability `attn_rate` and, apart from
    that, its MLP with probability `mlp_rate` (a sublayer skipper: skipped sublayers are the identity,
    K/V still written). Deterministic and batch-invariant, like RandomSkip: the synthetic sublayer
    skipper for tests and benchmarks."""

    def __init__(self, attn_rate: float, mlp_rate: float, layers: Iterable[int], seed: int = 0) -> None:
        super().__init__(layers, gate="hard", threshold=0.5, sublayers=SUBLAYERS)
        name = type(self).__name__
        self.attn_rate, self.mlp_rate = check_rate(name, "attn_rate", attn_rate), check_rate(name, "mlp_rate", mlp_rate)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{name}: seed={seed!r} must be an integer >= 0")
        self.seed = seed
        self.routers = nn.ModuleDict({str(l): RandomSublayerRouter(self.attn_rate, self.mlp_rate, l, seed)
                                      for l in self.layers})

    def router(self, layer: int) -> nn.Module:
        return self.routers[str(layer)]

    def extra_repr(self) -> str:
        return f"attn_rate={self.attn_rate}, mlp_rate={self.mlp_rate}, layers={list(self.layers)}, seed={self.seed}"


class StaticRouter(nn.Module):
    def forward(self, x: torch.Tensor, positions=None, token_ids=None) -> torch.Tensor:
        return x.new_zeros(x.shape[:-1], dtype=torch.bool)  # [T] decisions: every token skips


class Static(Skipper):
    """The static baseline: the given layers are skipped by every token (identity)."""

    def __init__(self, layers: Iterable[int]) -> None:
        super().__init__(layers, gate="hard", threshold=0.5)
        self.expected_run_fraction = 0.0
        self.routers = nn.ModuleDict({str(l): StaticRouter() for l in self.layers})

    def router(self, layer: int) -> nn.Module:
        return self.routers[str(layer)]
