"""SGLang (0.5.23) LlamaForCausalLM and Qwen3ForCausalLM, inside SGLang: only routed layers change.

The inner model's forward stays SGLang's own, and so does every decoder layer the skipper does not
route. A routed layer i is replaced, in `model.model.layers[i]`, by the SGLangRoutedLayer of
vskipper/engines/sglang_layer.py (SGLang's residual convention at its boundary), which runs the
routed layer the fx passes built from that layer's own parts (vskipper/engines/sglang.py).
Pipeline parallelism is refused, naming --pp-size."""
from __future__ import annotations

from torch import nn

from vskipper.engines.sglang import SGLangAttention, SGLangMLP
from vskipper.engines.sglang_layer import SGLangRoutedLayer
from vskipper.models import families_of


class SGLangSlot(nn.Module):
    """What the fx passes trace for routed layer `index`: one call of the decoder layer (an fx
    leaf, target "layers.<index>"), which the route pass rewrites into the routed layer."""

    def __init__(self, index: int, layer: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(index): layer})
        self.indices = (index,)
        self.key = str(index)

    def forward(self, hidden_states, token_ids, positions, valid, budget, forward_batch):
        return self.layers[self.key](hidden_states, positions=positions, forward_batch=forward_batch)


def _check_parallel(model) -> None:
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    if p.pp_group.world_size != 1:
        raise NotImplementedError(
            f"vskipper: pipeline parallelism (--pp-size {p.pp_group.world_size}) is not supported; "
            f"tensor parallelism (--tp-size) and data parallelism (--dp-size) are"
        )


def make_stacks(model, routed) -> list[SGLangSlot]:
    _check_parallel(model)
    layers = model.model.layers
    return [SGLangSlot(i, layers[i]) for i in routed]


def install(model, stacks, budgets=None) -> None:
    """Each routed layer's slot in model.model.layers takes its transformed graph (and the batches'
    per-row budget buffer, where the plugin has one); nothing else changes."""
    layers = model.model.layers
    for slot, gm in stacks:
        (i,) = slot.indices
        layers[i] = SGLangRoutedLayer(layers[i], gm, budgets, index=i)


FAMILIES = families_of("sglang", {"LlamaForCausalLM": "sglang.srt.models.llama",
                                  "Qwen3ForCausalLM": "sglang.srt.models.qwen3"},
                       make_stacks=make_stacks, install=install,
                       make_attention=lambda layer: SGLangAttention(layer.self_attn),
                       make_mlp=lambda layer: SGLangMLP(layer.mlp))
