"""Model family adapters: where a model's decoder layers are and how to call their parts.

An adapter is data plus a few small functions; `adapter_for(model)` finds the one that
matches a model instance, or raises TypeError naming every supported class.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

from torch import nn


@dataclass(frozen=True)
class ModelAdapter:
    """A family of models vskipper can transform.

    module/cls: where the model class lives (imported lazily: nothing here needs SGLang).
    make_stack(model) -> DecoderStack module with `layers` (the decoder layers, fx leaves).
    make_attention(layer) -> the attention adapter for a routed layer (all_rows / some_rows).
    install(model, stack_gm) -> route the model's forward through the transformed stack.
    mlp_weights(mlp) -> (w_gate, w_up, w_down) of a decoder layer's SwiGLU MLP (static body).
    """

    name: str
    module: str
    cls: str
    make_stack: object
    make_attention: object
    install: object
    mlp_weights: object = None
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


_ADAPTERS: list[ModelAdapter] = []


def register_adapter(adapter: ModelAdapter) -> None:
    _ADAPTERS.append(adapter)


def supported() -> list[str]:
    return [a.name for a in _ADAPTERS]


def adapter_for(model: nn.Module) -> ModelAdapter:
    for a in _ADAPTERS:
        if a.matches(model):
            return a
    raise TypeError(
        f"vskipper.transform: unsupported model class {type(model).__module__}.{type(model).__name__}; "
        f"supported: {', '.join(supported())}"
    )


from vskipper.models import hf as _hf  # noqa: E402,F401  (registers the transformers families)
from vskipper.models import sglang as _sg  # noqa: E402,F401  (SGLang families; SGLang imported only when a model comes from it)
