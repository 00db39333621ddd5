"""Which DeepGEMM optimized/deepgemm (loading.py, status.py) takes, on fake packages in
temporary directories: an installed standalone `deep_gemm` first, else the copy vLLM's wheel
bundles (`vllm/third_party/deep_gemm`, DeepGEMM 2.8.1 in vLLM 0.33), loaded without running vLLM's
own __init__; `probe()` names the one it took (source, version, location), also where it cannot
load.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from optimized import deepgemm
from optimized.deepgemm import loading
from optimized.deepgemm import status as deepgemm_status

pytestmark = pytest.mark.cpu

API = "\n".join(f"def {name}(*args, **kwargs): pass" for name in deepgemm.REQUIRED_API)
# vLLM's own __init__ is heavy and may fail; the bundled copy must load without it.
VLLM_INIT = "raise RuntimeError('vllm/__init__.py ran')\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def standalone(root: Path, version: str = "2.6.1", body: str = API) -> Path:
    """A fake installed `deep_gemm` under `root`; its package directory."""
    _write(root / "deep_gemm" / "__init__.py", f"{body}\n__version__ = {version!r}\n")
    return root / "deep_gemm"


def bundled(root: Path, extension: str = "loaded = True", vllm_init: str = VLLM_INIT) -> Path:
    """A fake vLLM under `root` whose wheel bundles DeepGEMM 2.8.1 as vLLM 0.33's does: relative
    imports of its own submodules, the extension loaded from `_C`, `__version__` set last; its
    package directory."""
    package = root / "vllm" / "third_party" / "deep_gemm"
    _write(root / "vllm" / "__init__.py", vllm_init)
    _write(root / "vllm" / "third_party" / "__init__.py", "")
    _write(package / "_C.py", f"{extension}\n")
    _write(package / "__init__.py", f"from . import _C\n{API}\n__version__ = '2.8.1'\n")
    return package


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A clean slate: no deep_gemm or vllm imported, an SM90 GPU as far as the probe can tell,
    and the probe's cache cleared before and after. Yields a directory for fake packages."""

    def ours(name: str) -> bool:
        return name.split(".")[0] in ("deep_gemm", "vllm")

    for name in [n for n in sys.modules if ours(n)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(deepgemm_status, "cc_major", lambda: 9)
    deepgemm.probe.cache_clear()
    yield tmp_path
    deepgemm.probe.cache_clear()
    for name in [n for n in sys.modules if ours(n)]:
        del sys.modules[name]


def _on_path(monkeypatch: pytest.MonkeyPatch, *roots: Path) -> None:
    for root in reversed(roots):
        monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()


def test_a_standalone_deep_gemm_comes_first(machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = standalone(machine / "site")
    theirs = bundled(machine / "vllm-wheel")
    _on_path(monkeypatch, machine / "site", machine / "vllm-wheel")
    found = deepgemm.find_deepgemm()
    assert [(f.source, f.location, f.version) for f in found] == [
        ("standalone", mine, "2.6.1"),
        ("vllm-bundled", theirs, "2.8.1"),
    ]
    status = deepgemm.probe()
    assert status.usable, status.reason
    assert (status.source, status.version, status.location) == ("standalone", "2.6.1", str(mine))
    assert status.module is sys.modules["deep_gemm"] and "standalone" in status.reason
    assert "vllm" not in sys.modules


def test_vllms_bundled_copy_loads_without_vllms_init(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = bundled(machine)
    _on_path(monkeypatch, machine)
    status = deepgemm.probe()
    assert status.usable, status.reason
    assert (status.source, status.version, status.location) == (
        "vllm-bundled",
        "2.8.1",
        str(theirs),
    )
    assert status.module is sys.modules["vllm.third_party.deep_gemm"]
    assert status.module._C.loaded  # its own submodule, by its relative import
    assert not {"vllm", "vllm.third_party", "deep_gemm"} & set(sys.modules)
    assert deepgemm.module() is status.module


def test_once_vllm_is_imported_the_bundled_copy_is_its_own(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundled(machine, vllm_init="")
    _on_path(monkeypatch, machine)
    vllm = importlib.import_module("vllm")
    status = deepgemm.probe()
    assert status.usable and status.source == "vllm-bundled", status.reason
    assert status.module is importlib.import_module("vllm.third_party.deep_gemm")
    assert sys.modules["vllm"] is vllm


def test_a_bundled_copy_that_cannot_load_says_which_and_why(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a CPU machine: the extension needs CUDA's libraries. The version still shows (read
    from its __init__.py), and nothing of the half-loaded package stays imported."""
    failing = "raise OSError('libc10_cuda.so: cannot open shared object file')"
    theirs = bundled(machine, extension=failing)
    _on_path(monkeypatch, machine)
    status = deepgemm.probe()
    assert not status.usable and status.module is None
    assert (status.source, status.version, status.location) == (
        "vllm-bundled",
        "2.8.1",
        str(theirs),
    )
    assert f"vllm-bundled deep_gemm 2.8.1 at {theirs} failed to load: OSError: " in status.reason
    assert "libc10_cuda.so" in status.reason
    assert not [n for n in sys.modules if n.startswith(("vllm", "deep_gemm"))]
    with pytest.raises(deepgemm.DeepGemmUnavailable, match="failed to load"):
        deepgemm.module()


def test_a_standalone_that_does_not_import_falls_back_to_the_bundled_copy(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's order: an ImportError of the installed deep_gemm sends it to its own copy."""
    standalone(machine / "site", body="import no_such_module_of_deep_gemm")
    bundled(machine / "vllm-wheel")
    _on_path(monkeypatch, machine / "site", machine / "vllm-wheel")
    status = deepgemm.probe()
    assert status.usable and status.source == "vllm-bundled", status.reason


def test_an_old_standalone_is_taken_and_refused_with_its_source(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As vLLM would: the installed package is taken even when too old; the reason says which."""
    old = standalone(
        machine, version="1.0.0", body="def m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(): pass"
    )
    _on_path(monkeypatch, machine)
    status = deepgemm.probe()
    assert not status.usable and (status.source, status.version) == ("standalone", "1.0.0")
    assert f"(standalone, {old}) is unusable" in status.reason and "PyPI" in status.reason


def test_without_a_gpu_the_probe_still_names_the_deepgemm_found(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = bundled(machine)
    _on_path(monkeypatch, machine)
    monkeypatch.setattr(deepgemm_status, "cc_major", lambda: None)
    status = deepgemm.probe()
    assert not status.usable and "no CUDA GPU" in status.reason
    assert (status.source, status.version, status.location) == (
        "vllm-bundled",
        "2.8.1",
        str(theirs),
    )
    assert "vllm.third_party.deep_gemm" not in sys.modules  # found, not imported


def test_neither_installed(machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _on_path(monkeypatch, machine)
    monkeypatch.setattr(loading, "_package_dir", lambda name: None)  # whatever this venv has
    status = deepgemm.probe()
    assert not status.usable and status.source is None and status.location is None
    assert "deep_gemm is not installed, and no vLLM bundles it" in status.reason
