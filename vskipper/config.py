"""`vskipper.Config`: how a transformed model executes, as one typed, validated object."""
from __future__ import annotations

from dataclasses import dataclass

EXECUTIONS = ("auto", "dense", "routed")


@dataclass(frozen=True)
class Config:
    """How routed layers execute. Every choice computes the same function.

    execution: "dense"  -> every row computes the MLP and the adapter, then a mask selects;
               "routed" -> RUN rows are gathered, run through attention + MLP, scattered back;
                           PROJECT rows likewise through the adapter;
               "auto"   -> the cost model picks dense or routed per layer and batch.
    """

    execution: str = "auto"

    def __post_init__(self) -> None:
        if self.execution not in EXECUTIONS:
            raise ValueError(
                f"Config.execution={self.execution!r} is not one of {', '.join(map(repr, EXECUTIONS))}"
            )
