"""Skipper spec strings, parsed in one place.

    random:rate=0.5,layers=15-29,seed=0     RandomSkip
    random:attn_rate=0.5,mlp_rate=0.2,layers=15-29,seed=0
                                            RandomSublayerSkip: attention and MLP skipped separately
                                            (a rate left out is 0: that sublayer always runs)
    static:layers=20,22,24-27               Static
    flexidepth:path=/ckpt[,gate=hard]       FlexiDepth.from_pretrained(path)
    flexidepth:name=smollm2-135m-flexidepth a skipper shipped in the package (vskipper/data/skippers/)
    flexidepth:name=...,threshold=0.7       its router's threshold (default 0.5): a token RUNs a layer
                                            when g > threshold, so a higher one skips more

Layer lists take single indices and inclusive ranges `a-b`; a bare item after `layers=`
continues the list. Every error is a ValueError naming the spec and the bad field.
"""
from __future__ import annotations

from vskipper.skippers.base import Skipper

KINDS = {
    "random": ("rate", "attn_rate", "mlp_rate", "layers", "seed"),
    "static": ("layers",),
    "flexidepth": ("path", "name", "gate", "threshold"),
}
REQUIRED = {"random": ("layers",), "static": ("layers",), "flexidepth": ()}
SUBLAYER_RATES = ("attn_rate", "mlp_rate")


MAX_LAYER = 4096  # no model has more layers; bounds what a spec can make us allocate


def parse_layers(text: str, spec: str = "") -> list[int]:
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        try:
            if sep:
                a, b = int(lo), int(hi)
                if b < a or b >= MAX_LAYER:
                    raise ValueError
                out.extend(range(a, b + 1))
            else:
                out.append(int(item))
        except ValueError:
            raise ValueError(
                f"skipper spec {spec!r}: layers item {item!r} is not an index or an inclusive range a-b "
                f"with a <= b < {MAX_LAYER}"
            ) from None
        if out and out[-1] >= MAX_LAYER:
            raise ValueError(f"skipper spec {spec!r}: layer index in {item!r} is not below {MAX_LAYER}")
    return out


def split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'kind:k=v,k=v' -> (kind, {k: v}); bare items after layers= extend the layer list."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"skipper spec {spec!r} is empty; expected e.g. 'random:rate=0.5,layers=15-29'")
    kind, sep, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise ValueError(f"skipper spec {spec!r}: unknown kind {kind!r}; expected one of {sorted(KINDS)}")
    fields: dict[str, str] = {}
    last = None
    for item in (rest.split(",") if rest.strip() else []):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            if last == "layers":
                fields["layers"] += "," + item.strip()
                continue
            raise ValueError(f"skipper spec {spec!r}: item {item!r} is not key=value")
        if key not in KINDS[kind]:
            raise ValueError(
                f"skipper spec {spec!r}: unknown field {key!r} for {kind}; expected {list(KINDS[kind])}"
            )
        if key in fields:
            raise ValueError(f"skipper spec {spec!r}: field {key!r} given twice")
        if not value.strip():
            raise ValueError(f"skipper spec {spec!r}: field {key!r} has no value")
        fields[key] = value.strip()
        last = key
    missing = [k for k in REQUIRED[kind] if k not in fields]
    if missing:
        raise ValueError(f"skipper spec {spec!r}: missing field(s) {missing} for {kind}")
    if kind == "random":
        sub = [k for k in SUBLAYER_RATES if k in fields]
        if "rate" in fields and sub:
            raise ValueError(f"skipper spec {spec!r}: rate= (whole layers) and {sub[0]}= (attention and MLP "
                             f"separately) cannot both be given; give one kind")
        if "rate" not in fields and not sub:
            raise ValueError(f"skipper spec {spec!r}: random needs rate= (whole layers) or attn_rate=/mlp_rate= "
                             f"(attention and MLP separately)")
    if kind == "flexidepth" and ("path" in fields) == ("name" in fields):
        raise ValueError(f"skipper spec {spec!r}: flexidepth needs exactly one of path=DIR or name=SHIPPED")
    return kind, fields


def _number(spec: str, key: str, value: str, kind=float):
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"skipper spec {spec!r}: {key}={value!r} is not {what}") from None


def parse_skipper(spec: str) -> Skipper:
    """Build a skipper from a spec string (see the module docstring)."""
    from vskipper.skippers.flexidepth import FlexiDepth
    from vskipper.skippers.random_skip import RandomSkip, RandomSublayerSkip, Static

    kind, f = split_spec(spec)
    try:
        if kind == "random" and "rate" not in f:
            return RandomSublayerSkip(
                *(_number(spec, k, f.get(k, "0")) for k in SUBLAYER_RATES),
                parse_layers(f["layers"], spec),
                seed=_number(spec, "seed", f.get("seed", "0"), int),
            )
        if kind == "random":
            return RandomSkip(
                _number(spec, "rate", f["rate"]),
                parse_layers(f["layers"], spec),
                seed=_number(spec, "seed", f.get("seed", "0"), int),
            )
        if kind == "static":
            return Static(parse_layers(f["layers"], spec))
        threshold = _number(spec, "threshold", f["threshold"]) if "threshold" in f else None
        if "name" in f:
            from vskipper.skippers.shipped import shipped_dir

            return FlexiDepth.from_pretrained(str(shipped_dir(f["name"])), gate=f.get("gate"), threshold=threshold)
        return FlexiDepth.from_pretrained(f["path"], gate=f.get("gate"), threshold=threshold)
    except ValueError as e:
        if str(e).startswith("skipper spec"):
            raise
        raise ValueError(f"skipper spec {spec!r}: {e}") from None
