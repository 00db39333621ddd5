"""One wrong variant of an engine's kernels, the problem it runs, and the stage it must fail at:
the case type of the three adapters' wrong-variant tests."""

from __future__ import annotations

from dataclasses import dataclass

from moe_verify.spec import MoEProblem


@dataclass(frozen=True)
class Expect:
    variant: type
    problem: MoEProblem
    stage: str

    @property
    def id(self) -> str:
        return self.variant.__name__
