"""The only module that imports deep_gemm (lazily): where DeepGEMM comes from, capability probe,
engine choice, alignment scope, GEMM calls.

DeepGEMM is found the way vLLM finds it: an installed standalone `deep_gemm` first, else the copy
vLLM's wheel bundles as `vllm.third_party.deep_gemm` (vLLM 0.33 ships DeepGEMM 2.8.1 there),
loaded without running vLLM's own __init__; `probe()` says which one, its version and directory.

DeepGEMM is optional. Every entry point says clearly why it cannot run here: deep_gemm missing,
the unusable PyPI 1.0 package (old API names, no CUDA headers), a version below 2.6, a copy whose
extension does not load, no GPU, or an arch that cannot run the recipe (everything UE8M0-packed,
per-32 or FP4 is SM100-only).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from moe_verify.spec import (
    LL_BLOCK_ROWS,
    Engine,
    GroupedLayout,
    MoEProblem,
    QuantizedWeight,
    Recipe,
    ScaleFmt,
    StageSkipped,
    cc_major,
)
from optimized.kernels._validate import (
    check_flag,
    check_power_of_two_scales,
    check_range,
    fail,
    output_buffer,
)
from optimized.triton_compat import interpreter_mode

MIN_VERSION = (2, 6)
# Names our calls need; their absence means an old or partial build.
REQUIRED_API = (
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "get_mk_alignment_for_contiguous_layout",
    "set_mk_alignment_for_contiguous_layout",
    "transform_sf_into_required_layout",
)
# SM90 1D2D kernels need BLOCK_M in {64, 128, 256} (DeepGEMM 2.6.1 sm90_fp8_gemm_1d2d.cuh's
# WAVE_BLOCK_M assert; 192 or 224 fail in the JIT compile).
SM90_LEGAL_ALIGNMENTS = (64, 128, 256)
# vLLM _valid_deep_gemm: at or below this intermediate size (per rank) Triton is preferred for
# speed.
MIN_INTERMEDIATE = 512
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
    # Which DeepGEMM (SOURCES: an installed "standalone" deep_gemm, or vLLM's "vllm-bundled"
    # copy) and its package directory; None when neither is installed.
    source: str | None = None
    location: str | None = None


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
    stand_in = ModuleType(name, f"stand-in while {BUNDLED_MODULE} loads (optimized/deepgemm.py)")
    stand_in.__path__ = [str(folder)]
    stand_in.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    stand_in.__spec__.submodule_search_locations = [str(folder)]
    return stand_in


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
    if major not in (9, 10):
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


def support(problem: MoEProblem) -> tuple[bool, str]:
    """Can DeepGEMM run this problem's GEMMs on this machine? (yes/no, and why)."""
    status = probe()
    if not status.usable:
        return False, status.reason
    major = status.arch_major
    if problem.recipe is not Recipe.FP8_BLOCK and major != 10:
        return False, f"{problem.recipe} GEMMs (per-32 / FP4, packed UE8M0) are SM100-only"
    if problem.scale_fmt is ScaleFmt.UE8M0_PACKED and major != 10:
        return False, "packed UE8M0 scales feed SM100 GEMMs only (SM90 reads fp32 scales)"
    if problem.scale_fmt is ScaleFmt.FLOAT32 and major == 10:
        return False, "SM100 FP8 GEMMs take UE8M0 scales; plain float32 scales need SM90"
    if major == 9 and problem.alignment not in SM90_LEGAL_ALIGNMENTS:
        return False, (
            f"alignment {problem.alignment} is not a legal SM90 BLOCK_M {SM90_LEGAL_ALIGNMENTS}"
        )
    return True, status.reason


def as_engine(value: Engine | str) -> Engine:
    """`value` as an Engine; a ValueError naming the allowed values for anything else."""
    try:
        return Engine(value)
    except ValueError:
        allowed = tuple(e.value for e in Engine)
        raise ValueError(f"engine: expected one of {allowed}, got {value!r}") from None


@dataclass(frozen=True)
class EngineChoice:
    """The engine a GEMM stage runs on (DEEPGEMM or TRITON, never AUTO), and why."""

    engine: Engine
    reason: str


