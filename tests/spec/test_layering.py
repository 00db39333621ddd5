"""The architecture as a test: which package may import which, and no import cycle anywhere.

The rule: `moe_verify.spec` <- reference, optimized, tolerance <- the harness <- tests.
The golden never imports the optimized path (a golden that shares code with the kernel shares its
bugs), the optimized path never imports the golden, tolerance judges both and imports neither.
Every import counts, also those inside functions: a lazy import still ties two modules together.
The vocabulary is also imported for real, in a fresh interpreter: what it loads is what every layer
pays for standing on it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("moe_verify", "reference", "optimized", "tolerance")
# What each layer may import from the project (a prefix allows its submodules).
ALLOWED = {
    "moe_verify.spec": ("moe_verify.spec",),
    "reference": ("reference", "moe_verify.spec"),
    "optimized": ("optimized", "moe_verify.spec"),
    "tolerance": ("tolerance", "moe_verify.spec"),
}
# mmaemu is a test-only cross-check of the tensor-core recipe: the golden never depends on it.
FORBIDDEN_THIRD_PARTY = {
    "moe_verify.spec": ("triton", "deep_gemm", "mmaemu"),
    "reference": ("triton", "deep_gemm", "mmaemu"),
    "tolerance": ("triton", "deep_gemm", "mmaemu"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file (absolute names)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from pkg import sub` imports the submodule when there is one
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _project_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports. A module's own parent packages are left out:
    Python initializes them before the module whatever it imports (`from pkg import submodule`
    inside pkg's own modules is no cycle)."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {m for m in _imports(path) if m in modules and m != name} - parents
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_project_modules() -> None:
    cycle = _cycle(_project_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_what_it_may(layer: str) -> None:
    wrong = []
    for path in sorted(ROOT.joinpath(*layer.split(".")).rglob("*.py")):
        for name in sorted(_imports(path)):
            top = name.split(".")[0]
            project = top in PACKAGES
            if project and not name.startswith(ALLOWED[layer]):
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
            if top in FORBIDDEN_THIRD_PARTY.get(layer, ()):
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


def _outside_the_vocabulary(module: str) -> bool:
    """A module the vocabulary must not load: the rest of the project (the harness, the golden,
    the optimized path, tolerance) or a GPU toolchain. `moe_verify` itself loads its names lazily,
    so its package is no harness."""
    top = module.split(".")[0]
    if top in ("triton", "deep_gemm"):
        return True
    if top == "moe_verify":
        return module not in ("moe_verify", "moe_verify.spec") and not module.startswith(
            "moe_verify.spec."
        )
    return top in PACKAGES


def test_importing_the_vocabulary_loads_nothing_of_the_project_but_itself() -> None:
    """Each `moe_verify.spec` submodule, in a fresh interpreter (the package loads its names
    lazily, so each is imported by name)."""
    spec = {_module_name(p) for p in (ROOT / "moe_verify" / "spec").glob("*.py")}
    code = f"import sys, importlib; [importlib.import_module(m) for m in {sorted(spec)}]; "
    code += "print(*sorted(sys.modules), sep='\\n')"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    loaded = run.stdout.split()
    assert spec <= set(loaded), f"not loaded: {sorted(spec - set(loaded))}"
    wrong = {m for m in loaded if _outside_the_vocabulary(m)}
    roots = sorted(m for m in wrong if m.rpartition(".")[0] not in wrong)  # not every submodule
    assert not wrong, f"import moe_verify.spec loads {roots}"
