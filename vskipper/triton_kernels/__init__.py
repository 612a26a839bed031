"""vskipper's Triton kernels, one op per file: constants, a private @triton.jit kernel, a launcher
(`launch`: checks, allocates, launches) and the pure-torch references beside it (`reference`: fixed
shapes, no host sync; masked_decode_attention also has `reference_dynamic`, the dynamic routed
body's form: CPU only, reads counts on the host).

Call them through `vskipper.ops`, the one dispatch point. Nothing is imported here: a kernel is
decorated when its module is first imported, and TRITON_INTERPRET=1 (CPU) must be set before that.
"""

OPS = ("route_maps", "grouped_swiglu", "masked_decode_attention", "routed_prefill_attention")
