"""FlexiDepth: a learned router per routed layer and a small SwiGLU-like adapter for PROJECT rows.

Semantics (docs/architecture.md), routed layer l, x = input_layernorm(h):
    g = sigmoid(router_head(router_dec(tanh(router_norm(router_enc(x))))))   # [T]
    adapter(y) = up_proj(silu(gate_proj(y)) * down_proj(y))
Checkpoint keys (the FlexiDepth layout, safetensors only):
    model.layers.{l}.router.router_enc.weight   [H/r, H]     r = router_reduction_factor
    model.layers.{l}.router.router_norm.weight  [H/r]
    model.layers.{l}.router.router_dec.weight   [H, H/r]
    model.layers.{l}.router.router_head.weight  [1, H]
    model.layers.{l}.router_proj.gate_proj.weight [I/p, H]   p = proj_reduction_factor
    model.layers.{l}.router_proj.down_proj.weight [I/p, H]
    model.layers.{l}.router_proj.up_proj.weight   [H, I/p]
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from vskipper.skippers.base import Skipper

ROUTER_KEYS = ("router_enc", "router_norm", "router_dec", "router_head")
ADAPTER_KEYS = ("gate_proj", "down_proj", "up_proj")


class RouterRMSNorm(nn.Module):
    """RMSNorm in fp32, weight applied after casting back (FlexiDepth's reference order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class FlexiDepthRouter(nn.Module):
    def __init__(self, hidden: int, reduced: int, eps: float) -> None:
        super().__init__()
        self.router_enc = nn.Linear(hidden, reduced, bias=False)
        self.router_norm = RouterRMSNorm(reduced, eps)
        self.router_dec = nn.Linear(reduced, hidden, bias=False)
        self.router_head = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor, positions=None, token_ids=None) -> torch.Tensor:
        z = torch.tanh(self.router_norm(self.router_enc(x)))  # [T, H/r]
        return torch.sigmoid(self.router_head(self.router_dec(z))).squeeze(-1)  # [T]


