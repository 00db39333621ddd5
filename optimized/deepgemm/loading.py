"""Where DeepGEMM comes from, found the way vLLM finds it: an installed standalone `deep_gemm`
first, else the copy vLLM's wheel bundles as `vllm.third_party.deep_gemm` (vLLM 0.33 ships
DeepGEMM 2.8.1 there), loaded without running vLLM's own __init__.

Finding reads directories only; importing is `import_found`, which `status.probe` calls.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

# Where DeepGEMM is found, in the order vLLM 0.33 looks (vllm/utils/deep_gemm.py
# `_import_deep_gemm`): an installed `deep_gemm` first, then the copy vLLM's wheel bundles.
STANDALONE, VLLM_BUNDLED = "standalone", "vllm-bundled"
SOURCES = (STANDALONE, VLLM_BUNDLED)
BUNDLED_MODULE = "vllm.third_party.deep_gemm"
_VERSION_LINE = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", re.MULTILINE)


@dataclass(frozen=True)
class Found:
    """A DeepGEMM that can be imported, not yet imported: its source (SOURCES), the module name
    it imports as, its package directory, and the version its __init__.py states (None where it
    does not state it literally)."""

    source: str
    name: str
    location: Path
    version: str | None


def _stated_version(package: Path) -> str | None:
    """`__version__ = '...'` from the package's __init__.py, read without importing it (vLLM's
    bundled copy sets it last, after loading its extension: a copy that cannot load still says
    which it is)."""
    try:
        match = _VERSION_LINE.search((package / "__init__.py").read_text(errors="replace"))
    except OSError:
        return None
    return match.group(1) if match else None


def _package_dir(name: str) -> Path | None:
    """The directory of the top-level package `name`, found without importing it (None: not
    installed)."""
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__spec__", None) is None:
        where = getattr(loaded, "__file__", None)
        return Path(where).parent if where else None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def find_deepgemm() -> list[Found]:
    """Every DeepGEMM importable here, in the order they are tried: a standalone `deep_gemm`,
    then vLLM's bundled `vllm/third_party/deep_gemm` (found through vLLM's package directory,
    without running vLLM's own __init__)."""
    found = []
    standalone = _package_dir("deep_gemm")
    if standalone is not None:
        found.append(Found(STANDALONE, "deep_gemm", standalone, _stated_version(standalone)))
    vllm = _package_dir("vllm")
    bundled = None if vllm is None else vllm / "third_party" / "deep_gemm"
    if bundled is not None and (bundled / "__init__.py").is_file():
        found.append(Found(VLLM_BUNDLED, BUNDLED_MODULE, bundled, _stated_version(bundled)))
    return found


def import_found(found: Found) -> ModuleType:
    """Import `found`. vLLM's bundled copy is loaded as the package it is, under its own name,
    from its directory, without running vLLM's top-level __init__ (heavy, and where it fails its
    DeepGEMM would be lost with it): while it loads, `vllm` and `vllm.third_party` are stand-in
    module objects (`__path__` their directories), since importing a submodule imports its
    top-level package; then they are gone, and a later `import vllm` is vLLM's own, finding this
    same DeepGEMM in sys.modules. Once vLLM itself is imported, the import is an ordinary one. A
    failure leaves nothing of the package (or the stand-ins) in sys.modules."""
    if found.source == STANDALONE or found.name in sys.modules or "vllm" in sys.modules:
        return importlib.import_module(found.name)
    spec = importlib.util.spec_from_file_location(
        found.name, found.location / "__init__.py", submodule_search_locations=[str(found.location)]
    )
    if spec is None or spec.loader is None:
        return importlib.import_module(found.name)
    parents = {"vllm": found.location.parents[1], "vllm.third_party": found.location.parent}
    stand_ins = {name: _stand_in(name, folder) for name, folder in parents.items()}
    sys.modules.update(stand_ins)
    package = importlib.util.module_from_spec(spec)
    sys.modules[found.name] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        for name in [n for n in sys.modules if n == found.name or n.startswith(found.name + ".")]:
            del sys.modules[name]
        raise
    finally:
        for name, stand_in in stand_ins.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
    return package


def _stand_in(name: str, folder: Path) -> ModuleType:
    """A package module object for `name` whose submodules import from `folder`, its own
    __init__ not run."""
    stand_in = ModuleType(
        name, f"stand-in while {BUNDLED_MODULE} loads (optimized/deepgemm/loading.py)"
    )
    stand_in.__path__ = [str(folder)]
    stand_in.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    stand_in.__spec__.submodule_search_locations = [str(folder)]
    return stand_in
