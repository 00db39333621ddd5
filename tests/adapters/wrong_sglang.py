"""Wrong variants of SGLang's installed kernels, built at run time (test-the-tester on SGLang).

Each variant is the adapter with one SGLang function wrapped: the wrapper perturbs what the
function receives or returns as its bug would, never copying SGLang's source, and overrides only
the stage its bug lives in, so isolated mode must blame that stage alone.
"""

from __future__ import annotations

import functools
from typing import Any
from unittest import mock

import torch

from moe_verify.adapters.sglang import SglangBackend
from moe_verify.spec import StageContext

Outputs = dict[str, object]


class CountsMissLastSlot(SglangBackend):
    """align: fused_moe_dispatch_index drops the last slot of the flat id list (a `< num_toks - 1`
    bound): its expert's count is one short."""

    def align(self, ctx: StageContext) -> Outputs:
        ep = self.sglang.ep
        count = ep.fused_moe_dispatch_index

        @functools.wraps(count)
        def short(topk_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            ids = topk_ids.clone()
            ids.view(-1)[-1] = -1
            return count(ids, *args, **kwargs)

        with mock.patch.object(ep, "fused_moe_dispatch_index", short):
            return super().align(ctx)


class ScalesOfTheNextToken(SglangBackend):
    """permute: ep_scatter copies each token's fp8 row with the scales of the next token (a row
    offset in the scale loads), so every live row is dequantized with another token's scales."""

    def permute(self, ctx: StageContext) -> Outputs:
        ep = self.sglang.ep
        scatter = ep.ep_scatter

        @functools.wraps(scatter)
        def shifted(x_, s_, *rest: Any, **kwargs: Any) -> None:
            return scatter(x_, torch.roll(s_, -1, 0), *rest, **kwargs)

        with mock.patch.object(ep, "ep_scatter", shifted):
            return super().permute(ctx)


class PaddingRowsClaimed(SglangBackend):
    """permute: pad_expert_counts' padded counts handed to ep_scatter as the valid ones. Every
    padding row of a segment then holds its expert in m_indices: LMDeploy's convention, accepted
    (segment_owned_padding). But the compact layout's slack past the last segment is claimed too,
    by the last expert: a tile of it beyond the segment align's counts give it."""

    def permute(self, ctx: StageContext) -> Outputs:
        ep = self.sglang.ep
        scatter = ep.ep_scatter

        @functools.wraps(scatter)
        def claimed(x_, s_, ids, padded, valid, *rest: Any, **kwargs: Any) -> None:
            return scatter(x_, s_, ids, padded, padded, *rest, **kwargs)

        with mock.patch.object(ep, "ep_scatter", claimed):
            return super().permute(ctx)


class GatherWeightsReversed(SglangBackend):
    """gather: post_reorder_deepgemm reads each token's topk weights in reverse k order."""

    def gather(self, ctx: StageContext) -> Outputs:
        ep = self.sglang.ep
        reorder = ep.post_reorder_deepgemm

        @functools.wraps(reorder)
        def reversed_weights(down, out, src2dst, ids, weights, *rest: Any, **kw: Any) -> None:
            return reorder(down, out, src2dst, ids, weights.flip(1).contiguous(), *rest, **kw)

        with mock.patch.object(ep, "post_reorder_deepgemm", reversed_weights):
            return super().gather(ctx)


class GatherScaledTwice(SglangBackend):
    """gather: routed_scaling_factor applied as 2.0 where the model has none (1.0)."""

    def gather(self, ctx: StageContext) -> Outputs:
        ep = self.sglang.ep
        reorder = ep.post_reorder_deepgemm

        @functools.wraps(reorder)
        def doubled(*args: Any) -> None:
            return reorder(*args[:-1], 2.0)

        with mock.patch.object(ep, "post_reorder_deepgemm", doubled):
            return super().gather(ctx)


class GatherWithoutTheFactor(SglangBackend):
    """gather: post_reorder_deepgemm handed routed_scaling_factor 1.0 where the route's weights
    are unscaled (scale_on_output): the output is short by the factor."""

    def gather(self, ctx: StageContext) -> Outputs:
        ep = self.sglang.ep
        reorder = ep.post_reorder_deepgemm

        @functools.wraps(reorder)
        def unscaled(*args: Any) -> None:
            return reorder(*args[:-1], 1.0)

        with mock.patch.object(ep, "post_reorder_deepgemm", unscaled):
            return super().gather(ctx)


WRONG_VARIANTS: tuple[type[SglangBackend], ...] = (
    CountsMissLastSlot,
    PaddingRowsClaimed,
    ScalesOfTheNextToken,
    GatherWeightsReversed,
    GatherScaledTwice,
    GatherWithoutTheFactor,
)
