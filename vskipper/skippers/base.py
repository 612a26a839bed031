"""The skipper contract: what every skipper declares, checked once at construction.

A skipper is an `nn.Module` that declares, statically:
  layers     the routed layer indices (sorted, unique, >= 0);
  gate       "soft": RUN rows add g * MLP, PROJECT rows add (1 - g) * adapter;
             "hard": no scaling;
  threshold  a token RUNs routed layer l when g > threshold;
  expected_run_fraction  the share of tokens expected to RUN a routed layer, or None if the skipper
             does not declare one: what `auto` plans with where it cannot look (CUDA-graph capture);
and per routed layer l:
  router(l)  (x [T, H] after input_layernorm, positions [T], token_ids [T]) -> g [T];
             any leading shape works as long as positions/token_ids match it. A hard-gate router
             may give its decisions instead, a bool tensor (True = RUN): g is then 1 where True and
             0 where False, the threshold does not apply, and nothing is non-finite (RandomSkip,
             Static: it saves the comparisons a float gate needs at every layer and step);
  adapter(l) a module y [T, H] -> [T, H] for PROJECT rows, or None (identity).

A sublayer skipper (SkipGPT and kin) decides attention and MLP separately. It declares
  sublayers     ("attention", "mlp") (a whole-layer skipper: (), the default);
  router_input  what its routers read: "normed", x = input_layernorm(h) (the default), or
                "residual", the layer's input h itself (SkipGPT's routers read h);
and its router(l) gives two decisions per token, [T, 2]: column 0 RUNs the attention, column 1 the
MLP (gates compared with the threshold, or bools, as above; non-finite: that sublayer RUNs). A
skipped sublayer is the identity: its residual passes through. Every token's K/V are still written
at every layer, whether it runs the attention or not: later tokens attend to it as in the base model
(SkipGPT's own code computes attention for every token and zeroes the output of those that skip;
docs/architecture.md, "Sublayer skippers"). A sublayer skipper is hard-gated and has no adapter.

Any skipper may also declare router_dtype, the dtype its modules keep inside a transformed model
(None, the default: the model's; SkipGPT: float32, as its own code runs its routers).

Non-finite router output (NaN, +-Inf) has one defined meaning everywhere: the token RUNs the
layer with g = 1 (the layer is never silently dropped for a broken gate), and it is counted
as "nonfinite" in `vskipper.stats`.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

GATES = ("soft", "hard")
SUBLAYERS = ("attention", "mlp")  # a sublayer skipper's decisions, in the columns of its router's output
ROUTER_INPUTS = ("normed", "residual")


def check_layers(name: str, layers: Iterable[int]) -> tuple[int, ...]:
    """Validate a list of layer indices: ints >= 0, no duplicates. Returns them sorted."""
    try:
        out = tuple(layers)
    except TypeError:
        raise ValueError(f"{name}: layers must be a list of layer indices, got {layers!r}") from None
    if not out:
        raise ValueError(f"{name}: layers is empty; give at least one routed layer index")
    for i in out:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"{name}: layer index {i!r} is not an integer >= 0")
    dup = sorted({i for i in out if out.count(i) > 1})
    if dup:
        raise ValueError(f"{name}: layer indices {dup} appear more than once")
    return tuple(sorted(out))


class Skipper(nn.Module):
    """Base class of skippers. Subclasses set `layers`, `gate`, `threshold` and implement
    `router(layer)` / `adapter(layer)`."""

    layers: tuple[int, ...]
    gate: str = "soft"
    threshold: float = 0.5
    expected_run_fraction: float | None = None
    sublayers: tuple[str, ...] = ()
    router_input: str = "normed"
    router_dtype: torch.dtype | None = None

    def __init__(self, layers: Iterable[int], gate: str = "soft", threshold: float = 0.5,
                 sublayers: tuple[str, ...] = (), router_input: str = "normed") -> None:
        super().__init__()
        name = type(self).__name__
        self.layers = check_layers(name, layers)
        if gate not in GATES:
            raise ValueError(f"{name}: gate={gate!r} is not one of 'soft', 'hard'")
        if not isinstance(threshold, (int, float)) or not 0.0 <= float(threshold) <= 1.0:
            raise ValueError(f"{name}: threshold={threshold!r} must be a number in [0, 1]")
        sublayers = tuple(sublayers) if isinstance(sublayers, (tuple, list)) else (sublayers,)
        if sublayers not in ((), SUBLAYERS):
            raise ValueError(f"{name}: sublayers={sublayers!r} must be () (one decision per layer) or {SUBLAYERS!r}")
        if sublayers and gate != "hard":
            raise ValueError(f"{name}: a sublayer skipper is hard-gated (a skipped sublayer is the identity), "
                             f"got gate={gate!r}")
        if router_input not in ROUTER_INPUTS:
            raise ValueError(f"{name}: router_input={router_input!r} is not one of {list(ROUTER_INPUTS)}")
        self.gate = gate
        self.threshold = float(threshold)
        self.sublayers = sublayers
        self.router_input = router_input

    # --- per-layer parts -------------------------------------------------------------------
    def router(self, layer: int) -> nn.Module:
        raise NotImplementedError

    def adapter(self, layer: int) -> nn.Module | None:
        return None

    # --- checks against a model -------------------------------------------------------------
    def check_model(self, num_layers: int, hidden_size: int) -> None:
        """Raise ValueError if this skipper cannot route a model of this shape."""
        bad = [i for i in self.layers if i >= num_layers]
        if bad:
            raise ValueError(
                f"{type(self).__name__}: routed layer indices {bad} are out of range for a model "
                f"with {num_layers} layers (valid: 0..{num_layers - 1})"
            )
        with_adapter = [i for i in self.layers if self.sublayers and self.adapter(i) is not None]
        if with_adapter:
            raise ValueError(f"{type(self).__name__}: a sublayer skipper has no adapter (a skipped sublayer is the "
                             f"identity), but adapter({with_adapter[0]}) is a module")

    def extra_repr(self) -> str:
        return f"layers={list(self.layers)}, gate={self.gate!r}, threshold={self.threshold}"


def check_rate(name: str, field: str, rate) -> float:
    """A skip rate: a number in [0, 1]."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= float(rate) <= 1.0:
        raise ValueError(f"{name}: {field}={rate!r} must be a number in [0, 1]")
    return float(rate)


