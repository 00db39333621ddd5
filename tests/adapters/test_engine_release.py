"""Which release each engine tier ran, and on what evidence: the adapter loads the installed
release (the package and dist-info first on sys.path), admits it on its evidence
(moe_verify/adapters/releases.py), and the kernel sources it hashed for that are the modules it
imported. A CI step that installs a given release says which (MOE_VERIFY_EXPECT_VLLM,
MOE_VERIFY_EXPECT_SGLANG, MOE_VERIFY_EXPECT_LMDEPLOY), so a step meant to verify vLLM 0.34 cannot
pass on 0.32 by accident; with it set, conftest runs the tier even where the adapter refuses the
release, so a refusal fails the step instead of skipping it."""

from __future__ import annotations

import importlib
import os
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest

from moe_verify.adapters.common import package_dir
from moe_verify.adapters.releases import module_source
from moe_verify.run.runner import ADAPTERS

ENGINES = [pytest.param(key, marks=getattr(pytest.mark, key), id=key) for key in ADAPTERS]


def _adapter(key: str) -> ModuleType:
    return importlib.import_module(f"moe_verify.adapters.{ADAPTERS[key][0]}")


@pytest.mark.parametrize("key", ENGINES)
def test_the_adapter_loads_the_installed_release_on_its_evidence(key: str) -> None:
    adapter = _adapter(key)
    kernels = adapter.load()
    assert kernels.version == adapter.installed_version()
    assert kernels.evidence.tested, f"{key} {kernels.version}: {kernels.evidence}"
    assert kernels.evidence.release == kernels.version
    expected = os.environ.get(f"MOE_VERIFY_EXPECT_{key.upper()}")
    if expected is not None:
        assert kernels.version == expected, f"expected {key} {expected}, loaded {kernels.version}"


@pytest.mark.vllm
def test_tested_means_admitted_on_evidence() -> None:
    """vLLM's `tested` (its stages declare the recipe they run) holds exactly for a release
    admitted on evidence, never for one run on the opt-in."""
    from moe_verify.adapters.vllm import VllmBackend, load

    kernels = load()
    assert kernels.tested is kernels.evidence.tested is True
    assert VllmBackend().declares_recipes is True


@pytest.mark.parametrize("key", ENGINES)
def test_the_hashed_kernel_sources_are_the_imported_modules(key: str) -> None:
    """The files the evidence was computed from are the files the adapter runs."""
    adapter = _adapter(key)
    kernels = adapter.load()
    window = adapter.WINDOW
    root = package_dir(window.package, RuntimeError)
    for attr, (name, _) in adapter._MODULES.items():
        assert module_source(name) in window.sources, name
        assert Path(getattr(kernels, attr).__file__) == root / module_source(name)


@pytest.mark.parametrize("key", ENGINES)
def test_the_kernel_modules_come_from_the_installed_distribution(key: str) -> None:
    adapter = _adapter(key)
    kernels = adapter.load()
    dist = next(d for d in adapter.WINDOW.dists if _version(d) == kernels.version)
    files = {str(f) for f in metadata.files(dist) or ()}
    for attr in adapter._MODULES:
        path = getattr(kernels, attr).__file__
        assert any(path.endswith(f) for f in files), f"{path} is not a file of {dist}"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
