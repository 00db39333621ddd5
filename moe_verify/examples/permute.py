"""A permute that swaps two tokens' rows in the permuted buffer (a wrong kernel, for the demo)."""

from __future__ import annotations

import torch

from moe_verify.spec import StageContext
from optimized.backend import OptimizedBackend, Outputs


def row_view(x: torch.Tensor) -> torch.Tensor:
    """A row-indexable view: fp8 as its bytes (index_put has no fp8 kernel), anything else as is."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


class SwappedExpertRows(OptimizedBackend):
    """permute: the rows (data and scales) of two slots of different tokens and experts trade
    places, while m_indices and inv_perm still say where each slot belongs.

    Cross-row corruption in the permuted buffer: huggingface/kernels-community issue #1153 (a
    store spills into the next token's row) and vLLM PR #34991 / rtp-llm PR #1098 (a racy
    segment start sends a row to the wrong place).
    Two slots of one token hold the same bytes, so swapping those would change nothing.
    """

    name = "swapped_expert_rows"

    def permute(self, ctx: StageContext) -> Outputs:
        out = super().permute(ctx)
        inv, m = out["inv_perm"], out["m_indices"]
        (t0, k0), *others = ((int(t), int(k)) for t, k in (inv >= 0).nonzero())
        first = int(inv[t0, k0])
        other = next(int(inv[t, k]) for t, k in others if t != t0 and m[inv[t, k]] != m[first])
        for name in ("a_perm", "a_scale_perm"):
            rows = row_view(out[name])
            rows[[first, other]] = rows[[other, first]]
        return out
