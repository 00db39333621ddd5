"""A permute that lays its segments out with the previous call's counts (a wrong kernel for
production mode, for the demo): a bug only repeated calls on the same buffers show, as a
captured CUDA graph's replays."""

from __future__ import annotations

from torch.utils.weak import WeakIdKeyDictionary

from moe_verify.spec import Engine, Outputs, StageContext
from optimized import OptimizedBackend


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
    the layer), never by address: a later case's tensors may reuse an address. The scatter is
    the optimized path's own, handed an upstream whose counts are the stale ones.
    """

    name = "stale_counts"

    def __init__(self, engine: Engine | str = Engine.AUTO) -> None:
        super().__init__(engine=engine)
        self._previous: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def permute(self, ctx: StageContext) -> Outputs:
        w13 = ctx.shard.w13.q
        counts = ctx.upstream["align"]["counts"]
        if w13 not in self._previous:
            self._previous[w13] = counts.clone()  # the first call has no earlier counts
        stale = self._previous[w13]
        out = super().permute(ctx.replace(upstream=ctx.upstream.replaced("align", counts=stale)))
        stale.copy_(counts)  # the bug: refreshed after the scatter read it
        return out
