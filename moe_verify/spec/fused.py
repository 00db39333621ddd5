"""Fused stage groups: one backend method that computes several stages in one kernel.

A kernel that quantizes each row as it scatters it has no `quant_input` output of its own; one
that runs the whole layer (DeepGEMM's mega MoE) has only the layer's output. A backend declares
such a method as a `FusedGroup` in its `fused_groups` attribute:

    class MyKernels:
        name = "my-kernels"
        fused_groups = (FusedGroup("quantize_and_scatter", (Stage.QUANT_INPUT, Stage.PERMUTE)),)

        def quantize_and_scatter(self, ctx: StageContext) -> dict[str, Outputs]:
            return {"permute": {...}}  # the stages it exposes, by name; its last stage always

The method takes the one StageContext every stage takes (its upstream: what the group's stages
read from outside the group) and returns the outputs of the stages it exposes, keyed by stage;
the group's last stage is required (the stages after it read it). The harness judges each
exposed stage against the golden's, stages inside the group after its first one by the chained
bounds (their input was the kernel's own), and reports unexposed stages as covered by the group
(docs/stage-contract.md#fused-stage-groups).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_verify.spec.checks import _got
from moe_verify.spec.stages import Stage

# What each stage reads from the stages before it, where that is narrower than "every earlier
# stage" (docs/stage-contract.md): a stage between two members of a group may run before the
# group only when it reads none of the group's stages.
READS: dict[Stage, frozenset[Stage]] = {
    Stage.ROUTE: frozenset(),
    Stage.QUANT_INPUT: frozenset(),
    Stage.ALIGN: frozenset({Stage.ROUTE}),
}


def reads(stage: Stage, earlier: tuple[Stage, ...]) -> frozenset[Stage]:
    """The stages of `earlier` that `stage` reads (all of them unless READS narrows it)."""
    return READS.get(stage, frozenset(earlier)) & frozenset(earlier)


@dataclass(frozen=True)
class FusedGroup:
    """`method` computes `stages` (two or more, in the forward's order) in one call."""

    method: str
    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method.isidentifier():
            raise ValueError(f"FusedGroup.method: expected a method name, got {_got(self.method)}")
        if not isinstance(self.stages, tuple | list):
            raise TypeError(
                f"FusedGroup.stages: expected a tuple of stages, got {_got(self.stages)}"
            )
        try:
            stages = tuple(Stage(s) for s in self.stages)
        except ValueError as exc:
            raise ValueError(f"FusedGroup {self.method}: {exc}") from None
        if len(stages) < 2 or len(set(stages)) != len(stages):
            raise ValueError(
                f"FusedGroup {self.method}: expected two or more distinct stages, got "
                f"{[s.value for s in stages]}"
            )
        if Stage.REDUCE in stages:
            raise ValueError(
                f"FusedGroup {self.method}: reduce is made across ranks by the harness"
            )
        object.__setattr__(self, "stages", stages)

    @property
    def name(self) -> str:
        """How reports name the group: 'quant_input+permute', 'route..gather (8 stages)'."""
        if len(self.stages) <= 3:
            return "+".join(s.value for s in self.stages)
        return f"{self.stages[0].value}..{self.last.value} ({len(self.stages)} stages)"

    @property
    def last(self) -> Stage:
        return self.stages[-1]


# One step of a rank's forward as a backend runs it: a stage, or a fused group of stages.
Step = Stage | FusedGroup


def fused_groups(backend: object) -> tuple[FusedGroup, ...]:
    """The groups `backend` declares (its `fused_groups` attribute; none by default), each
    checked to have its method."""
    groups = getattr(backend, "fused_groups", ())
    if not isinstance(groups, tuple | list) or not all(isinstance(g, FusedGroup) for g in groups):
        raise TypeError(
            f"{_backend_name(backend)}.fused_groups: expected a tuple of FusedGroup, got "
            f"{_got(groups)}"
        )
    for group in groups:
        if not callable(getattr(backend, group.method, None)):
            raise TypeError(
                f"{_backend_name(backend)} declares the fused group {group.name} but has no "
                f"method {group.method}(ctx)"
            )
    return tuple(groups)


def plan(stages: tuple[Stage, ...], groups: tuple[FusedGroup, ...]) -> tuple[Step, ...]:
    """The steps that run `stages` (a problem's, in order) with `groups` fused: each group in
    the place of its last stage, a stage between its members moved before it (allowed only when
    it reads none of them). A ValueError names a group whose stages the problem does not run in
    that order, a stage in two groups, or a stage the group would have to wait for."""
    claimed: dict[Stage, FusedGroup] = {}
    for group in groups:
        missing = [s.value for s in group.stages if s not in stages]
        if missing:
            raise ValueError(
                f"fused group {group.name}: this problem does not run {', '.join(missing)} "
                f"(its stages: {', '.join(s.value for s in stages)})"
            )
        if list(group.stages) != sorted(group.stages, key=stages.index):
            order = ", ".join(s.value for s in sorted(group.stages, key=stages.index))
            raise ValueError(f"fused group {group.name}: the forward runs them as {order}")
        for stage in group.stages:
            if stage in claimed:
                raise ValueError(
                    f"stage {stage.value} is in two fused groups: {claimed[stage].name} and "
                    f"{group.name}"
                )
            claimed[stage] = group
        first, last = stages.index(group.stages[0]), stages.index(group.last)
        for between in stages[first:last]:
            if between in group.stages:
                continue
            inside = reads(between, stages[: stages.index(between)]) & set(group.stages)
            if inside:
                raise ValueError(
                    f"fused group {group.name}: {between.value} runs between its stages and reads "
                    f"{', '.join(sorted(s.value for s in inside))}, an output the group does not "
                    "hand out before it ends"
                )
    steps: list[Step] = []
    for stage in stages:
        group = claimed.get(stage)
        if group is None:
            steps.append(stage)
        elif stage is group.last:
            steps.append(group)
    return tuple(steps)


def group_of(steps: tuple[Step, ...], stage: Stage) -> FusedGroup | None:
    """The group of `steps` that computes `stage`, or None when it runs alone."""
    return next((s for s in steps if isinstance(s, FusedGroup) and stage in s.stages), None)


def _backend_name(backend: object) -> str:
    return str(getattr(backend, "name", type(backend).__name__))


__all__ = ["READS", "FusedGroup", "Step", "fused_groups", "group_of", "plan", "reads"]
