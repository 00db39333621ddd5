"""What the engine adapters (vllm.py, sglang.py, lmdeploy.py) share, written once.

- Loading: the installed release (`installed_version`) and the evidence that admits it
  (`check_release`: moe_verify/adapters/releases.py, against the adapter's `WINDOW`), the
  engine's kernel modules imported with a check of the names the adapter calls
  (`import_kernels`), optionally with the package root stubbed (`stub_package`: a module object
  with `__path__`, so `pkg/__init__.py` never runs), and `availability`'s (usable, why).
- `accepts`: whether an installed kernel's signature takes a parameter (a newer release's).
- `AdaptedBackend`: the kernel record ("<engine> <version>: <what>"), the declared recipe, the
  output buffer (the workspace or torch.empty), and the GEMM stages: through the engine's own
  DeepGEMM wrapper where the suite's choice is DeepGEMM and the wrapper runs, else the suite's
  engine with the reason noted. What is engine-specific (the wrapper's call, the notes) stays in
  each adapter.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from moe_verify.adapters.releases import Evidence, ReleaseWindow, admit
from moe_verify.spec import (
    GEMM_OUTPUT,
    GEMM_WEIGHT,
    SUITE_CODE,
    Engine,
    MoEProblem,
    Stage,
    StageContext,
    Trace,
    is_sm90,
)
from optimized.backend import OptimizedBackend, Outputs, gemm_operands
from optimized.deepgemm import choose_grouped_layout

Unavailable = type[Exception]
# A GEMM operand as DeepGEMM's wrappers take it: (fp8 values, their scales).
Operand = tuple[torch.Tensor, torch.Tensor]


def installed_version(dists: tuple[str, ...], unavailable: Unavailable, missing: str) -> str:
    """The version of the first installed distribution of `dists`; `missing` says what to do."""
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise unavailable(missing)


def check_release(
    window: ReleaseWindow, version: str, unavailable: Unavailable, root: Path | None = None
) -> Evidence:
    """The evidence that admits the installed `version` (its kernel sources read under `root`,
    default the installed package's directory), or `unavailable` saying why not."""
    return admit(window, version, root or package_dir(window.package, unavailable), unavailable)


def package_dir(package: str, unavailable: Unavailable) -> Path:
    """The installed package's directory (the loaded module's, stub or real, else its spec's)."""
    loaded = sys.modules.get(package)
    if loaded is not None and getattr(loaded, "__path__", None):
        return Path(next(iter(loaded.__path__)))
    return Path(next(iter(_package_spec(package, unavailable).submodule_search_locations or ())))


def _package_spec(package: str, unavailable: Unavailable) -> Any:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise unavailable(f"the {package} package cannot be found on sys.path")
    return spec


def stub_package(package: str, unavailable: Unavailable, switch: str) -> str | None:
    """Register a module object for `package` (its `__path__` the installed package's) so its
    submodules import without running package/__init__.py; `switch` records it. Nothing when
    the package is already imported (stubbed, or the real one): its submodules work."""
    if package in sys.modules:
        return None
    spec = _package_spec(package, unavailable)
    stub = ModuleType(package)
    stub.__path__ = list(spec.submodule_search_locations)
    stub.__spec__ = spec
    stub.__file__ = None
    sys.modules[package] = stub
    return switch


def import_module(
    name: str, unavailable: Unavailable, hint: Callable[[Exception], str] = lambda exc: ""
) -> ModuleType:
    """importlib.import_module; any failure is the reason the engine is unusable here."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        raise unavailable(
            f"importing {name} failed: {type(exc).__name__}: {exc}{hint(exc)}"
        ) from exc


def import_kernels(
    modules: Mapping[str, tuple[str, tuple[str, ...]]],
    engine: str,
    unavailable: Unavailable,
    hint: Callable[[Exception], str] = lambda exc: "",
    lacks: str = "",
) -> dict[str, ModuleType]:
    """attribute -> module for `modules` (attribute -> (module, the names the adapter calls in
    it)); a module lacking one of the names refuses the release (`engine`, e.g. 'vLLM 0.32.0';
    `lacks` follows the message)."""
    imported: dict[str, ModuleType] = {}
    for attr, (name, names) in modules.items():
        module = import_module(name, unavailable, hint)
        missing = [n for n in names if not hasattr(module, n)]
        if missing:
            raise unavailable(f"{engine}: {name} lacks {', '.join(missing)}{lacks}")
        imported[attr] = module
    return imported


def availability(
    load: Callable[[], Any], unavailable: Unavailable, engine: str
) -> tuple[bool, str]:
    """(usable, why): whether `load` loads the installed engine here: its version, the evidence
    that admitted it, and the switches applied."""
    try:
        k = load()
    except unavailable as exc:
        return False, str(exc)
    switches = f" ({'; '.join(k.switches)})" if k.switches else ""
    return True, f"{engine} {k.version}: {k.evidence}{switches}"


def accepts(fn: Callable[..., Any], parameter: str) -> bool:
    """The installed kernel's signature takes `parameter`."""
    return parameter in inspect.signature(fn).parameters


class AdaptedBackend(OptimizedBackend):
    """An engine's installed kernels as a Backend (subclass per engine); see the module
    docstring. `label` names the engine in kernel records and the backend's name; `gemm_wrapper`
    is the engine module its DeepGEMM GEMMs go through (None: its GEMMs are not adapted)."""

    label = ""
    gemm_wrapper: str | None = None

    def __init__(
        self,
        version: str,
        engine: Engine | str = Engine.AUTO,
        *,
        wrapper_runs: bool = False,
        fallback: str | None = None,
        declares_recipes: bool = True,
        **options: Any,
    ) -> None:
        """wrapper_runs: the engine's DeepGEMM wrapper can run here; where it cannot, an AUTO
        engine becomes the suite's Triton engine, noted with `fallback` on the GEMM records.
        declares_recipes: name the recipe each stage runs (the release the adapter knows)."""
        self.version = version
        self.declares_recipes = declares_recipes
        self._wrapper_runs = wrapper_runs and self.gemm_wrapper is not None
        self._engine_note: str | None = None
        if fallback is not None and Engine(engine) is Engine.AUTO and not wrapper_runs:
            engine, self._engine_note = Engine.TRITON, fallback
        super().__init__(engine=engine, **options)
        self.name = f"{self.label}-{version}"

    # -- output helpers ----------------------------------------------------------------------

    def _kernel(self, what: str) -> str:
        return f"{self.label} {self.version}: {what}"

    def _declare(self, outputs: Outputs, recipe: str) -> Outputs:
        """Name the legitimate recipe the engine runs, where the adapter knows it."""
        if self.declares_recipes:
            outputs["recipe"] = recipe
        return outputs

    @staticmethod
    def compiled_for_sm90(out: torch.Tensor) -> bool:
        """The kernel that wrote `out` ran compiled on an SM90 GPU (the hardware the recipes with
        recorded tables model: reference/hardware/gate_table.py,
        reference/hardware/quotient_table.py), not under the Triton interpreter."""
        if out.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            return False
        return is_sm90(out.device)

    @staticmethod
    def _buffer(
        ctx: StageContext,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """The workspace `name` (verification with workspaces, production mode), else
        torch.empty as the engine allocates it."""
        buf = ctx.buffers.get(name, shape, dtype, device)
        return torch.empty(shape, dtype=dtype, device=device) if buf is None else buf

    # -- stages the engine's code does not run here: the suite's, said so ----------------------

    def route(self, ctx: StageContext) -> Outputs:
        """The suite's routing (no engine's router is adapted)."""
        return self.suite_code(super().route(ctx), "routing (the engine's router is not adapted)")

    def shared(self, ctx: StageContext) -> Outputs:
        """The suite's shared experts (engines run them as dense linears, not on this path)."""
        return self.suite_code(super().shared(ctx), "shared experts (dense, not this path)")

    def suite_code(self, outputs: Outputs, what: str) -> Outputs:
        """Mark `outputs` as the suite's own code run in the engine's place: the report's stage
        column shows it ("align [suite]") and the kernel record says what and why."""
        outputs["engine"] = SUITE_CODE
        outputs["kernel"] = self._kernel(f"the suite's {what}")
        return outputs

    # -- GEMMs: the engine's DeepGEMM wrapper, or the suite's engine ---------------------------

    def gemm1(self, ctx: StageContext) -> Outputs:
        return self._engine_gemm(ctx, Stage.GEMM1)

    def gemm2(self, ctx: StageContext) -> Outputs:
        return self._engine_gemm(ctx, Stage.GEMM2)

    def _engine_gemm(self, ctx: StageContext, stage: Stage) -> Outputs:
        """The GEMM through the engine's DeepGEMM wrapper where it runs, else the suite's."""
        if "dispatch" in ctx.upstream or not self._through_wrapper(ctx):
            return self._noted(super()._gemm(ctx, stage))
        out = self._wrapper_gemm(ctx, GEMM_WEIGHT[stage], gemm_operands(ctx.upstream, stage))
        return {GEMM_OUTPUT[stage]: out, **self._wrapper_record(ctx)}

    def _noted(self, outputs: Outputs) -> Outputs:
        """The suite's GEMM record, with why the engine's wrapper did not run it."""
        if self._engine_note:
            outputs["engine_reason"] = self._engine_note
        return outputs

    def _through_wrapper(self, ctx: StageContext) -> bool:
        return self._wrapper_runs and self.choose_engine(ctx).engine is Engine.DEEPGEMM

    def _wrapper_record(self, ctx: StageContext) -> Outputs:
        return {
            "engine": Engine.DEEPGEMM,
            "engine_reason": f"{self.choose_engine(ctx).reason}; through {self.gemm_wrapper}",
            "layout": choose_grouped_layout(ctx.problem).layout.value,
        }

    def _wrapper_gemm(self, ctx: StageContext, which: str, a: Operand) -> torch.Tensor:
        """bf16 [rows, N]: the rank's `which` weights (DeepGEMM's scale layout) times `a`
        (activations, scales) through the engine's wrapper (`_check_gemm`, `_call_gemm`)."""
        self._check_gemm(ctx.problem)
        w = ctx.shard.weight(which)
        w_scale = self.deepgemm_weight_scales(ctx, which)
        rows = a[0].shape[0]
        out = torch.empty((rows, w.shape[1]), dtype=torch.bfloat16, device=a[0].device)
        if rows:
            self._call_gemm(ctx.problem, ctx.upstream, a, (w.q, w_scale), out)
        return out

    def _check_gemm(self, problem: MoEProblem) -> None:
        """Raise StageSkipped where the wrapper would not run the problem as the suite asks."""

    def _call_gemm(
        self, problem: MoEProblem, upstream: Trace, a: Operand, b: Operand, out: torch.Tensor
    ) -> None:
        """The engine's grouped GEMM call, as the engine makes it, writing `out`."""
        raise NotImplementedError(f"{type(self).__name__} declares no DeepGEMM wrapper call")
