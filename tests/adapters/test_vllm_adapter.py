"""The adapter's own logic, without vLLM: how `--backend vllm` reports a vLLM it cannot load (its
release window: tests/adapters/test_adapter_windows.py)."""

from __future__ import annotations

import pytest

from moe_verify.adapters import vllm as adapter
from moe_verify.run.runner import resolve_backend

pytestmark = pytest.mark.cpu


def test_backend_vllm_says_why_it_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> adapter.VllmKernels:
        raise adapter.VllmUnavailable("vLLM is not installed (test)")

    monkeypatch.setattr(adapter, "load", missing)
    with pytest.raises(ValueError, match=r"backend 'vllm': vLLM is not installed \(test\)"):
        resolve_backend("vllm")
