"""A rank that hosts no expert (more EP ranks than experts): the kernels take E_local = 0 and
produce the padding-only layout instead of refusing it or launching a faulting kernel."""

from __future__ import annotations

import pytest
import torch

from optimized.kernels.grouped_gemm import grouped_gemm
from optimized.kernels.scatter import ep_scatter
from optimized.kernels.slot_counts import aligned_m_sum_upper_bound, count_expert_tokens

pytestmark = pytest.mark.cpu


def test_scatter_with_no_local_experts_skips_every_slot() -> None:
    ids = torch.tensor([[0, 3], [5, -1], [2, 1]], dtype=torch.int32)
    emap = torch.full((6,), -1, dtype=torch.int32)  # all six experts live on other ranks
    counts = count_expert_tokens(ids, 0, emap)
    assert counts.shape == (0,)
    m_sum = aligned_m_sum_upper_bound(3, 2, 0, 32)
    a1q = torch.randn(3, 128).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 1)
    out = ep_scatter(a1q, scale, ids, counts, 0, 32, m_sum, emap)
    assert m_sum == 32 and out.expert_start.shape == out.expert_ends.shape == (0,)
    assert bool((out.m_indices == -1).all()) and bool((out.inv_perm == -1).all())
    assert not out.a_perm.view(torch.uint8).any() and not out.a_scale_perm.any()


def test_grouped_gemm_with_no_experts_writes_zero_padding_rows() -> None:
    a = torch.randn(32, 128).to(torch.float8_e4m3fn)
    b = torch.zeros(0, 128, 128).to(torch.float8_e4m3fn)
    out = grouped_gemm(
        a,
        torch.ones(32, 1),
        128,
        b,
        torch.ones(0, 1, 1),
        (128, 128),
        torch.full((32,), -1, dtype=torch.int32),
        32,
    )
    assert out.shape == (32, 128) and not out.any()
    psum = grouped_gemm(
        a, torch.ones(32, 1), 128, b, torch.ones(0, 1, 1), (128, 128),
        torch.zeros(0, dtype=torch.int32), 32, use_psum_layout=True,
    )  # fmt: skip
    assert psum.shape == (32, 128) and not psum.any()  # no expert: no psum segment either


def test_no_experts_still_rejects_a_live_id() -> None:
    ids = torch.tensor([[0]], dtype=torch.int32)  # no map: id 0 would be a local expert
    with pytest.raises(ValueError, match="topk_ids"):
        count_expert_tokens(ids, 0)
