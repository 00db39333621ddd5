"""Wrong backends for production mode: bugs that live only where one op is called many times on
the same buffers, as a captured CUDA graph is replayed.

Each class is `OptimizedBackend` with one stage method overridden, the way the bug would sit in
a real kernel's host code: the same class `moe-verify run` verifies and `moe-verify graph` runs
inside the op. Eager, host-validated verification (`moe-verify run`) calls a backend once per case
on fresh tensors and cannot see these: `moe-verify graph` must, and the docstring of each names
the stage or guard of moe_verify/production/graph.py that catches it.

StaleCounts lives in moe_verify/examples/stale_counts.py (the README's demo of `graph`). State a
wrong backend keeps across calls lives per rank, keyed by the rank's w13 tensor (as a
layer's persistent buffer lives on the layer), never by address: a later test's tensors may
reuse an address.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from moe_verify.examples import StaleCounts
from moe_verify.spec import StageContext
from optimized import OptimizedBackend
from optimized.backend import Outputs
from optimized.kernels import slot_counts


class ClampedStaleIds(OptimizedBackend):
    """permute: maps the ids through the expert table after clamping them into it
    (`expert_map[ids.clamp(max=E - 1)]`, -1 kept) instead of skipping ids outside it, then
    recounts and scatters the local ids without a map (as vLLM's permute recounts tokens).

    vLLM's test_expert_map_bounds: CUDA-graph padding rows hold stale positive ids (torch.empty
    bit patterns such as 123456789); clamped, they all land on the last expert, which gets rows
    for tokens that do not exist. Full replays have no such ids and pass; replays with padding
    rows (fewer live tokens than the bound) fail at `permute` on the rank hosting the last
    expert (its counts and segments grow). Without an expert map the table is the identity.
    """

    name = "clamped_stale_ids"

    def permute(self, ctx: StageContext) -> Outputs:
        sh = ctx.shard
        ids = ctx.upstream["route"]["topk_ids"].long()
        table = sh.expert_map
        if table is None:
            table = torch.arange(sh.num_local_experts, dtype=torch.int32, device=ids.device)
        mapped = table.long()[ids.clamp(0, table.numel() - 1)]  # the bug: clamp, not skip
        local = torch.where(ids >= 0, mapped, -1).to(torch.int32)
        counts = slot_counts.count_expert_tokens(local, sh.num_local_experts, validate=False)
        # the optimized scatter on the local ids, with no map (the table is already applied)
        up = ctx.upstream.replaced("route", topk_ids=local).replaced("align", counts=counts)
        no_map = dataclasses.replace(sh, expert_map=None)
        return super().permute(ctx.replace(upstream=up, shard_of=lambda *_: no_map))


class CachedOutput(OptimizedBackend):
    """gather: writes every call's output into the tensor it returned from its first call.

    An op that keeps a persistent output buffer to save an allocation: each call overwrites the
    tensor an earlier caller still holds (under a graph, the warm-up call's output, which the
    caller may have handed on). Every value is right, so no stage fails; caught by the
    `no-stale-writes` guard on the first replay (the warm-up output, NaN-filled and kept alive,
    is written again).
    """

    name = "cached_output"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self._out: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def gather(self, ctx: StageContext) -> Outputs:
        out = super().gather(ctx)["out"]
        key = ctx.shard.w13.q
        if key not in self._out:
            self._out[key] = out
            return {"out": out}
        cached = self._out[key]
        cached.copy_(out)
        return {"out": cached}


@dataclass(frozen=True)
class Catch:
    """Where `moe-verify graph` must catch a wrong backend: the topology that reaches its bug
    and, replay by replay (names from `moe_verify.production.graph.default_replays`, run in this
    order),
    the first failure it must report: a stage, a guard, or None where the replay must pass (so
    the check is shown to discriminate). `ranks`: the ranks whose stage fails, where several."""

    backend: type[OptimizedBackend]
    topology: str
    replays: tuple[tuple[str, str | None], ...]
    ranks: tuple[int, ...] | None = None

    @property
    def id(self) -> str:
        return self.backend.name


CATCHES: tuple[Catch, ...] = (
    Catch(
        StaleCounts,
        "tp:1",
        (
            ("capture-softmax", None),  # the warm-up's inputs again: stale counts are right
            ("skew", "permute"),  # a hot expert: the counts changed
            ("skew", None),  # the same inputs again: last call's counts are this call's
        ),
    ),
    Catch(
        ClampedStaleIds,
        "ep:2",  # an expert map to index; the last expert lives on rank 1
        (
            ("capture-softmax", None),  # no padding rows: nothing to clamp
            ("invalid-slots", None),  # -1 slots are not stale ids
            ("half-live", "permute"),  # padding rows hold stale ids
            ("one-live", "permute"),  # all but one row is padding
        ),
        ranks=(1,),
    ),
    Catch(CachedOutput, "tp:1", (("capture-softmax", "no-stale-writes"),)),
)
