"""vskipper: dynamic per-token layer skipping that pays off in LLM serving.

    import vskipper
    model = vskipper.transform(model, vskipper.RandomSkip(0.5, layers=range(15, 30)))
    model = vskipper.from_pretrained("path/to/flexidepth-checkpoint")
    vskipper.stats(model)
    print(model.vskipper)          # what each routed layer runs, and why (vskipper.explain)
"""
from vskipper._version import __version__  # noqa: F401  (vskipper.__version__)
from vskipper.api import explain, from_pretrained, stats, transform
from vskipper.config import Config
from vskipper.skippers import FlexiDepth, RandomSkip, RandomSublayerSkip, SkipGPT, Skipper, Static, parse_skipper

__all__ = [
    # verbs
    "transform",
    "from_pretrained",
    "stats",
    "explain",
    # configuration
    "Config",
    # skippers
    "Skipper",
    "FlexiDepth",
    "RandomSkip",
    "RandomSublayerSkip",
    "SkipGPT",
    "Static",
    "parse_skipper",
]
