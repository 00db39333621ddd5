"""The SGLang adapter's own logic, without SGLang: the version gate, the tight M_sum recipe it
declares, the expert range it hands ep_scatter, and how `--backend sglang` reports an SGLang it
cannot load."""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_verify.adapters import sglang as adapter
from moe_verify.run.runner import resolve_backend
from moe_verify.spec import MoEProblem, StageSkipped, Topology
from reference.layout import aligned_m_sum_exact, aligned_m_sum_recipes, aligned_m_sum_tight_bound

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23+cu129"])
def test_the_tested_release_is_accepted(version: str) -> None:
    adapter.check_version(version)


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.6.0"])
def test_other_releases_need_an_explicit_opt_in(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(adapter.UNTESTED_ENV, raising=False)
    with pytest.raises(adapter.SglangUnavailable, match=adapter.UNTESTED_ENV):
        adapter.check_version(version)
    monkeypatch.setenv(adapter.UNTESTED_ENV, "1")
    adapter.check_version(version)


def test_an_unreadable_version_is_refused() -> None:
    with pytest.raises(adapter.SglangUnavailable, match="cannot read"):
        adapter.check_version("main")


def test_backend_sglang_says_why_it_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> adapter.SglangKernels:
        raise adapter.SglangUnavailable("SGLang is not installed (test)")

    monkeypatch.setattr(adapter, "load", missing)
    with pytest.raises(ValueError, match=r"backend 'sglang': SGLang is not installed \(test\)"):
        resolve_backend("sglang")


@pytest.mark.parametrize(("slots", "experts", "a"), [(24, 8, 128), (6, 8, 128), (300, 4, 128)])
def test_the_tight_bound_is_the_largest_exact_sum(slots: int, experts: int, a: int) -> None:
    """Over every way to spread `slots` over `experts` (coarsely), the exact sum never exceeds the
    tight bound, and some spread reaches it."""
    tight = aligned_m_sum_tight_bound(slots, 1, experts, a)
    best = 0
    step = max(1, slots // 12)
    for head in itertools.product(range(0, slots + 1, step), repeat=min(experts, 3) - 1):
        rest = slots - sum(head)
        if rest < 0:
            continue
        counts = torch.tensor([*head, rest] + [0] * (experts - len(head) - 1))
        best = max(best, aligned_m_sum_exact(counts, a))
    active = min(slots, experts)  # one slot each on `active` experts, the rest on one
    spread = torch.tensor([1] * (active - 1) + [slots - active + 1] + [0] * (experts - active))
    best = max(best, aligned_m_sum_exact(spread, a))
    assert best <= tight and tight % a == 0
    assert aligned_m_sum_exact(spread, a) == tight
    recipes = aligned_m_sum_recipes(slots, 1, spread, a)
    assert recipes["tight_bound"] == tight <= recipes["min_active_bound"]


def test_expert_start_is_the_ranks_first_expert() -> None:
    p = MoEProblem(tokens=4, hidden=256, intermediate=256, num_experts=8, topk=2)
    assert adapter.expert_start(p, tuple(range(8)), 0) == 0
    ep = p.replace(topology=Topology.parse("ep:4"))
    assert adapter.expert_start(ep, (6, 7), 3) == 6


def test_a_scattered_expert_range_is_refused() -> None:
    p = MoEProblem(
        tokens=4, hidden=256, intermediate=256, num_experts=8, topk=2,
        topology=Topology.parse("ep:2"),
    )  # fmt: skip
    with pytest.raises(StageSkipped, match="contiguous expert range"):
        adapter.expert_start(p, (1, 3, 5, 7), 1)
