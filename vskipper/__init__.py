"""vskipper: dynamic per-token layer skipping that pays off in LLM serving.

    import vskipper
    model = vskipper.transform(model, vskipper.RandomSkip(0.5, layers=range(15, 30)))
    model = vskipper.from_pretrained("path/to/flexidepth-checkpoint")
    vskipper.stats(model)
"""
from vskipper.config import Config
from vskipper.skippers import FlexiDepth, RandomSkip, Skipper, Static, parse_skipper
from vskipper.api import from_pretrained, stats, transform

__version__ = "0.1.0"

__all__ = [
    # verbs
    "transform",
    "from_pretrained",
    "stats",
    # configuration
    "Config",
    # skippers
    "Skipper",
    "FlexiDepth",
    "RandomSkip",
    "Static",
    "parse_skipper",
]
