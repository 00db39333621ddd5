"""Test-suite wiring: markers, arch gating, CPU/interpreter mode, xdist GPU pinning, shared JIT
caches, reports.

Arch gating lives here and only here: `sm90` means compute capability major == 9 exactly, `sm100`
major == 10, `multi_gpu` two or more GPUs, `vllm` an importable vLLM (the adapter's tier). Every
skip carries its reason.

The GPU tiers run as `pytest tests/gpu -m sm90 -n 4`: four xdist workers share one GPU (with
MOE_VERIFY_NUM_GPUS=N, worker i is pinned to GPU i % N), and every worker points DeepGEMM, Triton
and inductor at the same JIT caches (moe_verify/common/jit_cache.py; those of `moe-verify sweep`),
so a
kernel one worker compiled is a cache hit for the others and for the next run (docs/ci.md).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

# xdist workers share the cores: one BLAS thread each (the Triton interpreter's tl.dot is a numpy
# matmul, and oversubscribed OpenBLAS threads made the CPU tier ~1.6x slower on 2 cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

# xdist: pin each worker to one GPU before anything initialises CUDA.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and "CUDA_VISIBLE_DEVICES" not in os.environ:
    _gpus = os.environ.get("MOE_VERIFY_NUM_GPUS")
    if _gpus and int(_gpus) > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_worker[2:]) % int(_gpus))

# Every worker (and the controller, whose environment they inherit) shares the JIT caches; set
# before anything imports triton or DeepGEMM.
from moe_verify.common.jit_cache import shared_jit_caches  # noqa: E402

shared_jit_caches()

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels run under its interpreter: `optimized` sets that up (with its
# float-cast fixes) when imported, which must happen before any test module imports triton.
import optimized  # noqa: E402, F401
from moe_verify.spec import cc_major, is_sm90_major, is_sm100_major  # noqa: E402

if TYPE_CHECKING:
    from tolerance.report import Report


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")
    parser.addoption("--run-bench", action="store_true", help="also run benchmarks (marked bench)")


def _gate_reason(item: pytest.Item, config: pytest.Config) -> str | None:
    major = cc_major()
    if item.get_closest_marker("sm90") and not is_sm90_major(major):
        return f"needs an SM90 (Hopper) GPU; this machine has {_describe(major)}"
    if item.get_closest_marker("sm100") and not is_sm100_major(major):
        return f"needs an SM100 (Blackwell) GPU; this machine has {_describe(major)}"
    if item.get_closest_marker("multi_gpu"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < 2:
            return f"needs >= 2 GPUs; this machine has {n}"
    for marker, engine in ENGINE_TIERS.items():
        if item.get_closest_marker(marker):
            usable, why = _engine_availability(marker)
            # a step that names the release it installed runs the tier, so a refusal fails it
            if not usable and not os.environ.get(f"MOE_VERIFY_EXPECT_{marker.upper()}"):
                return f"needs {engine}'s kernels (the -m {marker} tier, .ci/run): {why}"
    if item.get_closest_marker("slow") and not config.getoption("--run-slow"):
        return "slow test: pass --run-slow to run it"
    if item.get_closest_marker("bench") and not config.getoption("--run-bench"):
        return "benchmark, not a test: pass --run-bench (or use `moe-verify bench`)"
    return None


# Engine markers -> the engine whose installed kernels their tests verify through
# moe_verify.adapters.<marker> (each adapter's availability() says whether it loads here).
ENGINE_TIERS = {"vllm": "vLLM", "sglang": "SGLang", "lmdeploy": "LMDeploy"}


@functools.cache
def _engine_availability(marker: str) -> tuple[bool, str]:
    """Whether the adapter of `marker` loads here (imports the engine once per session, only when
    one of its tests was collected)."""
    adapter = importlib.import_module(f"moe_verify.adapters.{marker}")
    return adapter.availability()


def _describe(major: int | None) -> str:
    return "no GPU" if major is None else f"compute capability {major}.x"


def pytest_configure(config: pytest.Config) -> None:
    """`-n N` alone schedules with xdist's work stealing: a worker that runs out takes half of
    the other's queue, so the two workers of the CPU tier end together (the tier's tests take
    0.01 to 30 s; docs/ci.md). An explicit --dist is kept."""
    explicit = any(a == "--dist" or a.startswith("--dist=") for a in config.invocation_params.args)
    if getattr(config.option, "dist", "no") == "load" and not explicit:
        config.option.dist = "worksteal"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        reason = _gate_reason(item, config)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On failure, print the stage table of any verification report the test recorded."""
    report = yield
    if report.when == "call" and report.failed:
        for moe_report in getattr(item, "moe_reports", []):
            report.sections.append(("moe-verify report", moe_report.to_table()))
    return report


@pytest.fixture
def record_report(request: pytest.FixtureRequest) -> Callable[[Report], Report]:
    """Call with a Report; if the test then fails, its stage table is shown in the failure."""

    def record(report: Report) -> Report:
        request.node.moe_reports = [*getattr(request.node, "moe_reports", []), report]
        return report

    return record
