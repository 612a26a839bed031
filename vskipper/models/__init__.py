"""Model families: where a model's decoder layers are and how to call their parts.

A family is data plus a few small functions; `family_for(model)` finds the one that matches a
model instance, or raises TypeError naming every supported class. (Not to be confused with a
skipper's adapter, FlexiDepth's small MLP for PROJECT rows.)
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from importlib import import_module

from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    """A family of models vskipper can transform.

    module/cls: where the model class lives (imported lazily: nothing here needs SGLang).
    make_stacks(model, routed) -> the modules the fx passes trace and rewrite, each with `layers`
        (decoder layers, fx leaves, as a ModuleList or a ModuleDict keyed by index) and `indices`
        (the layer indices it calls): one stack of every layer (transformers), or one stack per
        routed layer (SGLang: only routed layers change).
    install(model, [(stack, graph module)]) -> put the transformed stacks in the model's path.
    make_attention(layer) -> the attention part of a routed layer (all_rows / some_rows / masked_rows).
    mlp_weights(mlp) -> (w_gate, w_up, w_down) of a routed layer's SwiGLU MLP (fixed-shape body).
    make_mlp(layer) -> the MLP part of a routed layer (default: the layer's own `mlp`); one with a
        `rank_sum` attribute leaves its output's sum over tensor-parallel ranks to be completed.
    """

    name: str
    module: str
    cls: str
    make_stacks: object
    install: object
    make_attention: object
    mlp_weights: object = None
    make_mlp: object = None
    input_norm: str = "input_layernorm"
    post_norm: str = "post_attention_layernorm"
    mlp: str = "mlp"

    def model_class(self):
        return getattr(import_module(self.module), self.cls)

    def matches(self, model: nn.Module) -> bool:
        engine = self.module.split(".")[0] + "."
        if not any(c.__module__.startswith(engine) for c in type(model).__mro__):
            return False  # never import an engine the model does not come from
        return isinstance(model, self.model_class())


def replace_inner_forward(forward):
    """An `install` that routes one model instance's inner forward through its one transformed
    stack (an instance attribute: no class is patched); `forward` calls `self._vskipper_stack`."""

    def install(model: nn.Module, stacks) -> None:
        (_, gm), = stacks
        inner = model.model
        object.__setattr__(inner, "_vskipper_stack", gm)  # not a submodule: its modules are the model's own
        inner.forward = types.MethodType(forward, inner)

    return install


_FAMILIES: list[ModelFamily] = []


def register_family(family: ModelFamily) -> None:
    _FAMILIES.append(family)


def register_families(engine: str, modules: dict[str, str], **parts) -> None:
    """Register an engine's model classes ({class name: module}) that share one set of parts."""
    for cls, module in modules.items():
        register_family(ModelFamily(name=f"{engine} {cls}", module=module, cls=cls, **parts))


def supported() -> list[str]:
    return [f.name for f in _FAMILIES]


def family_for(model: nn.Module) -> ModelFamily:
    for f in _FAMILIES:
        if f.matches(model):
            return f
    raise TypeError(
        f"vskipper.transform: unsupported model class {type(model).__module__}.{type(model).__name__}; "
        f"supported: {', '.join(supported())}"
    )


from vskipper.models import hf as _hf  # noqa: E402,F401  (registers the transformers families)
from vskipper.models import sglang as _sg  # noqa: E402,F401  (SGLang families; SGLang imported only when a model comes from it)
