"""transformers (5.x) LlamaForCausalLM and Qwen3ForCausalLM.

The decoder stack is replaced, for this one model instance, by an fx-traced DecoderStack; the
inner model's forward is rebound (an instance attribute, no class is patched) to compute
embeddings, masks and rotary tables as transformers does, tell the route counters the phase (a
forward of one new token per sequence over a non-empty cache is decode, a generated token; any
other is prefill, prompt tokens), then call the stack. A routed layer's parts: vskipper/engines/hf.py.
"""
from __future__ import annotations

import torch
from torch import nn

from vskipper.counters import DECODE, PREFILL
from vskipper.engines.hf import HFMLP, HFAttention
from vskipper.models import families_of


class HFDecoderStack(nn.Module):
    """The decoder loop of a transformers Llama/Qwen3 model; decoder layers are fx leaves."""

    def __init__(self, layers: nn.ModuleList, layer_types: list[str]) -> None:
        super().__init__()
        self.layers = layers
        self.layer_types = layer_types
        self.indices = tuple(range(len(layers)))

    def forward(self, hidden_states, token_ids, positions, valid, masks, position_embeddings,
                position_ids, past_key_values, use_cache):
        for i, layer in enumerate(self.layers):
            hidden_states = layer(
                hidden_states,
                attention_mask=masks[self.layer_types[i]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
            )
        return hidden_states


def _layer_types(config) -> list[str]:
    types_ = getattr(config, "layer_types", None)
    return list(types_) if types_ else ["full_attention"] * config.num_hidden_layers


def make_stacks(model, routed) -> list[HFDecoderStack]:
    inner = model.model
    return [HFDecoderStack(inner.layers, _layer_types(inner.config))]


def _cached(cache) -> bool:
    """Whether `cache` holds earlier tokens, read on the host: a DynamicCache's length is a shape; any
    other cache (a StaticCache, whose length is a device reduction, or the GPU harness's) is taken to
    hold them, so that a decode step never waits for the device."""
    from transformers.cache_utils import DynamicCache

    if cache is None:
        return False
    return cache.get_seq_length() > 0 if isinstance(cache, DynamicCache) else True


def _skip_aware_forward(self, stack, phase, input_ids=None, attention_mask=None, position_ids=None,
                        past_key_values=None, inputs_embeds=None, use_cache=None, **kwargs):
    """The inner model's forward after `vskipper.transform`: as transformers computes it, with the
    decoder loop replaced by the transformed DecoderStack `stack`; `phase` (counters.Phase) is set for
    the route counters."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast

    for k in ("output_hidden_states", "output_attentions"):
        if kwargs.get(k):
            raise NotImplementedError(f"vskipper-transformed models do not return {k.removeprefix('output_')}")
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)
    B, S = inputs_embeds.shape[:2]
    if B == 0 or S == 0:
        raise ValueError(f"vskipper: empty batch (input shape {list(inputs_embeds.shape[:2])}); "
                         f"give at least one sequence with at least one token")
    if use_cache is None:
        use_cache = self.config.use_cache
    if use_cache and past_key_values is None:
        past_key_values = DynamicCache(config=self.config)
    phase.set(DECODE if S == 1 and _cached(past_key_values) else PREFILL)
    if position_ids is None:
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        position_ids = (torch.arange(S, device=inputs_embeds.device) + past).unsqueeze(0)
    if isinstance(attention_mask, dict):
        masks = attention_mask
    else:
        mk = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                  past_key_values=past_key_values, position_ids=position_ids)
        masks = {"full_attention": create_causal_mask(**mk)}
        if "sliding_attention" in _layer_types(self.config):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mk)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        valid = attention_mask[:, -S:].bool()  # [B, S]
    else:
        valid = torch.ones(B, S, dtype=torch.bool, device=inputs_embeds.device)
    position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
    positions = position_ids.expand(B, S)
    h = stack(inputs_embeds, input_ids, positions, valid, masks, position_embeddings,
              position_ids, past_key_values, use_cache)
    return BaseModelOutputWithPast(last_hidden_state=self.norm(h),
                                   past_key_values=past_key_values if use_cache else None)


class SkipAwareForward:
    """The inner model's forward through its transformed stack (an object rather than a closure,
    so that copy.deepcopy of the model rebinds it to the copy)."""

    def __init__(self, inner: nn.Module, stack: nn.Module, phase: nn.Module) -> None:
        self.inner, self.stack, self.phase = inner, stack, phase

    def __call__(self, *args, **kwargs):
        return _skip_aware_forward(self.inner, self.stack, self.phase, *args, **kwargs)


def install(model, stacks, budgets=None) -> None:
    """Route this one model instance's inner forward through its one transformed stack (an
    instance attribute: no class is patched). transformers has no per-request budgets."""
    (_, gm), = stacks
    model.model.forward = SkipAwareForward(model.model, gm, model.vskipper.phase)


FAMILIES = families_of("transformers", {"LlamaForCausalLM": "transformers.models.llama.modeling_llama",
                                        "Qwen3ForCausalLM": "transformers.models.qwen3.modeling_qwen3"},
                       make_stacks=make_stacks, install=install,
                       make_attention=lambda layer: HFAttention(layer.self_attn),
                       make_mlp=lambda layer: HFMLP(layer.mlp))