def choose_engine(
    problem: MoEProblem, num_tokens: int, override: Engine | str = Engine.AUTO
) -> EngineChoice:
    """TritonOrDeepGemm: DeepGEMM when E8M0 is in use or the shape is valid for it, else Triton.

    `override=Engine.DEEPGEMM` demands DeepGEMM (a stage it cannot run is skipped with the
    reason, never silently replaced); `Engine.TRITON` forces the Triton engine.
    """
    override = as_engine(override)
    if override is Engine.TRITON:
        return EngineChoice(Engine.TRITON, "engine forced to triton")
    ok, why = support(problem)
    if override is Engine.DEEPGEMM:
        if not ok:
            raise StageSkipped(f"DeepGEMM demanded but cannot run here: {why}")
        return EngineChoice(Engine.DEEPGEMM, f"engine forced to deepgemm ({why})")
    if not ok:
        return EngineChoice(Engine.TRITON, f"TritonOrDeepGemm fallback: {why}")
    if problem.scale_fmt.is_ue8m0:
        return EngineChoice(Engine.DEEPGEMM, "E8M0 scales in use: DeepGEMM regardless of shape")
    a, ip, h = problem.alignment, problem.intermediate_per_rank, problem.hidden
    if num_tokens >= a and ip % a == 0 and h % a == 0 and ip > MIN_INTERMEDIATE:
        return EngineChoice(Engine.DEEPGEMM, "shape valid for DeepGEMM (_valid_deep_gemm)")
    return EngineChoice(
        Engine.TRITON,
        f"_valid_deep_gemm fails (M={num_tokens} >= A={a}, I_p={ip} % A, H={h} % A, "
        f"I_p > {MIN_INTERMEDIATE}): Triton",
    )


@dataclass(frozen=True)
class LayoutChoice:
    """The grouped layout the contiguous GEMMs and act_quant read (M_INDICES or PSUM, never
    AUTO), and why."""

    layout: GroupedLayout
    reason: str


def _gpu_arch_major() -> int | None:
    """The GPU this path runs on, or None on the CPU (the Triton interpreter)."""
    return None if interpreter_mode() else cc_major()


def choose_grouped_layout(problem: MoEProblem) -> LayoutChoice:
    """vLLM 0.32's choice (DeepGemmExperts.apply, `use_psum_layout`) unless the problem forces one.

    psum for fp8_block (not MXFP8; the FP4 experts never use it) with silu or swigluoai, on SM90,
    and on SM100 with packed UE8M0 scales (vLLM's DeepGemmQuantScaleFMT.UE8M0, the only E8M0
    format it runs there). Without a GPU there is no arch to choose by: m_indices, the layout
    vLLM runs wherever it does not choose psum (both come from one permute plan, so either is
    exercised by forcing it).
    """
    if problem.grouped_layout is not GroupedLayout.AUTO:
        return LayoutChoice(problem.grouped_layout, "forced by the problem")
    major = _gpu_arch_major()
    if major is None:
        return LayoutChoice(GroupedLayout.M_INDICES, "auto without a GPU: m_indices")
    if problem.recipe is not Recipe.FP8_BLOCK:
        return LayoutChoice(
            GroupedLayout.M_INDICES, f"auto: vLLM runs {problem.recipe} on m_indices"
        )
    arch_ok = major == 9 or (major == 10 and problem.scale_fmt is ScaleFmt.UE8M0_PACKED)
    if arch_ok and problem.activation.kind in ("silu", "swigluoai"):
        return LayoutChoice(GroupedLayout.PSUM, f"auto: vLLM 0.32 runs psum on SM{major}x here")
    return LayoutChoice(
        GroupedLayout.M_INDICES,
        f"auto: vLLM 0.32 runs m_indices on SM{major}x with {problem.scale_fmt}",
    )


@contextlib.contextmanager
def alignment_scope(value: int) -> Iterator[None]:
    """Set DeepGEMM's process-global contiguous-layout alignment (its BLOCK_M) for one call.

    The per-expert padding of the workspace must equal the kernel's BLOCK_M, or the scheduler reads
    the expert of a block from the wrong row (silent misrouting or an IMA; vLLM wraps its GEMMs in
    `mk_alignment_scope` for this). Always restores the previous value.
    """
    dg = module()
    previous = dg.get_mk_alignment_for_contiguous_layout()
    if isinstance(previous, (tuple, list)):
        previous = previous[0]
    dg.set_mk_alignment_for_contiguous_layout(value)
    try:
        yield
    finally:
        dg.set_mk_alignment_for_contiguous_layout(previous)


@contextlib.contextmanager
def sm_count_scope(num_sms: int | None) -> Iterator[None]:
    """Let DeepGEMM use `num_sms` SMs for the calls inside (deep_gemm.set_num_sms, a
    process-global); None leaves it as it is. Always restores the previous count."""
    if num_sms is None:
        yield
        return
    dg = module()
    previous = dg.get_num_sms()
    dg.set_num_sms(num_sms)
    try:
        yield
    finally:
        dg.set_num_sms(previous)


