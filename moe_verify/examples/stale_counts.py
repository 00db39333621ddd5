"""A permute that lays its segments out with the previous call's counts (a wrong kernel for
production mode, for the demo): a bug only repeated calls on the same buffers show, as a
captured CUDA graph's replays."""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from moe_verify.spec import MoEInputs, MoEProblem, Trace
from optimized import OptimizedBackend
from optimized.backend import Outputs
from optimized.deepgemm import choose_grouped_layout
from optimized.kernels import scatter
from optimized.topology import Shard


def scatter_with(
    backend: OptimizedBackend,
    problem: MoEProblem,
    upstream: Trace,
    sh: Shard,
    ids: torch.Tensor,
    counts: torch.Tensor,
    expert_map: torch.Tensor | None,
) -> Outputs:
    """The permute stage's outputs under the contract's names (as OptimizedBackend.permute),
    scattered with the given ids, counts and map."""
    q, align = upstream["quant_input"], upstream["align"]
    a1q, m_sum = q["a1q"], align["M_sum"]
    out = scatter.ep_scatter(
        a1q,
        q["a1q_scale"],
        ids,
        counts,
        sh.num_local_experts,
        align["alignment"],
        m_sum,
        expert_map,
        validate=backend.validate,
        a_perm_out=backend.workspaces.get("a_perm", (m_sum, a1q.shape[1]), a1q.dtype, a1q.device),
    )
    return {
        "a_perm": backend.workspaces.own(out.a_perm),
        "a_scale_perm": out.a_scale_perm,
        "m_indices": out.m_indices,
        "expert_ends": out.expert_ends,
        "inv_perm": out.inv_perm,
        "expert_start": out.expert_start,
        "layout": choose_grouped_layout(problem).layout.value,
    }


class StaleCounts(OptimizedBackend):
    """permute: lays the expert segments out with the per-expert counts of the PREVIOUS call.

    A stale-metadata bug: a kernel keeps the counts in a persistent buffer and refreshes it after
    the scatter instead of before (or a graph captured the buffer of an earlier call), so each
    call reads the last call's counts. The first call uses its own counts; a replay with the
    counts of the call before it (the capture replays the warm-up's inputs) is right, any replay
    whose counts changed is not. Caught at `permute` (expert_start / expert_ends / m_indices and
    inv_perm disagree with the golden's plan). Stays in bounds: the stale counts sum to at most
    T*k, so their segments fit the M_sum bound, and the scatter drops claims past a segment.

    State lives per rank, keyed by the rank's w13 tensor (as a layer's persistent buffer lives on
    the layer), never by address: a later case's tensors may reuse an address.
    """

    name = "stale_counts"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self._previous: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def permute(
        self, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int
    ) -> Outputs:
        sh = self.shard(problem, inputs, rank)
        counts = upstream["align"]["counts"]
        if sh.w13.q not in self._previous:
            self._previous[sh.w13.q] = counts.clone()  # the first call has no earlier counts
        stale = self._previous[sh.w13.q]
        ids = upstream["route"]["topk_ids"]
        out = scatter_with(self, problem, upstream, sh, ids, stale, sh.expert_map)
        stale.copy_(counts)  # the bug: refreshed after the scatter read it
        return out
