"""What an engine looks like to a routed layer: its attention part and its MLP part.

A routed layer (vskipper/routed_layer.py) is built from a decoder layer's own modules, seen through
two parts with one contract (`parts.py`), one pair per engine:

    hf.py       transformers (eager; its KV cache; routed prefill over the layer's own mask)
    sglang.py   SGLang (its paged KV pool and attention backend; tensor-parallel sums)

and, for SGLang, the layer that stands in the engine's decoder stack and meets its neighbours in
SGLang's residual convention (`sglang_layer.py`). Families (vskipper/models/) say which parts a
model gets; bodies (vskipper/routed_layer.py) call only what the contract names."""
