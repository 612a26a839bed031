"""Skippers: the contract and the built-ins."""
from vskipper.skippers.base import Skipper, sanitize_gate
from vskipper.skippers.flexidepth import FlexiDepth
from vskipper.skippers.random_skip import RandomSkip, RandomSublayerSkip, Static
from vskipper.skippers.skipgpt import SkipGPT
from vskipper.skippers.spec import parse_skipper

__all__ = ["Skipper", "FlexiDepth", "RandomSkip", "RandomSublayerSkip", "SkipGPT", "Static", "parse_skipper",
           "sanitize_gate"]
