"""The LMDeploy adapter's own logic, without LMDeploy (its release window:
tests/adapters/test_adapter_windows.py): the DeepEP inputs it hands the kernels (aligned counts,
local ids), and how `--backend lmdeploy` reports an LMDeploy it cannot load."""

from __future__ import annotations

import pytest
import torch

from moe_verify.adapters import lmdeploy as adapter
from moe_verify.run.runner import resolve_backend

pytestmark = pytest.mark.cpu


def test_backend_lmdeploy_says_why_it_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> adapter.LmdeployKernels:
        raise adapter.LmdeployUnavailable("LMDeploy is not installed (test)")

    monkeypatch.setattr(adapter, "load", missing)
    with pytest.raises(ValueError, match=r"backend 'lmdeploy': LMDeploy is not installed"):
        resolve_backend("lmdeploy")


def test_counts_are_aligned_as_deepep_hands_them() -> None:
    counts = torch.tensor([0, 1, 128, 129], dtype=torch.int32)
    got = adapter.aligned_counts(counts, 128)
    assert got.dtype == torch.int32
    assert got.tolist() == [0, 128, 128, 256]


def test_local_ids_follow_the_expert_map() -> None:
    ids = torch.tensor([[0, 5], [-1, 3]], dtype=torch.int32)
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)  # rank 1 of ep:2
    assert adapter.local_ids(ids, expert_map).tolist() == [[-1, 1], [-1, -1]]
    assert adapter.local_ids(ids, None).tolist() == [[0, 5], [-1, 3]]
    assert adapter.local_ids(ids, None).dtype == torch.int64
