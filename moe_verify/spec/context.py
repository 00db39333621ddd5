"""What the harness hands each stage: the problem, the upstream, and the framework's state.

A stage method is `stage(ctx: StageContext) -> outputs` (moe_verify/spec/protocol.py). Everything
that is the framework's, not the kernel's, travels in the context, so a kernel class carries
kernels and nothing else: the rank's shard of the weights, the buffers to write outputs into,
whether kernels may check their inputs' values on the host, and whether the call must be
graph-safe. Verification (`moe-verify run`, sweep, replay, torchrun ranks) and production mode
(`moe-verify graph`, `bench --production`, the registered op) build it differently and call the
same methods.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moe_verify.spec.inputs import MoEInputs, QuantizedWeight
from moe_verify.spec.problem import MoEProblem
from moe_verify.spec.recipes import Engine
from moe_verify.spec.trace import Trace

Outputs = dict[str, object]


class Buffers(Protocol):
    """Where a stage writes its large outputs. Verification hands reused, poisoned workspaces
    between guard bands (or none); production mode hands views of the op's one workspace."""

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """The buffer `name` of that shape to write into, or None: allocate your own."""
        ...

    def own(self, t: torch.Tensor) -> torch.Tensor:
        """A stage output the trace may keep (a copy where `t` lives in a reused buffer)."""
        ...

    def guard_hits(self) -> str:
        """What was written outside the buffers handed out since the last look ("" if nothing)."""
        ...


class NoBuffers:
    """No workspaces: every kernel allocates its outputs."""

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        return None

    def own(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def guard_hits(self) -> str:
        return ""


NO_BUFFERS = NoBuffers()


@dataclass(frozen=True)
class RankShard:
    """One rank's weights and id map, as the framework holds them: `expert_map` [E_global] int32
    (global id -> local id, -1 = not here) or None when every expert is local (TP).

    `prepared` holds the weights' load-time transforms a kernel keeps (DeepGEMM's scale layout,
    say), built once per shard with `prepared_once`, as vLLM post-processes weights at load
    time and never per call. Production mode fills it when the op is given its weights."""

    experts: tuple[int, ...]
    expert_map: torch.Tensor | None
    w13: QuantizedWeight
    w2: QuantizedWeight
    prepared: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_local_experts(self) -> int:
        return len(self.experts)

    def weight(self, which: str) -> QuantizedWeight:
        """ "w13" (gate/up, gemm1's) or "w2" (down, gemm2's)."""
        if which not in ("w13", "w2"):
            raise ValueError(f"RankShard.weight: 'w13' or 'w2', got {which!r}")
        return self.w13 if which == "w13" else self.w2

    def prepared_once(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`prepared[key]`, made by `make()` the first time it is asked for."""
        if key not in self.prepared:
            self.prepared[key] = make()
        return self.prepared[key]


# How a context finds a rank's shard: (problem, inputs, rank) -> RankShard.
ShardOf = Callable[[MoEProblem, MoEInputs, int], RankShard]


@dataclass(frozen=True)
class StageContext:
    """One stage call: the problem, this rank's inputs, and the outputs of the stages before.

    `upstream` holds the stages before this one: the backend's own in chained mode, the golden's
    in isolated mode. Never write into it, nor into `inputs`: verification hands protected
    copies and blames a write on the stage that made it.

    The framework's part:
    - `shard`: this rank's weights and expert map (`shard_of(problem, inputs, rank)`, built on
      first use; in production mode the weights the op was given).
    - `buffers`: where to write the large outputs (`buffers.get(...)`, then `buffers.own(out)`).
    - `validate`: kernels may check their inputs' values on the host (verification); False in
      production mode, where a host read would break CUDA-graph capture.
    - `graph_safe`: production mode: no host reads, no allocation that depends on values.
    - `engine`: the GEMM engine fixed for this call (production mode resolves it for the token
      bound, as a captured graph fixes it); None lets the backend choose.
    """

    problem: MoEProblem
    inputs: MoEInputs
    upstream: Trace
    rank: int = 0
    buffers: Buffers = NO_BUFFERS
    validate: bool = True
    graph_safe: bool = False
    engine: Engine | None = None
    shard_of: ShardOf | None = field(default=None, compare=False, repr=False)

    def replace(self, **changes: object) -> StageContext:
        """This context with some fields replaced (`ctx.replace(upstream=...)`): how a stage
        hands an inner backend a changed problem or upstream."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @functools.cached_property
    def shard(self) -> RankShard:
        """This rank's weights and expert map, of this context's problem and inputs (so a
        context `replace`d with other inputs has their shard)."""
        if self.shard_of is None:
            raise ValueError(
                "StageContext.shard: this context was built without a rank shard (pass shard_of)"
            )
        return self.shard_of(self.problem, self.inputs, self.rank)
