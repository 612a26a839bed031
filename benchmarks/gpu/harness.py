"""What the GPU model checks share (model_check.py, decode.py): a Llama of a
given shape with random weights, built directly on its device; systems that share its weights (the
base model, vskipper transforms of it); a fixed-address KV cache; one decode step with static
input buffers, captured in a CUDA graph on CUDA and run eagerly under the host-sync guard on CPU
(the --smoke stand-in, so the smoke run exercises everything but the capture itself).

Legend: B = sequences in the batch (one new token each), C = cache length (context), L = layers,
H = hidden, kvh = KV heads, d = head dim, V = vocab.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import time

import torch

import vskipper
from vskipper.guard import NoHostSync


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    routed: tuple[int, ...]

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA3_8B = Shape(4096, 14336, 32, 8, 32, 128256, tuple(range(16, 32)))
TINY = Shape(64, 96, 4, 2, 4, 128, (2, 3))  # the --smoke shape: seconds on a CPU


def parse_shape(text: str) -> Shape:
    """'8b', 'tiny', or hidden,intermediate,heads,kv_heads,layers,vocab (routed: the upper half)."""
    if text in ("8b", "llama3-8b"):
        return LLAMA3_8B
    if text == "tiny":
        return TINY
    try:
        H, I, nh, kvh, L, V = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--shape {text!r}: expected 8b, tiny or hidden,intermediate,heads,kv_heads,layers,vocab")
    return Shape(H, I, nh, kvh, L, V, tuple(range(L // 2, L)))


def cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def build_llama(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0, std: float = 0.02):
    """A transformers LlamaForCausalLM of `shape` with random weights, allocated on `device` (meta
    first, then filled there: nothing is downloaded, nothing is initialised twice)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    cfg._attn_implementation = register_bench_attention()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device).eval()  # allocated once, in dtype
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, std, generator=g)
            else:
                p.fill_(1.0)  # RMSNorm weights
    rot = model.model.rotary_emb  # to_empty left its inv_freq buffer uninitialised: build it again there
    model.model.rotary_emb = type(rot)(cfg).to(device)
    model.generation_config.eos_token_id = None
    return model


def bench_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, except for a FULL mask (Step(full=True): every cached position
    attended): then no mask and grouped-query heads left to SDPA (enable_gqa), so that its fused
    kernels run instead of a masked kernel over K/V repeated per query head (transformers repeats
    them whenever a mask is given). The same for the base model and every transformed one."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not getattr(attention_mask, "vskipper_full", False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    o = torch.nn.functional.scaled_dot_product_attention(  # q [B, nh, 1, d], k/v [B, kvh, C, d]
        query, key, value, scale=kwargs.get("scaling"), enable_gqa=True)  # (also right for kvh == nh)
    return o.transpose(1, 2).contiguous(), None  # [B, 1, nh, d]


def register_bench_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register("vskipper_bench", bench_attention)
    return "vskipper_bench"