def sanitize_gate(g: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """g [T] -> (g with non-finite entries set to 1, run [T] bool, nonfinite [T] bool). A bool g (a
    router's own decisions) is its run as it is, with nonfinite None (nothing to count).

    The one place where router output becomes route decisions (see the module docstring)."""
    if g.dtype == torch.bool:
        return g, g, None
    finite = torch.isfinite(g)
    g = torch.where(finite, g, 1.0)
    return g, g > threshold, ~finite


# --- the gate arithmetic: the one statement of what a routed layer computes per row ------------
# h [..., H] the layer's input; h1 = h + attention(x) for RUN rows; m = mlp(post_ln(h1)); p =
# adapter(post_ln(h)) or None (no adapter: identity); g [...] the sanitized gate. Every body, the
# reference and the training forward compute their rows with these; the Triton epilogue
# (grouped_swiglu_: residual + weight * y) is tested against them.

def run_value(h1: torch.Tensor, m: torch.Tensor, g: torch.Tensor, soft: bool) -> torch.Tensor:
    """A RUN row: h1 + g * m (soft gate) or h1 + m (hard gate)."""
    return h1 + g.unsqueeze(-1).to(h1.dtype) * m if soft else h1 + m


def project_value(h: torch.Tensor, p: torch.Tensor | None, g: torch.Tensor, soft: bool) -> torch.Tensor:
    """A PROJECT row: h + (1 - g) * p (soft gate) or h + p (hard gate); h itself without an adapter."""
    if p is None:
        return h
    return h + (1 - g.unsqueeze(-1).to(h.dtype)) * p if soft else h + p


def sublayer_value(h: torch.Tensor, f: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
    """A sublayer of a sublayer skipper, every row: h + f where it RUNs, h where it skips (the
    identity: the residual passes through). h, f [..., H]; run [...] bool."""
    return torch.where(run.unsqueeze(-1), h + f, h)


def gate_combine(h, h1, m, p, g, run, valid=None, soft: bool = True) -> torch.Tensor:
    """Every row of a routed layer: RUN rows run_value, PROJECT rows project_value, padding rows
    (valid False) h unchanged. run, valid [...] bool."""
    out = torch.where(run.unsqueeze(-1), run_value(h1, m, g, soft), project_value(h, p, g, soft))
    return out if valid is None else torch.where(valid.unsqueeze(-1), out, h)
