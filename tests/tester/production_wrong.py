"""Wrong production forwards: bugs that live only where one op is called many times on the same
buffers, as a captured CUDA graph is replayed.

Each class is `ProductionForward` with one stage method overridden, the way the bug would sit in
a real kernel's host code. Eager, host-validated verification (`moe-verify run`) calls a forward
once per case on fresh tensors and cannot see these: `moe-verify graph` must, and the docstring
of each names the stage or guard of moe_verify/graph.py that catches it.

State a wrong forward keeps across calls lives per rank, keyed by the rank's w13 tensor (as a
layer's persistent buffer lives on the layer), never by address: a later test's tensors may
reuse an address.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from optimized.kernels import scatter
from optimized.production import ForwardConfig, Outputs, ProductionForward, RankWeights, Taps


def _scattered_outputs(cfg: ForwardConfig, out: scatter.Scattered) -> Outputs:
    """The permute stage's outputs under the contract's names (as ProductionForward.permute)."""
    return {
        "a_perm": out.a_perm,
        "a_scale_perm": out.a_scale_perm,
        "m_indices": out.m_indices,
        "expert_ends": out.expert_ends,
        "inv_perm": out.inv_perm,
        "expert_start": out.expert_start,
        "layout": cfg.layout,
    }


class StaleCounts(ProductionForward):
    """permute: lays the expert segments out with the per-expert counts of the PREVIOUS call.

    A stale-metadata bug: a kernel keeps the counts in a persistent buffer and refreshes it after
    the scatter instead of before (or a graph captured the buffer of an earlier call), so each
    call reads the last call's counts. The first call uses its own counts; a replay with the
    counts of the call before it (the capture replays the warm-up's inputs) is right, any replay
    whose counts changed is not. Caught at `permute` (expert_start / expert_ends / m_indices and
    inv_perm disagree with the golden's plan). Stays in bounds: the stale counts sum to at most
    T*k, so their segments fit the M_sum bound, and the scatter drops claims past a segment.
    """

    name = "stale_counts"

    def __init__(self) -> None:
        super().__init__()
        self._previous: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def permute(
        self, cfg: ForwardConfig, hidden: torch.Tensor, w: RankWeights, up: Taps
    ) -> Outputs:
        q, align = up["quant_input"], up["align"]
        counts = align["counts"]
        if w.w13.q not in self._previous:
            self._previous[w.w13.q] = counts.clone()  # the first call has no earlier counts
        stale = self._previous[w.w13.q]
        m_sum = align["M_sum"]
        out = scatter.ep_scatter(
            q["a1q"],
            q["a1q_scale"],
            up["route"]["topk_ids"],
            stale,
            cfg.num_local_experts,
            cfg.alignment,
            m_sum,
            w.expert_map,
            validate=False,
            a_perm_out=self.buffers(m_sum)["a_perm"],
        )
        stale.copy_(counts)  # the bug: refreshed after the scatter read it
        return _scattered_outputs(cfg, out)


class ClampedStaleIds(ProductionForward):
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

    def permute(
        self, cfg: ForwardConfig, hidden: torch.Tensor, w: RankWeights, up: Taps
    ) -> Outputs:
        q, align = up["quant_input"], up["align"]
        ids = up["route"]["topk_ids"].long()
        table = w.expert_map
        if table is None:
            table = torch.arange(cfg.num_local_experts, dtype=torch.int32, device=ids.device)
        mapped = table.long()[ids.clamp(0, table.numel() - 1)]  # the bug: clamp, not skip
        local = torch.where(ids >= 0, mapped, -1).to(torch.int32)
        counts = scatter.count_expert_tokens(local, cfg.num_local_experts, validate=False)
        m_sum = align["M_sum"]
        out = scatter.ep_scatter(
            q["a1q"],
            q["a1q_scale"],
            local,
            counts,
            cfg.num_local_experts,
            cfg.alignment,
            m_sum,
            None,
            validate=False,
            a_perm_out=self.buffers(m_sum)["a_perm"],
        )
        return _scattered_outputs(cfg, out)


class CachedOutput(ProductionForward):
    """gather: writes every call's output into the tensor it returned from its first call.

    An op that keeps a persistent output buffer to save an allocation: each call overwrites the
    tensor an earlier caller still holds (under a graph, the warm-up call's output, which the
    caller may have handed on). Every value is right, so no stage fails; caught by the
    `no-stale-writes` guard on the first replay (the warm-up output, NaN-filled and kept alive,
    is written again).
    """

    name = "cached_output"

    def __init__(self) -> None:
        super().__init__()
        self._out: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def gather(self, cfg: ForwardConfig, hidden: torch.Tensor, w: RankWeights, up: Taps) -> Outputs:
        out = super().gather(cfg, hidden, w, up)["out"]
        if w.w13.q not in self._out:
            self._out[w.w13.q] = out
            return {"out": out}
        cached = self._out[w.w13.q]
        cached.copy_(out)
        return {"out": cached}


@dataclass(frozen=True)
class Catch:
    """Where `moe-verify graph` must catch a wrong forward: the topology that reaches its bug
    and, replay by replay (names from `moe_verify.graph.default_replays`, run in this order),
    the first failure it must report: a stage, a guard, or None where the replay must pass (so
    the check is shown to discriminate). `ranks`: the ranks whose stage fails, where several."""

    forward: type[ProductionForward]
    topology: str
    replays: tuple[tuple[str, str | None], ...]
    ranks: tuple[int, ...] | None = None

    @property
    def id(self) -> str:
        return self.forward.name


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
