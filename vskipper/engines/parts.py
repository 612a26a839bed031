"""The contract between a routed layer's bodies and an engine: an attention part and an MLP part.

Legend: T = rows of the batch (transformers: B * S, its tensors keep [B, S, ...]), n = gathered
rows, H = hidden, I = MLP width. Every attention method writes K/V for EVERY row (a skipped token
still feeds later tokens' attention); they differ in which rows get an attention output:

    attend_all(x, ctx)              -> [..., H]  every row, as the engine computes it
    attend_rows(x, rows, ctx, impl) -> [n, H]    the flat rows `rows` only (dynamic shapes)
    attend_masked(x, run, ctx, impl, tuned)
                                    -> [T, H]    the rows with `run` set, fixed shapes, no host sync
                                                 at decode (CUDA graphs); other rows hold zeros
    resident_tokens(x, ctx)         -> int       the K/V positions the step's rows attend, summed (host)

`masks_rows` says whether the engine has a real `attend_masked`; where it does not (transformers
runs eagerly, with no graph to keep static) the fixed-shape routed body runs attention for every
row, and says so (`routed_layer.make_body`)."""
from __future__ import annotations

import torch
from torch import nn


class AttentionPart(nn.Module):
    """An engine's attention module, seen by a routed layer (see the module docstring)."""

    masks_rows = False

    def attend_all(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        raise NotImplementedError

    def attend_rows(self, x: torch.Tensor, rows: torch.Tensor, ctx: dict, impl: str = "torch") -> torch.Tensor:
        """impl: the implementation of vskipper's attention ops, where the engine attends through one."""
        raise NotImplementedError

    def attend_masked(self, x: torch.Tensor, run: torch.Tensor, ctx: dict, impl: str,
                      tuned: bool = True) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no fixed-shape masked attention (masks_rows=False)")

    def is_decode(self, x: torch.Tensor, ctx: dict) -> bool:
        raise NotImplementedError

    def resident_tokens(self, x: torch.Tensor, ctx: dict) -> int:
        """The K/V positions this step's rows attend in all (their contexts summed), read on the host
        from shapes or host-side lengths, never from the device: what a decode step's attention reads,
        and what a skipped row does not."""
        raise NotImplementedError


class MLPPart(nn.Module):
    """An engine's SwiGLU MLP, seen by a routed layer: `forward(y) -> [..., H]`, its sum complete.

    `swiglu_weights()` -> (w_gate [I, H], w_up [I, H], w_down [H, I]) for the fixed-shape body's
    grouped GEMM. Under tensor parallelism they are this rank's shards (`partial_sums` True): a
    GEMM over them gives this rank's share, which `rank_sum` completes over the ranks."""

    partial_sums = False

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.mlp(y)

    def swiglu_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def rank_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t