def current_alignment() -> int:
    value = module().get_mk_alignment_for_contiguous_layout()
    return int(value[0] if isinstance(value, (tuple, list)) else value)


def _weight_recipe(w: QuantizedWeight) -> tuple[int, int, int]:
    return (1, w.block[0], w.block[1])


def prepared_scale_key(which: str, use_ue8m0: bool) -> str:
    """The key of `which`'s ("w13", "w2") scales in DeepGEMM's layout among a shard's prepared
    weights (`RankShard.prepared`): production mode fills it at load time, verification on
    first use."""
    return f"deepgemm_scale:{which}:{'ue8m0' if use_ue8m0 else 'fp32'}"


def prepare_weight_scales(w: QuantizedWeight, use_ue8m0: bool) -> torch.Tensor:
    """The weight scales in the layout this arch's kernel reads.

    SM90: fp32 [E, N/128, K/128] as-is. SM100: DeepGEMM packs fp32 powers of two (or upcast E8M0
    bytes) into int32 UE8M0, per row, MN-major, TMA-aligned.
    """
    check_flag("deepgemm.prepare_weight_scales", "use_ue8m0", use_ue8m0)
    dg = module()
    e, n, k = w.shape
    scale = w.scale
    if scale.dtype == torch.uint8:
        # E8M0 bytes -> fp32 powers of two by placing the byte in the exponent field.
        scale = (scale.to(torch.int32) << 23).view(torch.float32)
    if probe().arch_major == 9:
        return scale.contiguous()
    return dg.transform_sf_into_required_layout(
        scale.contiguous(),
        mn=n,
        k=k,
        recipe=_weight_recipe(w),
        num_groups=e,
        is_sfa=False,
        disable_ue8m0_cast=not use_ue8m0,
    )


def validate_contiguous_call(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: QuantizedWeight,
    grouped_layout: torch.Tensor,
    alignment: int,
    use_ue8m0: bool,
    use_psum_layout: bool = False,
) -> None:
    """The invariants DeepGEMM's m-grouped contiguous GEMM assumes, checked on the host first.

    Violations fault or silently misroute inside the kernel (vLLM PR #49784, DeepGEMM issue #178);
    here they raise InvalidKernelInput naming the broken rule instead. The fp32 scales the kernel
    reads must be finite and >= 0, and on SM100 (which packs them to UE8M0) powers of two: every
    row with m_indices, the live rows only with psum (the packer skips gap rows, gemm.hpp).
    """
    from optimized.kernels.grouped_gemm import _check_m_indices
    from optimized.kernels.psum import check_expert_ends, psum_live_rows

    fn = "deepgemm.m_grouped_gemm"
    check_flag(fn, "use_ue8m0", use_ue8m0)
    check_flag(fn, "use_psum_layout", use_psum_layout)
    m_sum, k = a.shape
    num_experts, n, _ = w.shape
    name = "expert_ends" if use_psum_layout else "m_indices"
    if a.dtype != torch.float8_e4m3fn or a.stride(-1) != 1:
        fail(fn, f"a must be K-major float8_e4m3fn, got {a.dtype} with strides {a.stride()}")
    if k % 128 or n % 8:
        fail(fn, f"K={k} must be a multiple of 128 and N={n} of 8 (TMA and the SM90 epilogue)")
    if grouped_layout.dtype != torch.int32 or not grouped_layout.is_contiguous():
        fail(fn, f"{name} must be contiguous int32, got {grouped_layout.dtype}")
    if m_sum % alignment:
        fail(fn, f"M_sum={m_sum} must be a multiple of the alignment {alignment} (BLOCK_M)")
    if use_psum_layout:
        if grouped_layout.shape != (num_experts,):
            fail(
                fn,
                f"expert_ends has shape {tuple(grouped_layout.shape)}; the psum layout holds "
                f"one end per expert, [{num_experts}] (DeepGEMM asserts it)",
            )
        check_expert_ends(fn, grouped_layout, m_sum, alignment)
        live = psum_live_rows(grouped_layout, m_sum, alignment)
    else:
        if grouped_layout.numel() != m_sum:
            fail(fn, f"m_indices has {grouped_layout.numel()} rows for M_sum={m_sum}")
        _check_m_indices(fn, grouped_layout, num_experts, alignment)
        live = None
    if a_scale.dtype == torch.float32:
        scales = a_scale if live is None else a_scale[live]
        bad = ~torch.isfinite(scales) | (scales < 0)
        if bool(bad.any()):
            r, g = (int(i) for i in bad.nonzero()[0])
            what = f"a_scale[{r}, {g}]" if live is None else f"a_scale (live row {r}, group {g})"
            fail(fn, f"{what} = {float(scales[r, g])} is not a finite scale >= 0")
        if use_ue8m0 and probe().arch_major == 10:
            # DeepGEMM 2.6 device-asserts powers of two when packing fp32 scales to UE8M0.
            check_power_of_two_scales(fn, "a_scale", scales)


