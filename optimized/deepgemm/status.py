"""Can DeepGEMM run here: the DeepGEMM `loading` finds, imported, its version and API names and
the GPU arch checked (`probe`, cached), and one GEMM run in a child process (`probe_first_call`).

DeepGEMM is optional. Every entry point says clearly why it cannot run here: deep_gemm missing,
the unusable PyPI 1.0 package (old API names, no CUDA headers), a version below 2.6, a copy whose
extension does not load, no GPU, or a GPU that is neither SM90 nor SM100.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from moe_verify.spec import cc_major, is_sm90_major, is_sm100_major
from optimized.deepgemm.loading import Found, find_deepgemm, import_found

MIN_VERSION = (2, 6)
# Names our calls need; their absence means an old or partial build.
REQUIRED_API = (
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "get_mk_alignment_for_contiguous_layout",
    "set_mk_alignment_for_contiguous_layout",
    "transform_sf_into_required_layout",
)
LIBSTDCXX = "/lib/x86_64-linux-gnu/libstdc++.so.6"


class DeepGemmUnavailable(RuntimeError):
    """deep_gemm cannot run this call here; the message says why and what to do."""


@dataclass(frozen=True)
class DeepGemmStatus:
    usable: bool
    reason: str
    version: str | None = None
    arch_major: int | None = None
    module: ModuleType | None = None
    # Which DeepGEMM (loading.SOURCES: an installed "standalone" deep_gemm, or vLLM's
    # "vllm-bundled" copy) and its package directory; None when neither is installed.
    source: str | None = None
    location: str | None = None


def _parse_version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


_INSTALL_HINT = (
    "install DeepGEMM >= 2.6 from source (github.com/deepseek-ai/DeepGEMM, with its cutlass and "
    "fmt submodules), or a vLLM whose wheel bundles it (0.33: DeepGEMM 2.8.1)"
)


@functools.cache
def probe() -> DeepGemmStatus:
    """Find DeepGEMM (`find_deepgemm`: standalone first, then vLLM's bundled copy), import it, and
    check version, API names and the GPU arch (cached). Which one was found, where, and its
    version are reported even where it cannot run."""
    found = find_deepgemm()
    major = cc_major()
    first = found[0] if found else None
    where = {} if first is None else {"source": first.source, "location": str(first.location)}
    if major is None:
        return DeepGemmStatus(
            False,
            "no CUDA GPU: DeepGEMM runs on SM90/SM100 only",
            None if first is None else first.version,
            **where,
        )
    if not found:
        return DeepGemmStatus(
            False,
            f"deep_gemm is not installed, and no vLLM bundles it; {_INSTALL_HINT}",
            arch_major=major,
        )
    missed = []
    for candidate in found:
        where = {"source": candidate.source, "location": str(candidate.location)}
        label = f"{candidate.source} deep_gemm {candidate.version or ''} at {candidate.location}"
        try:
            dg = import_found(candidate)
        except ImportError as exc:  # as vLLM does: the next one is tried
            missed.append(f"{label}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - found but cannot load here: that is the answer
            return DeepGemmStatus(
                False,
                f"{label} failed to load: {_why(exc)}",
                candidate.version,
                major,
                **where,
            )
        return _check_api(dg, candidate, major)
    return DeepGemmStatus(
        False,
        f"no DeepGEMM imports here ({'; '.join(missed)}); {_INSTALL_HINT}",
        found[-1].version,
        major,
        **where,
    )


def _why(exc: BaseException) -> str:
    """An exception and what caused it ("OSError: Could not load this library: X (OSError:
    libc10_cuda.so: cannot open shared object file ...)"): torch's load_library keeps the
    loader's own reason in the cause."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    return text if cause is None else f"{text} ({type(cause).__name__}: {cause})"


def _check_api(dg: ModuleType, found: Found, major: int) -> DeepGemmStatus:
    """The status of an imported DeepGEMM: its version and API names, and the GPU arch."""
    where = {"source": found.source, "location": str(found.location)}
    version = getattr(dg, "__version__", None) or found.version
    missing = [name for name in REQUIRED_API if not hasattr(dg, name)]
    if version is None or _parse_version(version) < MIN_VERSION or missing:
        hint = (
            " This looks like the PyPI 'deep-gemm 1.0' package (Feb 2025 API, no CUDA headers),"
            " which cannot run these kernels."
            if missing and hasattr(dg, "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous")
            else ""
        )
        return DeepGemmStatus(
            False,
            f"deep_gemm {version or '(no __version__)'} ({found.source}, {found.location}) is "
            f"unusable: need >= {'.'.join(map(str, MIN_VERSION))} with "
            f"{', '.join(missing) or 'the 2.6 API'}.{hint}",
            version,
            major,
            **where,
        )
    if not (is_sm90_major(major) or is_sm100_major(major)):
        return DeepGemmStatus(
            False,
            f"DeepGEMM supports SM90 and SM100; this GPU is SM{major}x",
            version,
            major,
            **where,
        )
    return DeepGemmStatus(
        True, f"deep_gemm {version} ({found.source}) on SM{major}x", version, major, dg, **where
    )


def module() -> ModuleType:
    status = probe()
    if not status.usable or status.module is None:
        raise DeepGemmUnavailable(status.reason)
    return status.module


def on_sm90() -> bool:
    """DeepGEMM runs here on SM90: the 1D2D FP8 kernels, fp32 scales (`sm90_fp8_1d2d`)."""
    return is_sm90_major(probe().arch_major)


def on_sm100() -> bool:
    """DeepGEMM runs here on SM100: UE8M0-packed scales, MXFP8 and FP4 (`sm100_ue8m0`)."""
    return is_sm100_major(probe().arch_major)


# The GEMM is gemm2's of the GPU tiers' shared test shape (N = K = 512, 8 experts:
# tests/gpu/test_sm90_pipeline.py GPU_SHAPE), so its JIT compile is one the tier needs anyway.
_PROBE_SCRIPT = """
import torch
from optimized.deepgemm import module
dg = module()
g, m, n, k = 8, 128, 512, 512
a = torch.randn(m, k, device='cuda').to(torch.float8_e4m3fn)
sa = torch.ones(m, k // 128, device='cuda')
b = torch.randn(g, n, k, device='cuda').to(torch.float8_e4m3fn)
sb = torch.ones(g, n // 128, k // 128, device='cuda')
d = torch.empty(m, n, device='cuda', dtype=torch.bfloat16)
dg.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, torch.zeros(m, dtype=torch.int32,
                                    device='cuda'))
torch.cuda.synchronize()
print('ok')
"""


def probe_first_call(timeout_s: float = 300.0) -> tuple[bool, str]:
    """Run one tiny GEMM in a subprocess, on the DeepGEMM `probe` finds, so a crash in DeepGEMM's
    JIT is reported, not fatal.

    Known trap: with some builds the first GEMM segfaults inside std::regex (DeepGEMM's include
    parser) from a libstdc++ symbol clash; preloading the system libstdc++ fixes it.
    """
    env = dict(os.environ)
    env.setdefault("CUDA_HOME", "/usr/local/cuda")
    # The child finds DeepGEMM as this process does (`probe`): through this project.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode == 0 and "ok" in proc.stdout:
        return True, "first DeepGEMM call ran"
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    if proc.returncode in (-11, 139) and LIBSTDCXX not in env.get("LD_PRELOAD", ""):
        return False, (
            "the first DeepGEMM call crashed with SIGSEGV: the known libstdc++ clash in its JIT "
            f"include parser. Start Python with LD_PRELOAD={LIBSTDCXX}"
        )
    return False, f"the first DeepGEMM call failed (exit {proc.returncode}): {' | '.join(tail)}"