def sharing_copy(model):
    """A copy of `model` whose parameters and buffers are the original's own tensors: a system to
    transform without a second copy of the weights."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def random_flexidepth(shape: Shape, gate: str, device, dtype, seed: int = 1, head_scale: float = 20.0):
    """A FlexiDepth of random router and adapter weights; head_scale spreads the gates away from 0.5
    so that route decisions are mixed and not decided by last-bit noise."""
    torch.manual_seed(seed)
    sk = vskipper.FlexiDepth(shape.routed, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                             rms_norm_eps=1e-5, gate=gate)
    with torch.no_grad():
        for name, p in sk.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
            if "router_head" in name:
                p.mul_(head_scale)
    return sk.to(device=device, dtype=dtype)


def skipper_for(name: str, shape: Shape, device, dtype):
    if name == "random":
        return vskipper.RandomSkip(0.5, shape.routed, seed=0)
    if name in ("flexidepth-hard", "flexidepth-soft"):
        return random_flexidepth(shape, name.split("-")[1], device, dtype)
    raise ValueError(f"unknown skipper {name!r}")


def transformed(base, skipper, execution: str, check_sync: bool = False, impl: str = "auto"):
    """vskipper.transform of a weight-sharing copy of `base`, with fixed shapes (what CUDA graphs need)."""
    cfg = vskipper.Config(execution=execution, impl=impl, static_shapes=True, check_sync=check_sync)
    return vskipper.transform(sharing_copy(base), skipper, cfg)


def regions(model) -> list:
    """The modules a decode step of `model` runs that torch.compile compiles, one by one (regional
    compilation: one decoder layer's code serves every layer): the base model's decoder layers and final
    norm; a transformed model's too, and every module its traced stack calls (the input norms, routers and
    routed layers; vskipper's ops inside them are custom ops, opaque to the compiler). Base and
    transformed models are compiled at the same grain, so the small kernels fuse alike in both."""
    inner = model.model
    mods = list(inner.layers) + [inner.norm]
    state = getattr(model, "vskipper", None)
    for gm in (state.graphs if state is not None else ()):
        mods += [gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    out, seen = [], set()
    for m in mods:
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def compile_regions(model, fullgraph: bool = True, backend: str = "inductor") -> int:
    """torch.compile every region of `model` (`regions`) in place, dynamic in every dimension (so the
    batch and context grid needs no recompile), fullgraph (a graph break fails instead of splitting
    the region); returns how many. A decoder layer's index is read as a value, not a constant
    (allow_unspec_int_on_nn_module), so that every layer reuses one compiled graph. Compilation
    happens at the first call (Captured's warm-up, before capture)."""
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    mods = regions(model)
    for m in mods:
        m.compile(dynamic=None, fullgraph=fullgraph, backend=backend)
    return len(mods)


class PoolKV:
    """A fixed-address KV cache: per layer K and V [B, kvh, C, d], viewed out of one flat buffer per
    layer so that every (B, C) of a sweep reuses the same memory. A step writes its tokens' K/V at
    `positions` (the step's own position buffer, so a captured graph writes where the buffer says
    at replay). transformers' attention calls `update(k, v, layer_idx, ...)`; nothing else is used
    (a plain object, not a transformers Cache: it does not depend on the cache API of one version)."""

    def __init__(self, shape: Shape, tokens: int, device, dtype) -> None:
        self.shape = shape
        # one buffer per K and V for all layers, [L, per]: a layer's cache is a select by its index, which
        # torch.compile traces with the index as a value (one compiled decoder layer serves all of them);
        # one spare head of padding keeps every view's layer stride apart from its size (a view that
        # filled the row would be contiguous, and a compiled layer would recompile for it)
        per = (tokens + 1) * shape.kv_heads * shape.head_dim
        self.flat_k = torch.zeros(shape.layers, per, device=device, dtype=dtype)
        self.flat_v = torch.zeros(shape.layers, per, device=device, dtype=dtype)
        self.device = self.flat_k.device
        self.positions = None

    def view(self, B: int, C: int, positions: torch.Tensor) -> "PoolKV":
        s = self.shape
        n = B * s.kv_heads * C * s.head_dim
        if n > self.flat_k.shape[1]:
            raise ValueError(f"PoolKV holds {self.flat_k.shape[1]} values per layer, B={B} C={C} needs {n}")
        self.k, self.v = (f[:, :n].view(s.layers, B, s.kv_heads, C, s.head_dim) for f in (self.flat_k, self.flat_v))
        self.positions = positions  # [B, S]
        return self

    def randomize(self, seed: int = 0) -> None:
        g = torch.Generator(device=self.device).manual_seed(seed)
        self.k.normal_(0, 1, generator=g)
        self.v.normal_(0, 1, generator=g)

    def update(self, k, v, layer_idx, *args, **kwargs):
        K, V = self.k[layer_idx], self.v[layer_idx]  # [B, kvh, C, d]; k, v [B, kvh, S, d]
        idx = self.positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        K.scatter_(2, idx, k)
        V.scatter_(2, idx, v)
        return K, V

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The cache length of the current view, a host int (the step attends every cached position)."""
        return self.k.shape[3]


class Step:
    """One forward of `model` over static buffers: ids, positions [B, S] -> logits [B, S, V]. The
    causal mask [B, 1, S, C] is computed on the device from the positions (a 4D mask goes through
    transformers' mask creation unchanged), so the whole step is device work: capturable."""

    def __init__(self, model, kv: PoolKV, B: int, C: int, S: int = 1, full: bool = False) -> None:
        """full: every one of the C cached positions is attended (a decode step at position C - 1):
        the mask is then FULL, which the bench attention (below) reads as no mask at all."""
        dev = kv.device
        self.model, self.B, self.C = model, B, C
        self.ids = torch.zeros(B, S, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, S, dtype=torch.long, device=dev)
        self.kv = kv
        self.cols = torch.arange(C, device=dev)
        self.full = None
        if full:
            if S != 1:
                raise ValueError("Step(full=True) is a decode step: S must be 1")
            self.full = torch.ones(B, 1, 1, C, dtype=torch.bool, device=dev)
            self.full.vskipper_full = True

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        self.kv.view(self.B, self.C, self.positions)
        mask = self.full if self.full is not None else \
            self.cols[None, None, None, :] <= self.positions[:, None, :, None]  # [B, 1, S, C]
        out = self.model(input_ids=self.ids, position_ids=self.positions, attention_mask=mask,
                         past_key_values=self.kv, use_cache=True)
        return out.logits


class Captured:
    """`fn` captured in a CUDA graph (after a warm-up on a side stream) whose output tensor is
    `out`; `replay()` reruns it. Without CUDA (the --smoke run) replay runs `fn` eagerly under the
    host-sync guard instead: what capture would refuse, the guard refuses too."""

    def __init__(self, fn, warmup: int = 2, guard: bool = True) -> None:
        self.fn, self.guard, self.graph = fn, guard, None
        if cuda():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fn()
        else:
            self.out = self._eager()

    def _eager(self):
        if not self.guard:
            return self.fn()
        with NoHostSync("the decode step (stand-in for CUDA-graph capture)"):
            return self.fn()

    def replay(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out = self._eager()
        return self.out

    def close(self) -> None:
        self.graph = self.out = None


def time_ms(fn, iters: int, warmup: int = 2) -> float:
    """Median ms of `fn` (CUDA events on CUDA, wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        if cuda():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def device_line() -> str:
    import transformers
    import triton

    dev = torch.cuda.get_device_name() if cuda() else "CPU (no CUDA: eager stand-in for graphs, timings meaningless)"
    return (f"{dev}; torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
            f"vskipper {vskipper.__version__ if hasattr(vskipper, '__version__') else '?'}")
