"""The one typed object that configures a training run."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from vskipper.skippers.base import check_layers

LOSSES = ("kl", "lm")
DATA_SETS = ("prompts", "chat")  # shipped prompt sets with a training split (vskipper/data)
INITS = ("warm", "random")
FAMILIES = ("flexidepth", "skipgpt")  # the skipper trained: one router per layer, or two per layer (sublayers)
TARGET_TOKENS = ("all", "generated")  # the tokens the skip penalty and target_skip count


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of `vskipper train` (docs/training.md explains each choice).

    family          "flexidepth": FlexiDepth's router and adapter per routed layer (one decision per token and
                    layer); "skipgpt": SkipGPT's two routers per routed layer, attention and MLP decided
                    separately, a skipped sublayer the identity (hard gate only, no adapter, no LoRA)
    layers          routed layer indices
    data            the shipped prompt sets (vskipper.data.load) whose training split the base model
                    answers for self-distillation: "prompts" (word problems, reasoning), "chat"
                    (everyday requests, short facts, arithmetic)
    gate            "soft" (FlexiDepth-Llama: g scales the MLP, 1 - g the adapter) or "hard"
    loss            "kl": KL(base || skipper) over the base's top-k + the rest of the vocabulary;
                    "lm": cross-entropy on the next token of the self-distilled text
    penalty         weight of the skip penalty mean_t((1/L) sum_l g_lt)^2 (FlexiDepth's squared
                    per-token gate sum, divided by L so the weight does not depend on L; skipgpt: g_lt is
                    the work-weighted run probability of the layer's two sublayers); with target_skip,
                    the starting weight
    target_skip     if set, the penalty weight is a multiplier adapted every step towards this
                    skip ratio: w <- w * exp(target_rate * (target - skip) / target), skip being the
                    batch's share of PROJECT decisions over routed layers and real tokens (skipgpt: the
                    share of skipped sublayer work, forward.sublayer_work), of the tokens target_tokens names
    target_tokens   "all": one penalty and target over every token (prompt and answer alike); "generated":
                    penalty and target_skip over the answer's generated tokens (those a generation feeds
                    back, data.generated), and the prompt's tokens a term of their own: prompt_penalty x
                    the same squared gate sum over them
    prompt_penalty  target_tokens "generated": the prompt tokens' penalty weight (0: no push to skip them,
                    the KL alone decides; below 0: a reward for running them); with prompt_target_skip, its
                    starting weight (> 0)
    prompt_target_skip  target_tokens "generated": adapt prompt_penalty towards this skip ratio of the
                    prompt tokens, as target_skip adapts the generated tokens' weight
    penalty_warmup  steps over which the penalty weight ramps linearly from 0
    straight_through add the straight-through term (gradient R - P through the hard decision)
    init            "warm": routers start with g ~ sigmoid(init_logit) (0.98) on (almost) every token,
                    adapters at zero (the skipper starts as the base model; skipgpt: every token
                    executes both sublayers, p_run = sigmoid(init_logit)); "random": PyTorch's
                    default init
    """

    layers: tuple[int, ...]
    family: str = "flexidepth"
    data: tuple[str, ...] = ("prompts",)
    max_prompts: int | None = None
    gate: str = "soft"
    loss: str = "kl"
    penalty: float = 0.1
    penalty_warmup: int = 0
    target_skip: float | None = None
    target_rate: float = 0.02
    target_tokens: str = "all"
    prompt_penalty: float = 0.0
    prompt_target_skip: float | None = None
    straight_through: bool = True
    init: str = "warm"
    init_logit: float = 4.0
    topk: int = 32
    steps: int = 600
    batch_size: int = 4
    lr: float = 1e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    router_reduction_factor: int = 16
    proj_reduction_factor: int = 16
    save_every: int = 50
    log_every: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", check_layers("TrainConfig", self.layers))
        object.__setattr__(self, "data", tuple(self.data))
        if not self.data or any(d not in DATA_SETS for d in self.data) or len(set(self.data)) != len(self.data):
            raise ValueError(f"TrainConfig: data={list(self.data)!r} must name distinct prompt sets among "
                             f"{list(DATA_SETS)}")
        n = self.max_prompts
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"TrainConfig: max_prompts={self.max_prompts!r} must be a positive integer or None")
        if self.family not in FAMILIES:
            raise ValueError(f"TrainConfig: family={self.family!r} must be one of {list(FAMILIES)}")
        if self.gate not in ("soft", "hard"):
            raise ValueError(f"TrainConfig: gate={self.gate!r} must be 'soft' or 'hard'")
        if self.family == "skipgpt" and self.gate != "hard":
            raise ValueError(f"TrainConfig: family='skipgpt' is hard-gated (a skipped sublayer is the identity), "
                             f"got gate={self.gate!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"TrainConfig: loss={self.loss!r} must be one of {list(LOSSES)}")
        if self.init not in INITS:
            raise ValueError(f"TrainConfig: init={self.init!r} must be one of {list(INITS)}")
        for name in ("penalty", "lr", "weight_decay", "grad_clip", "min_lr_ratio", "init_logit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"TrainConfig: {name}={v!r} must be a finite number >= 0")
        if self.target_skip is not None and (isinstance(self.target_skip, bool) or not isinstance(
                self.target_skip, (int, float)) or not 0 < self.target_skip < 1):
            raise ValueError(f"TrainConfig: target_skip={self.target_skip!r} must be a number in (0, 1)")
        if self.target_skip is not None and self.penalty == 0:
            raise ValueError("TrainConfig: target_skip needs a starting penalty > 0 (the weight is multiplied)")
        if self.target_tokens not in TARGET_TOKENS:
            raise ValueError(f"TrainConfig: target_tokens={self.target_tokens!r} must be one of {list(TARGET_TOKENS)}")
        p = self.prompt_penalty
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p):
            raise ValueError(f"TrainConfig: prompt_penalty={p!r} must be a finite number (below 0: a reward for "
                             f"running the prompt's tokens)")
        t = self.prompt_target_skip
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1):
            raise ValueError(f"TrainConfig: prompt_target_skip={t!r} must be a number in (0, 1)")
        if self.target_tokens == "all" and (p or t is not None):
            raise ValueError("TrainConfig: prompt_penalty and prompt_target_skip are the prompt tokens' own term, "
                             "with target_tokens='generated'; with target_tokens='all' one penalty counts every token")
        if t is not None and p <= 0:
            raise ValueError("TrainConfig: prompt_target_skip needs a starting prompt_penalty > 0 (the weight is "
                             "multiplied)")
        if isinstance(self.target_rate, bool) or not isinstance(self.target_rate, (int, float)) \
                or not 0 < self.target_rate <= 1:
            raise ValueError(f"TrainConfig: target_rate={self.target_rate!r} must be a number in (0, 1]")
        if self.lr == 0:
            raise ValueError("TrainConfig: lr=0 would train nothing; give a positive learning rate")
        if self.min_lr_ratio > 1:
            raise ValueError(f"TrainConfig: min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1]")
        for name in ("topk", "steps", "batch_size", "router_reduction_factor", "proj_reduction_factor",
                     "save_every", "log_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"TrainConfig: {name}={v!r} must be a positive integer")
        for name in ("penalty_warmup", "warmup", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig: {name}={v!r} must be an integer >= 0")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers)
        d["data"] = list(self.data)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if k in ("layers", "data") else v for k, v in d.items() if k in known})

    # fields a resumed run may change: they leave what the earlier steps computed as it was
    # (steps reshapes the rest of the cosine schedule, target_skip moves the penalty's goal)
    RESUMABLE_CHANGES = ("steps", "save_every", "log_every", "target_skip", "prompt_target_skip")
