"""`moe-verify doctor`: what this machine can run, as one JSON object.

- torch, CUDA and the GPU, triton;
- DeepGEMM: every field `optimized.deepgemm.probe()` reports (the module object itself left out),
  so a field the probe learns appears here without a change; with `--first-call`, one GEMM run
  in a subprocess (`probe_first_call`);
- the engine adapters (`moe_verify.run.runner.ADAPTERS`: vllm, sglang, lmdeploy): the installed
  release or null, the releases the adapter accepts (its window), and whether it would run here
  with the evidence that admitted it, or why not (each adapter's own `availability()`, the check
  `--backend NAME` makes).
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any


def doctor(first_call: bool = False) -> dict[str, Any]:
    """The report `moe-verify doctor` prints (JSON-serializable)."""
    import torch

    from optimized import deepgemm

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "triton": _triton_version(),
    }
    status = deepgemm.probe()
    info["deep_gemm"] = status_fields(status)
    if status.usable and first_call:
        ok, why = deepgemm.probe_first_call()
        info["deep_gemm_first_call"] = {"ok": ok, "detail": why}
    info["adapters"] = adapters()
    return info


def status_fields(status: object) -> dict[str, Any]:
    """Every field of a status dataclass but the module object (a field holding or typed as a
    module), as JSON takes it (anything that is not a JSON scalar, list or dict, e.g. a Path,
    as its str)."""
    return {
        f.name: _plain(getattr(status, f.name))
        for f in dataclasses.fields(status)  # type: ignore[arg-type]
        if "ModuleType" not in str(f.type) and not isinstance(getattr(status, f.name), ModuleType)
    }


def adapters() -> dict[str, dict[str, Any]]:
    """name -> adapter_status(name), for each adapter `--backend` takes by name."""
    from moe_verify.run.runner import ADAPTERS

    return {name: adapter_status(name) for name in ADAPTERS}


def adapter_status(name: str) -> dict[str, Any]:
    """The installed release (or None), the releases accepted, and whether the adapter would run
    here ('runs_here') with its reason ('detail': why not, or the release and the switches it
    applies)."""
    from moe_verify.run.runner import ADAPTERS

    module_name, _, unavailable_name = ADAPTERS[name]
    try:
        module = importlib.import_module(f"moe_verify.adapters.{module_name}")
    except Exception as exc:  # noqa: BLE001 - the adapter itself cannot load: that is the answer
        return {
            "installed": None,
            "accepts": None,
            "runs_here": False,
            "detail": f"importing moe_verify.adapters.{module_name} failed: "
            f"{type(exc).__name__}: {exc}",
        }
    unavailable = getattr(module, unavailable_name)
    try:
        installed: str | None = module.installed_version()
    except unavailable:
        installed = None
    try:
        runs, detail = module.availability()
    except Exception as exc:  # noqa: BLE001 - a load that fails otherwise is a reason too
        runs, detail = False, f"{type(exc).__name__}: {exc}"
    return {
        "installed": installed,
        "accepts": accepted_releases(module),
        "runs_here": runs,
        "detail": detail,
    }


def accepted_releases(module: ModuleType) -> str:
    """The releases an adapter module admits (its WINDOW, moe_verify/adapters/releases.py): those
    whose tier passed and any with identical kernel sources, the oldest it knows, and the
    variable that lets another release run untested, with its state."""
    from moe_verify.adapters.releases import opted_in

    window = module.WINDOW
    text = window.describe()
    if window.oldest is not None:
        text += f"; releases before {'.'.join(map(str, window.oldest))} refused"
    state = "set" if opted_in(window.untested_env) else "not set"
    return text + f"; other releases untested with {window.untested_env}=1 ({state})"


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _plain(value: object) -> object:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)