# The largest BLOCK_M DeepGEMM picks for the masked GEMM (SM90 heuristics: 64 or 128); the LL
# dispatch capacity (MoEProblem.ll_max_tokens) is sized in these blocks.
MASKED_BLOCK_M = LL_BLOCK_ROWS


def validate_masked_call(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: QuantizedWeight,
    masked_m: torch.Tensor,
    expected_m: int,
    use_ue8m0: bool,
) -> None:
    """The invariants DeepGEMM's m-grouped masked GEMM assumes, checked on the host first.

    The kernel trusts masked_m: a count above M_max reads A and writes D past their batch. A batch
    count other than the weights' pairs batches with the wrong experts (a workspace shaped with
    the global expert count: vLLM PR #19515; vLLM's BatchedDeepGemmExperts under DeepEP
    low-latency dispatch).
    """
    fn = "deepgemm.m_grouped_gemm_masked"
    check_flag(fn, "use_ue8m0", use_ue8m0)
    if a.dim() != 3 or a.dtype != torch.float8_e4m3fn or a.stride(-1) != 1:
        fail(fn, f"a must be a K-major float8_e4m3fn [G, M_max, K], got {a.dtype} {a.shape}")
    groups, max_m, k = a.shape
    if groups != w.shape[0] or k != w.shape[2]:
        fail(fn, f"a is [G={groups}, M_max, K={k}] but the weights are {tuple(w.shape)}")
    if k % 128 or w.shape[1] % 8:
        fail(fn, f"K={k} must be a multiple of 128 and N={w.shape[1]} of 8")
    if a_scale.dim() != 3 or a_scale.shape[:2] != (groups, max_m):
        fail(fn, f"a_scale must be [G={groups}, M_max={max_m}, K/128], got {a_scale.shape}")
    if masked_m.dtype != torch.int32 or masked_m.shape != (groups,):
        fail(fn, f"masked_m must be int32 [G={groups}], got {masked_m.dtype} {masked_m.shape}")
    if not masked_m.is_contiguous():
        fail(fn, "masked_m must be contiguous")
    if expected_m <= 0:
        fail(fn, f"expected_m must be > 0 (DeepGEMM asserts it), got {expected_m}")
    check_range(
        fn, "masked_m", masked_m, 0, max_m + 1,
        f"a batch's row count must be in [0, M_max={max_m}]; another value makes the kernel "
        "read A and write D outside the batch",
    )  # fmt: skip
    # DeepGEMM tiles a batch in BLOCK_M-row blocks (64 or 128 on SM90; the mk alignment, 128 by
    # default, on SM100) and its TMA descriptors view A and D as one [G * M_max] matrix: a block
    # running past M_max reads the next batch's A rows and stores over its D rows. Measured on the
    # H200 with DeepGEMM 2.6.1: M_max = 20 gave 47% wrong elements (DeepGEMM issue 268).
    # Every batch's rows, rounded up to 128, must fit.
    need = (masked_m.to(torch.int64) + MASKED_BLOCK_M - 1) // MASKED_BLOCK_M * MASKED_BLOCK_M
    over = need > max_m
    if bool(over.any()):
        g = int(over.nonzero()[0])
        fail(
            fn,
            f"masked_m[{g}] = {int(masked_m[g])} fills {int(need[g])} rows in DeepGEMM's "
            f"{MASKED_BLOCK_M}-row blocks but M_max = {max_m}: its last block would read the "
            "next batch's rows of A and overwrite its rows of D (past the end of both for the "
            f"last batch). Size the batches (DeepEP's dispatch capacity) to a multiple of "
            f"{MASKED_BLOCK_M} rows",
        )
    if use_ue8m0 and a_scale.dtype == torch.float32 and probe().arch_major == 10:
        check_power_of_two_scales(fn, "a_scale", a_scale)


