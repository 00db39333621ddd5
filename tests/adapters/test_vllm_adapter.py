"""The adapter's own logic, without vLLM: the version gate and how `--backend vllm` reports a vLLM
it cannot load."""

from __future__ import annotations

import pytest

from moe_verify.adapters import vllm as adapter
from moe_verify.run.runner import resolve_backend

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize(
    ("version", "tested"),
    [
        ("0.32.0", True),
        ("0.32.1.dev3+gabc", True),
        ("0.33.0", True),  # its DeepGEMM MoE kernels are 0.32's (moe_verify/adapters/vllm.py)
        ("0.20.0", False),
        ("0.27.2", False),
    ],
)
def test_known_releases_are_accepted(version: str, tested: bool) -> None:
    assert adapter.check_version(version) is tested


def test_releases_before_the_experts_layout_are_refused() -> None:
    with pytest.raises(adapter.VllmUnavailable, match="before 0.20 keep .* fused_moe/deep_gemm"):
        adapter.check_version("0.19.1")


def test_newer_releases_need_an_explicit_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(adapter.UNTESTED_ENV, raising=False)
    with pytest.raises(adapter.VllmUnavailable, match=adapter.UNTESTED_ENV):
        adapter.check_version("0.34.0.dev12+g1234abc")
    monkeypatch.setenv(adapter.UNTESTED_ENV, "1")
    assert adapter.check_version("0.34.0.dev12+g1234abc") is False


def test_an_unreadable_version_is_refused() -> None:
    with pytest.raises(adapter.VllmUnavailable, match="cannot read"):
        adapter.check_version("main")


def test_backend_vllm_says_why_it_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> adapter.VllmKernels:
        raise adapter.VllmUnavailable("vLLM is not installed (test)")

    monkeypatch.setattr(adapter, "load", missing)
    with pytest.raises(ValueError, match=r"backend 'vllm': vLLM is not installed \(test\)"):
        resolve_backend("vllm")
