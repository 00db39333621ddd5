"""Each adapter's release window without its engine (moe_verify/adapters/releases.py holds the
mechanism, tests/adapters/test_releases.py tests it): the recorded evidence covers the kernel
sources the adapter reads, a release outside it is refused naming the engine's one opt-in (the
existing variable names kept, LMDeploy's new), the opt-in runs it untested, and vLLM refuses a
release older than the layout it knows even then."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest

from moe_verify.adapters import vllm
from moe_verify.adapters.releases import Evidence, EvidenceKind
from moe_verify.run.runner import ADAPTERS

pytestmark = pytest.mark.cpu

OPT_INS = {
    "vllm": "MOE_VERIFY_VLLM_UNTESTED",
    "sglang": "MOE_VERIFY_SGLANG_UNTESTED",
    "lmdeploy": "MOE_VERIFY_LMDEPLOY_UNTESTED",
}
SHA256 = re.compile(r"[0-9a-f]{64}")


def _adapter(key: str) -> ModuleType:
    return importlib.import_module(f"moe_verify.adapters.{ADAPTERS[key][0]}")


@pytest.mark.parametrize("key", list(ADAPTERS))
def test_each_engine_has_one_opt_in_named_after_it(key: str) -> None:
    adapter = _adapter(key)
    assert adapter.UNTESTED_ENV == adapter.WINDOW.untested_env == OPT_INS[key]


@pytest.mark.parametrize("key", list(ADAPTERS))
def test_every_recorded_tier_covers_the_kernel_sources_the_adapter_reads(key: str) -> None:
    """A source added to the adapter without re-recording the tiers' digests fails here."""
    window = _adapter(key).WINDOW
    assert window.tiers, f"{key}: no release whose tier passed is recorded"
    for tier in window.tiers:
        assert sorted(tier.sources) == sorted(window.sources), (key, tier.release)
        assert all(d is None or SHA256.fullmatch(d) for d in tier.sources.values()), tier.release
        assert tier.where and "<" not in tier.where, (key, tier.release, tier.where)
    tiers = {t.release for t in window.tiers}
    assert set(window.identical.values()) <= tiers, window.identical


@pytest.mark.parametrize("key", list(ADAPTERS))
def test_a_release_outside_the_window_is_refused_naming_the_opt_in(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = _adapter(key)
    monkeypatch.delenv(OPT_INS[key], raising=False)
    unavailable = getattr(adapter, ADAPTERS[key][2])
    with pytest.raises(unavailable) as refused:
        adapter.check_version("9.9.9", root=tmp_path)  # no kernel source at all
    message = str(refused.value)
    assert message.startswith(f"{adapter.WINDOW.engine} 9.9.9 is outside the adapter's window")
    assert f"set {OPT_INS[key]}=1 to run it anyway" in message
    newest = adapter.WINDOW.tiers[0].release
    assert newest in message


@pytest.mark.parametrize("key", list(ADAPTERS))
def test_the_opt_in_runs_it_untested(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = _adapter(key)
    monkeypatch.setenv(OPT_INS[key], "1")
    evidence = adapter.check_version("9.9.9", root=tmp_path)
    assert evidence.kind is EvidenceKind.OPTED_IN and not evidence.tested


@pytest.mark.parametrize("key", list(ADAPTERS))
def test_an_unreadable_version_is_refused(key: str, tmp_path: Path) -> None:
    adapter = _adapter(key)
    with pytest.raises(getattr(adapter, ADAPTERS[key][2]), match="cannot read"):
        adapter.check_version("main", root=tmp_path)


@pytest.mark.parametrize("version", ["0.19.1", "0.8.5"])
def test_vllm_before_the_experts_layout_is_refused_even_opted_in(
    version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(vllm.UNTESTED_ENV, "1")
    with pytest.raises(vllm.VllmUnavailable, match="too old: releases before 0.20 keep .* fused"):
        vllm.check_version(version, root=tmp_path)


def test_an_opted_in_vllm_declares_no_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tested` (the stages name the recipe they run) is the evidence's: never on the opt-in."""
    stub = ModuleType("stub")
    kernels = {attr: stub for attr in vllm._MODULES}

    def loaded(kind: EvidenceKind) -> vllm.VllmKernels:
        evidence = Evidence(kind, "9.9.9", vllm.WINDOW.tiers[0], vllm.UNTESTED_ENV)
        return vllm.VllmKernels(
            version="9.9.9",
            evidence=evidence,
            has_deep_gemm=False,
            on_cuda=False,
            compiled_quant=False,
            switches=(),
            **kernels,
        )

    for kind, declares in ((EvidenceKind.OPTED_IN, False), (EvidenceKind.IDENTICAL_KERNELS, True)):
        monkeypatch.setattr(vllm, "load", lambda kind=kind: loaded(kind))
        backend = vllm.VllmBackend()
        assert backend.vllm.tested is declares and backend.declares_recipes is declares
