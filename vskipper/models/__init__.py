"""Model families: where a model's decoder layers are and which engine parts a routed layer gets.

A family is data plus a few small functions; `family_for(model)` finds the one that matches a
model instance, or raises TypeError naming every supported class. The families are listed in
FAMILY_MODULES, each of which defines FAMILIES (nothing registers itself on import). (Not to be
confused with a skipper's adapter, FlexiDepth's small MLP for PROJECT rows.)
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

from torch import nn

FAMILY_MODULES = ("vskipper.models.hf", "vskipper.models.sglang")


@dataclass(frozen=True)
class ModelFamily:
    """A family of models vskipper can transform.

    module/cls: where the model class lives (imported lazily: nothing here needs SGLang).
    make_stacks(model, routed) -> the modules the fx passes trace and rewrite, each with `layers`
        (decoder layers, fx leaves, as a ModuleList or a ModuleDict keyed by index) and `indices`
        (the layer indices it calls): one stack of every layer (transformers), or one stack per
        routed layer (SGLang: only routed layers change).
    install(model, [(stack, graph module)], budgets) -> put the transformed stacks in the model's
        path; `budgets` is the engine's per-row budget buffer (vskipper/control.py) or None.
    make_attention(layer) -> the routed layer's AttentionPart, make_mlp(layer) -> its MLPPart
        (vskipper/engines/parts.py).
    """

    name: str
    module: str
    cls: str
    make_stacks: object
    install: object
    make_attention: object
    make_mlp: object
    input_norm: str = "input_layernorm"
    post_norm: str = "post_attention_layernorm"

    def model_class(self):
        return getattr(import_module(self.module), self.cls)

    def matches(self, model: nn.Module) -> bool:
        engine = self.module.split(".")[0] + "."
        if not any(c.__module__.startswith(engine) for c in type(model).__mro__):
            return False  # never import an engine the model does not come from
        return isinstance(model, self.model_class())

    @staticmethod
    def layers(model: nn.Module) -> nn.ModuleList:
        """The decoder layers (every family registered here keeps them in model.model.layers)."""
        return model.model.layers


def families_of(engine: str, modules: dict[str, str], **parts) -> list[ModelFamily]:
    """An engine's model classes ({class name: module}) that share one set of parts."""
    return [ModelFamily(name=f"{engine} {cls}", module=module, cls=cls, **parts) for cls, module in modules.items()]


def families() -> list[ModelFamily]:
    return [f for m in FAMILY_MODULES for f in import_module(m).FAMILIES]


def supported() -> list[str]:
    return [f.name for f in families()]


def family_for(model: nn.Module) -> ModelFamily:
    for f in families():
        if f.matches(model):
            return f
    raise TypeError(
        f"vskipper.transform: unsupported model class {type(model).__module__}.{type(model).__name__}; "
        f"supported: {', '.join(supported())}"
    )
