"""The SGLang adapter's own logic, without SGLang (its release window:
tests/adapters/test_adapter_windows.py): the torchvision stand-in, the tight M_sum recipe it
declares, the expert range it hands ep_scatter, and how `--backend sglang` reports an SGLang it
cannot load."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
import torch

from moe_verify.adapters import sglang as adapter
from moe_verify.run.runner import resolve_backend
from moe_verify.spec import MoEProblem, StageSkipped, Topology
from reference.layout import aligned_m_sum_exact, aligned_m_sum_recipes, aligned_m_sum_tight_bound

pytestmark = pytest.mark.cpu

NO_TORCHVISION = pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed here"
)


def _package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> str:
    """A module `name` (in a package of its own, first on sys.path) whose source is `source`."""
    package = tmp_path / f"pkg_{name}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"pkg_{name}.{name}"


@NO_TORCHVISION
def test_torchvision_is_stood_in_while_the_kernel_modules_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As SGLang 0.5.20's sglang/srt/utils/common.py imports it: the import succeeds, the switch
    says so, the stand-in is gone afterwards and raises if called."""
    name = _package(tmp_path, monkeypatch, "uses_tv", "from torchvision.io import decode_jpeg\n")
    switches: list[str] = []
    with adapter._torchvision_stand_in(switches):
        module = importlib.import_module(name)
    assert "torchvision" not in sys.modules and "torchvision.io" not in sys.modules
    assert len(switches) == 1 and "stand-in torchvision.io served decode_jpeg" in switches[0]
    assert "never calls it" in switches[0]
    with pytest.raises(RuntimeError, match="torchvision is not installed"):
        module.decode_jpeg(b"")


@NO_TORCHVISION
def test_no_torchvision_switch_where_nothing_imports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _package(tmp_path, monkeypatch, "plain", "import math\n")
    switches: list[str] = []
    with adapter._torchvision_stand_in(switches):
        importlib.import_module(name)
    assert switches == [] and "torchvision" not in sys.modules


@NO_TORCHVISION
def test_the_stand_in_serves_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _package(tmp_path, monkeypatch, "wants_more", "from torchvision.io import read_image\n")
    with pytest.raises(ImportError, match="read_image"), adapter._torchvision_stand_in([]):
        importlib.import_module(name)
    assert "torchvision" not in sys.modules


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