class FlexiDepthAdapter(nn.Module):
    def __init__(self, hidden: int, reduced: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, reduced, bias=False)
        self.down_proj = nn.Linear(hidden, reduced, bias=False)
        self.up_proj = nn.Linear(reduced, hidden, bias=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.up_proj(F.silu(self.gate_proj(y)) * self.down_proj(y))

    def swiglu_weights(self):
        """As a SwiGLU (w_gate, w_up, w_down): FlexiDepth's down_proj plays the "up" role."""
        return self.gate_proj.weight, self.down_proj.weight, self.up_proj.weight


class FlexiDepth(Skipper):
    """FlexiDepth routers and adapters for the given routed layers.

    gate="soft" (FlexiDepth-Llama): RUN rows add g * MLP, PROJECT rows add (1 - g) * adapter.
    gate="hard" (the Qwen3 skippers): no scaling. Threshold 0.5, as in the paper's code.
    Weights start random; load trained ones with `FlexiDepth.from_pretrained(dir)` or
    `load_flexidepth_state_dict`.
    """

    def __init__(
        self,
        layers: Iterable[int],
        hidden_size: int,
        intermediate_size: int,
        rms_norm_eps: float = 1e-5,
        gate: str = "soft",
        router_reduction_factor: int = 16,
        proj_reduction_factor: int = 16,
        threshold: float = 0.5,
        expected_run_fraction: float | None = None,
    ) -> None:
        super().__init__(layers, gate=gate, threshold=threshold)
        if expected_run_fraction is not None and (isinstance(expected_run_fraction, bool) or not isinstance(
                expected_run_fraction, (int, float)) or not 0.0 <= expected_run_fraction <= 1.0):
            raise ValueError(f"FlexiDepth: expected_run_fraction={expected_run_fraction!r} must be a number in [0, 1] "
                             f"or None")
        self.expected_run_fraction = None if expected_run_fraction is None else float(expected_run_fraction)
        for name, v in (
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
            ("router_reduction_factor", router_reduction_factor),
            ("proj_reduction_factor", proj_reduction_factor),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"FlexiDepth: {name}={v!r} must be a positive integer")
        r_dim, p_dim = hidden_size // router_reduction_factor, intermediate_size // proj_reduction_factor
        if r_dim == 0 or p_dim == 0:
            raise ValueError(
                f"FlexiDepth: reduction factors ({router_reduction_factor}, {proj_reduction_factor}) are "
                f"larger than hidden_size={hidden_size} / intermediate_size={intermediate_size}"
            )
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.router_dim, self.proj_dim = r_dim, p_dim
        self.routers = nn.ModuleDict({str(l): FlexiDepthRouter(hidden_size, r_dim, rms_norm_eps) for l in self.layers})
        self.adapters = nn.ModuleDict({str(l): FlexiDepthAdapter(hidden_size, p_dim) for l in self.layers})

    def router(self, layer: int) -> nn.Module:
        return self.routers[str(layer)]

    def adapter(self, layer: int) -> nn.Module | None:
        return self.adapters[str(layer)]

    def check_model(self, num_layers: int, hidden_size: int) -> None:
        super().check_model(num_layers, hidden_size)
        if hidden_size != self.hidden_size:
            raise ValueError(
                f"FlexiDepth: built for hidden_size={self.hidden_size}, but the model has hidden_size={hidden_size}"
            )

    # --- the FlexiDepth key layout ----------------------------------------------------------
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint key this skipper reads, with its shape."""
        H, r, p = self.hidden_size, self.router_dim, self.proj_dim
        shapes = {}
        for l in self.layers:
            pre = f"model.layers.{l}."
            shapes[pre + "router.router_enc.weight"] = (r, H)
            shapes[pre + "router.router_norm.weight"] = (r,)
            shapes[pre + "router.router_dec.weight"] = (H, r)
            shapes[pre + "router.router_head.weight"] = (1, H)
            shapes[pre + "router_proj.gate_proj.weight"] = (p, H)
            shapes[pre + "router_proj.down_proj.weight"] = (p, H)
            shapes[pre + "router_proj.up_proj.weight"] = (H, p)
        return shapes

    def _param(self, key: str) -> torch.nn.Parameter:
        # "model.layers.{l}.router.router_enc.weight" -> routers[l].router_enc.weight
        parts = key.split(".")
        layer, group, rest = parts[2], parts[3], parts[4:]
        mod = self.routers[layer] if group == "router" else self.adapters[layer]
        for p in rest[:-1]:
            mod = getattr(mod, p)
        return getattr(mod, rest[-1])

    def flexidepth_state_dict(self) -> dict[str, torch.Tensor]:
        """The skipper's weights under FlexiDepth checkpoint keys."""
        return {k: self._param(k).detach() for k in self.expected_shapes()}

    def load_flexidepth_state_dict(self, tensors: Mapping[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Copy weights from FlexiDepth-layout tensors; a missing key or a wrong shape or dtype
        raises ValueError naming the key."""
        for key, shape in self.expected_shapes().items():
            if key not in tensors:
                raise ValueError(f"{source}: missing skipper tensor {key!r} (expected shape {list(shape)})")
            t = tensors[key]
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{source}: tensor {key!r} has shape {list(t.shape)}, expected {list(shape)}"
                )
            if not t.is_floating_point():
                raise ValueError(f"{source}: tensor {key!r} has dtype {t.dtype}, expected a floating-point dtype")
        with torch.no_grad():
            for key in self.expected_shapes():
                p = self._param(key)
                p.copy_(tensors[key].to(p.dtype))

    @classmethod
    def from_fields(cls, f: Mapping, gate: str | None = None, threshold: float | None = None) -> "FlexiDepth":
        """A FlexiDepth (weights not loaded yet) from the validated skipper fields of a skip-aware
        config.json (`vskipper.models.checkpoint.skipper_fields`): what every loader builds before it
        reads the tensors. `gate` overrides the checkpoint's gate_mode; `threshold` the checkpoint's
        router_threshold, else FlexiDepth's 0.5 (a token RUNs a layer when g > threshold: a higher one
        skips more, a lower one runs more)."""
        if threshold is None:
            threshold = 0.5 if f.get("threshold") is None else f["threshold"]
        return cls(f["routing_layers"], hidden_size=f["hidden_size"], intermediate_size=f["intermediate_size"],
                   rms_norm_eps=f["rms_norm_eps"], gate=gate or f["gate_mode"], threshold=threshold,
                   router_reduction_factor=f["router_reduction_factor"],
                   proj_reduction_factor=f["proj_reduction_factor"], expected_run_fraction=f["expected_run_fraction"])

    @classmethod
    def from_pretrained(cls, path, gate: str | None = None, dtype: torch.dtype = torch.float32,
                        threshold: float | None = None) -> "FlexiDepth":
        """Read a FlexiDepth skipper from a checkpoint directory (config.json + *.safetensors).

        Only safetensors are read: pickled weights are refused, remote code is never run."""
        from vskipper.models.checkpoint import load_tensors, read_config, skipper_fields

        skipper = cls.from_fields(skipper_fields(read_config(path), path), gate=gate, threshold=threshold)
        tensors = load_tensors(path, keys=skipper.expected_shapes())
        skipper.load_flexidepth_state_dict(tensors, source=str(path))
        return skipper.to(dtype)
