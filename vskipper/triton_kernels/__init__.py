"""vskipper's Triton kernels, one op per file: constants, a private @triton.jit kernel, a launcher
(`launch`: checks, allocates, launches) and the op in plain torch beside it (`torch_op`: fixed
shapes, no host sync: what impl="torch" runs; masked_decode_attention also has `torch_op_dynamic`,
the dynamic routed body's form: CPU only, reads counts on the host). (vskipper/reference.py is
something else: the eager semantics the tests hold every path to.)

Call them through `vskipper.ops`, the one dispatch point. Nothing is imported here: a kernel is
decorated when its module is first imported, and TRITON_INTERPRET=1 (CPU) must be set before that.
"""

OPS = ("route_maps", "grouped_swiglu", "masked_decode_attention", "routed_prefill_attention")