def m_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_group: int,
    w: QuantizedWeight,
    w_scale: torch.Tensor,
    grouped_layout: torch.Tensor,
    alignment: int,
    *,
    use_ue8m0: bool,
    use_psum_layout: bool = False,
    validate: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d = A @ B[e(r)]^T in bf16 through m_grouped_fp8(_fp4)_gemm_nt_contiguous.

    The arguments in the order of every grouped GEMM of the suite (the golden's, the Triton
    engine's `grouped_gemm`): activations with their scales and group, weights, layout.
    a_group: K elements per activation scale; w_scale: `w`'s scales in this arch's layout
    (`prepare_weight_scales`); grouped_layout: m_indices [M_sum], or with `use_psum_layout`
    expert_ends [E] (DeepGEMM 2.6.1's `use_psum_layout=True`: the SM100 SFA packer then skips
    the gap rows; vLLM 0.32 passes neither `expected_m_for_psum_layout` nor
    `ensure_zero_padding`, and neither do we); `out`, when given, is a reused [M_sum, N] bf16
    workspace. DeepGEMM writes padding (-1) rows, and under psum gap rows, unspecified, and
    leaves tail rows past the last segment unwritten. validate: the host checks of
    `validate_contiguous_call` (device syncs; False in production mode and under capture)."""
    # The flags first: a string such as 'no' is truthy, and DeepGEMM would take it as True.
    check_flag("deepgemm.m_grouped_gemm", "use_ue8m0", use_ue8m0)
    check_flag("deepgemm.m_grouped_gemm", "use_psum_layout", use_psum_layout)
    check_flag("deepgemm.m_grouped_gemm", "validate", validate)
    dg = module()
    m_sum = a.shape[0]
    n = w.shape[1]
    d = output_buffer("deepgemm.m_grouped_gemm", "out", out, (m_sum, n), torch.bfloat16, a.device)
    if m_sum == 0:
        return d
    if validate:
        validate_contiguous_call(
            a, a_scale, w, grouped_layout, alignment, use_ue8m0, use_psum_layout
        )
    b = w.q.view(torch.int8) if w.fp4 else w.q
    kwargs: dict[str, object] = {"disable_ue8m0_cast": not use_ue8m0}
    if w.fp4 or w.block != (128, 128):
        kwargs["recipe_a"] = (1, a_group)
        kwargs["recipe_b"] = (1, w.block[1])
    if use_psum_layout:
        kwargs["use_psum_layout"] = True
        if a_scale.dtype == torch.float32 and probe().arch_major == 10:
            # The psum SFA packer takes only a K-major contiguous fp32 SF (smxx_layout.hpp
            # asserts it); act_quant's fp32 scales are column-major. A layout copy, same values.
            a_scale = a_scale.contiguous()
    with alignment_scope(alignment):
        if w.fp4:
            dg.m_grouped_fp8_fp4_gemm_nt_contiguous(
                (a, a_scale), (b, w_scale), d, grouped_layout, **kwargs
            )
        else:
            dg.m_grouped_fp8_gemm_nt_contiguous(
                (a, a_scale), (b, w_scale), d, grouped_layout, **kwargs
            )
    return d


def m_grouped_gemm_masked(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: QuantizedWeight,
    w_scale: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    *,
    use_ue8m0: bool,
    validate: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d[e, :masked_m[e]] = A[e] @ B[e]^T through m_grouped_fp8_gemm_nt_masked. validate: the
    host checks of `validate_masked_call` (device syncs; False in production mode); out: a
    reused bf16 [G, M_max, N] workspace."""
    fn = "deepgemm.m_grouped_gemm_masked"
    check_flag(fn, "use_ue8m0", use_ue8m0)
    check_flag(fn, "validate", validate)
    dg = module()
    if validate:
        validate_masked_call(a, a_scale, w, masked_m, expected_m, use_ue8m0)
    e, max_m, _ = a.shape
    d = output_buffer(fn, "out", out, (e, max_m, w.shape[1]), torch.bfloat16, a.device)
    dg.m_grouped_fp8_gemm_nt_masked(
        (a, a_scale), (w.q, w_scale), d, masked_m, expected_m, disable_ue8m0_cast=not use_ue8m0
    )
    return d


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
    root = str(Path(__file__).resolve().parents[1])
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


def pack_ue8m0_reference(scale: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's own packer (get_mn_major_tma_aligned_packed_ue8m0_tensor): fp32 powers of two
    [MN, G] -> int32 [MN, ceil(G/4)] MN-major TMA-aligned. It runs on SM90 too, so it
    cross-checks our packing on a Hopper machine even though only SM100 GEMMs consume it."""
    return module().get_mn_major_tma_aligned_packed_ue8m0_tensor(scale.contiguous())
