"""SglangBackend: SGLang 0.5.23's DeepGEMM MoE kernels, stage by stage, as SGLang's DeepGEMM runner
(`sglang/srt/layers/moe/moe_runner/deep_gemm.py`: `pre_permute_standard_to_deep_gemm`, the
contiguous `_run_contiguous_gemm`, `post_permute_deep_gemm_to_standard`) calls them on CUDA.

Every stage SGLang owns calls the installed SGLang; none of its code is copied:

| stage       | SGLang 0.5.23                                                                      |
| ----------- | ---------------------------------------------------------------------------------- |
| quant_input | fp8_kernel.sglang_per_token_group_quant_fp8 (JIT CUDA; skipped on a CPU)           |
| align       | ep_moe_kernels.fused_moe_dispatch_index (counts) + the runner's                    |
|             | get_contiguous_layout_alignment and _get_compact_all_tokens (M_sum)                |
| permute     | triton_pad_expert_counts.pad_expert_counts + ep_moe_kernels.ep_scatter (m_indices) |
| act_quant   | silu_and_mul[_clamp] + sglang_per_token_group_quant_fp8 (JIT CUDA; skipped on CPU) |
| gather      | ep_moe_kernels.post_reorder_deepgemm                                               |

Releases (WINDOW, docs/engines.md): those whose -m sglang tier passed (releases.json), and any
whose kernel sources are byte-identical to theirs; another only with MOE_VERIFY_SGLANG_UNTESTED=1.

route, the GEMMs and shared are the suite's optimized path (SGLang's routers and DeepGEMM wrapper
are not adapted; the GEMM stages record the engine that ran).

The runner builds the per-row m_indices layout only (no psum), sized by the tight bound
A*(m + (M*k - m) // A), m = min(M*k, E_l) (MSumRecipe.TIGHT_BOUND), with the tail rows folded
into the last expert's padded count (pad_expert_counts), and the scales it scatters are fp32
row-major on SM90 (UE8M0 packing only on SM100/SM120: `ue8m0_packed` is not adapted). Under EP the
standard dispatch hands global ids and ep_scatter keeps those in [expert_start, expert_start +
E_l), so the adapter passes the rank's first expert as `expert_start` (contiguous placements only).

What runs differently on a CPU (the Triton interpreter), and why:

- The import. `import sglang` runs `sglang/__init__.py` (71 modules: IPython, transformers, ...).
  The package root is stubbed instead, a module object for `sglang` with `__path__` set, so the
  kernel modules import without it (~57 modules, needing msgspec, orjson, psutil, pybase64,
  pydantic_core, pyzmq, requests, starlette and what those import).
  Where torchvision is not installed, a stand-in `torchvision.io` serves the one name 0.5.20's
  sglang/srt/utils/common.py imports from it at its top, while the kernel modules import
  (`_torchvision_stand_in`; a switch records it).
- The runner module itself needs transformers and the distributed stack: its two pure helpers
  the adapter calls, `_get_compact_all_tokens` (deep_gemm.py) and
  `get_contiguous_layout_alignment` (deep_gemm_wrapper/entrypoint.py), are compiled alone from the
  installed files. The latter asks DeepGEMM for the contiguous-layout BLOCK_M; without DeepGEMM
  it is handed a stand-in answering DeepGEMM's SM90 default, 128.
- post_reorder_deepgemm sizes its launch from `torch.cuda.get_device_properties`: on a CPU it sees
  an H200's (132 SMs, 2048 threads per SM). The launch shape does not change the sum.
- quant_input and act_quant are JIT-compiled CUDA (apache-tvm-ffi; fp8_kernel imports
  `per_token_group_quant` only `if _is_cuda`, and the runner's `_legacy_silu_and_mul` is None off
  CUDA): on a CPU they raise StageSkipped with that reason, so chained mode stops there and
  isolated mode (the golden's upstream) judges align, permute and gather.
"""

from __future__ import annotations

import ast
import contextlib
import dis
import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from moe_verify.adapters import common
from moe_verify.adapters.common import AdaptedBackend
from moe_verify.adapters.releases import Evidence, ReleaseWindow, module_source, recorded
from moe_verify.spec import (
    Engine,
    GroupedLayout,
    InputQuantRecipe,
    MoEProblem,
    MSumRecipe,
    Placement,
    Recipe,
    RoutedScalingRecipe,
    ScaleFmt,
    StageContext,
    StageSkipped,
    TopologyKind,
    Trace,
    routed_scale_on_output,
)
from optimized.backend import Outputs
from reference.activation import sglang_sm90_cuda_recipe

# DeepGEMM's get_mk_alignment_for_contiguous_layout() on SM90: the contiguous layout's BLOCK_M.
DEEPGEMM_CONTIGUOUS_ALIGNMENT = 128
# What the CPU's post_reorder_deepgemm launch sees: an H200 (torch.cuda.get_device_properties).
_H200 = SimpleNamespace(multi_processor_count=132, max_threads_per_multi_processor=2048)

_EP = "sglang.kernels.ops.moe.ep_moe_kernels"
# attribute -> (module, the names the adapter calls in it)
_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "ep": (
        _EP,
        (
            "ep_scatter",
            "post_reorder_deepgemm",
            "fused_moe_dispatch_index",
            "_get_launch_config_2d",
        ),
    ),
    "pad": ("sglang.kernels.ops.moe.triton_pad_expert_counts", ("pad_expert_counts",)),
}
# (file in the installed package, function): pure helpers of modules too heavy to import here
_HELPERS = {
    "compact_all_tokens": ("srt/layers/moe/moe_runner/deep_gemm.py", "_get_compact_all_tokens"),
    "layout_alignment": (
        "srt/layers/deep_gemm_wrapper/entrypoint.py",
        "get_contiguous_layout_alignment",
    ),
}


# The kernel modules the adapter imports only on CUDA (quant_input, act_quant).
_CUDA_SOURCES = (
    "kernels/ops/quantization/fp8_kernel.py",
    "kernels/ops/activation/activation.py",
    "kernels/ops/activation/silu_and_mul_clamp.py",
)
# The releases the adapter admits, on what evidence (moe_verify/adapters/releases.py): those whose
# -m sglang tier passed, and any whose kernel sources (the modules above, the helpers' files and
# the CUDA-only kernel modules) are identical to theirs.
WINDOW = ReleaseWindow(
    engine="SGLang",
    key="sglang",
    package="sglang",
    dists=("sglang",),
    sources=(
        *(module_source(name) for name, _ in _MODULES.values()),
        *(relpath for relpath, _ in _HELPERS.values()),
        *_CUDA_SOURCES,
    ),
    untested_env="MOE_VERIFY_SGLANG_UNTESTED",
    records=recorded("sglang"),
)
# Set to 1 to run a release outside the window (its kernels may have changed their contract).
UNTESTED_ENV = WINDOW.untested_env


class SglangUnavailable(RuntimeError):
    """SGLang cannot be adapted here; the message says why and what to do."""


@dataclass(frozen=True)
class SglangKernels:
    """The installed SGLang's kernel modules and helpers the adapter calls, and the switches."""

    version: str
    evidence: Evidence  # what admitted the release (releases.py)
    ep: ModuleType
    pad: ModuleType
    compact_all_tokens: Callable[[int, int, int], int]
    layout_alignment: Callable[[int, int], int]
    on_cuda: bool
    has_deep_gemm: bool
    switches: tuple[str, ...]


def installed_version() -> str:
    return common.installed_version(
        WINDOW.dists,
        SglangUnavailable,
        "SGLang is not installed; in a venv of its own (it pins another torch): "
        "pip install --no-deps sglang==0.5.23 plus the kernel modules' imports (docs/sglang.md)",
    )


def check_version(version: str, root: Path | None = None) -> Evidence:
    """The evidence that admits `version` (its kernel sources read under `root`, default the
    installed sglang package), or SglangUnavailable naming the window and the opt-in."""
    return common.check_release(WINDOW, version, SglangUnavailable, root)


@contextlib.contextmanager
def _torchvision_stand_in(switches: list[str]) -> Iterator[None]:
    """Where torchvision is not installed, a stand-in `torchvision.io` while the kernel modules
    import, removed afterwards; `switches` records it if anything imported from it. SGLang
    0.5.20's sglang/srt/utils/common.py, which the kernel modules import, imports
    `torchvision.io.decode_jpeg` at its top (for image inputs); the kernel path never calls it,
    and the stand-in raises if anything does."""
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    served: list[str] = []

    def decode_jpeg(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torchvision is not installed: moe-verify stood in for it at import")

    def serve(name: str) -> Any:
        if name != "decode_jpeg":
            raise AttributeError(f"moe-verify's stand-in torchvision.io has no {name!r}")
        served.append(name)
        return decode_jpeg

    io = ModuleType("torchvision.io")
    io.__getattr__ = serve  # type: ignore[method-assign]
    package = ModuleType("torchvision")
    package.__path__ = []  # type: ignore[attr-defined]
    package.io = io  # type: ignore[attr-defined]
    sys.modules.update({"torchvision": package, "torchvision.io": io})
    try:
        yield
    finally:
        for name, module in (("torchvision", package), ("torchvision.io", io)):
            if sys.modules.get(name) is module:
                del sys.modules[name]
    if served:
        switches.append(
            "torchvision is not installed: a stand-in torchvision.io served decode_jpeg while "
            "the kernel modules imported (sglang/srt/utils/common.py imports it at its top); the "
            "kernel path never calls it (the stand-in raises if anything does)"
        )


def _installed_function(
    root: Path, relpath: str, name: str, env: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """`name`, compiled alone from the installed file (its module's imports are too heavy here).
    It must read no global beyond `env` and builtins, or the adapter refuses."""
    path = root / relpath
    tree = ast.parse(path.read_text(), str(path))
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if node is None:
        raise SglangUnavailable(f"{path} has no function {name}")
    module = ast.Module(body=[node], type_ignores=[])
    scope: dict[str, Any] = {"__builtins__": __builtins__, **(env or {})}
    exec(compile(module, str(path), "exec"), scope)  # noqa: S102 - the installed SGLang's code
    fn = scope[name]
    unknown = [g for g in _global_names(fn.__code__) if g not in scope and not _builtin(g)]
    if unknown:
        raise SglangUnavailable(f"{relpath}:{name} reads globals {unknown} the adapter lacks")
    return fn


def _global_names(code: Any) -> set[str]:
    names = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _global_names(const)
    return names


def _builtin(name: str) -> bool:
    import builtins

    return hasattr(builtins, name)


class _DeepGemmDefault:
    """DeepGEMM as SGLang's get_contiguous_layout_alignment asks it, where DeepGEMM is absent:
    the SM90 contiguous-layout BLOCK_M, and no theoretical (smaller) alignment."""

    @staticmethod
    def get_mk_alignment_for_contiguous_layout() -> int:
        return DEEPGEMM_CONTIGUOUS_ALIGNMENT


@functools.cache
def load() -> SglangKernels:
    """Check the installed SGLang, stub its root, import its kernel modules."""
    version = installed_version()
    evidence = check_version(version)
    root = common.package_dir("sglang", SglangUnavailable)
    stub = "sglang/__init__.py not run (the package root is a stub with __path__)"
    switches = [s for s in (common.stub_package("sglang", SglangUnavailable, stub),) if s]
    with _torchvision_stand_in(switches):
        modules = common.import_kernels(
            _MODULES,
            f"SGLang {version}",
            SglangUnavailable,
            lambda exc: " (docs/sglang.md lists what the kernel modules import)",
        )
    on_cuda = bool(getattr(modules["ep"], "_is_cuda", False))
    try:
        import deep_gemm  # noqa: F401

        dg: Any = sys.modules["deep_gemm"]
        has_dg = True
    except Exception:  # noqa: BLE001 - no usable DeepGEMM
        dg, has_dg = _DeepGemmDefault, False
        switches.append(
            "get_contiguous_layout_alignment asks a DeepGEMM stand-in: BLOCK_M "
            f"{DEEPGEMM_CONTIGUOUS_ALIGNMENT} (SM90's), no theoretical alignment"
        )
    helpers = {
        "compact_all_tokens": _installed_function(root, *_HELPERS["compact_all_tokens"]),
        "layout_alignment": _installed_function(
            root, *_HELPERS["layout_alignment"], env={"deep_gemm": dg}
        ),
    }
    switches.append("_get_compact_all_tokens, get_contiguous_layout_alignment compiled alone")
    if not on_cuda:
        switches.append("post_reorder_deepgemm's launch sees an H200's device properties")
    return SglangKernels(
        version=version,
        evidence=evidence,
        on_cuda=on_cuda,
        has_deep_gemm=has_dg,
        switches=tuple(switches),
        **modules,
        **helpers,
    )


def availability() -> tuple[bool, str]:
    """(usable, why): whether the adapter can load the installed SGLang here."""
    return common.availability(load, SglangUnavailable, "SGLang")


def expert_start(problem: MoEProblem, hosted: tuple[int, ...], rank: int) -> int:
    """The first id of the rank's contiguous expert range, as ep_scatter takes it (ids outside
    [expert_start, expert_start + E_l) are not this rank's)."""
    topo = problem.topology
    if topo.kind is TopologyKind.TP:
        return 0
    if topo.placement is Placement.EXPLICIT:
        assert topo.explicit is not None
        return sum(len(r) for r in topo.explicit[:rank])  # physical ids, contiguous per rank
    first = hosted[0] if hosted else 0
    if list(hosted) != list(range(first, first + len(hosted))):
        raise StageSkipped(
            f"SGLang's standard dispatch takes a contiguous expert range per rank; rank {rank} "
            f"hosts {list(hosted)} ({topo.placement.value} placement)"
        )
    return first


def _tensor_range(*args: Any, **kwargs: Any) -> Iterator[Any]:
    """range() whose induction variable is an int32 scalar tensor, as in compiled Triton (the
    interpreter yields Python ints, and SGLang's kernels call `.to(tl.int64)` on them)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    ints = [int(a.handle.data.item()) if isinstance(a, tl.tensor) else _unwrap(a) for a in args]
    step = _unwrap(kwargs.get("step", ints[2] if len(ints) > 2 else 1))
    start, end = (0, ints[0]) if len(ints) == 1 else (ints[0], ints[1])
    for i in range(start, end, step):
        yield tl.tensor(TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)


def _unwrap(v: Any) -> int:
    return int(getattr(v, "value", v))


def _builtin_range(*args: Any, **kwargs: Any) -> Any:
    """The kernel module's `range`: tensors inside a kernel (a tensor bound), Python's elsewhere."""
    import triton.language as tl

    if any(isinstance(a, tl.tensor) for a in args):
        return _tensor_range(*args, **kwargs)
    return range(*args, **kwargs)


@contextlib.contextmanager
def _interpreter_loop_tensors(module: ModuleType) -> Iterator[None]:
    """While `module`'s kernels run under the interpreter, their loop variables (tl.range, and
    range over a tensor bound) are int32 tensors, as compiled Triton makes them."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang_core

    # every (re)patch of triton.language, nested jit calls included (they re-patch it unscoped)
    def patch_lang_core(lang: Any, scope: Any) -> Any:
        result = original(lang, scope)
        if lang is tl:
            scope.set_attr(lang, "range", _tensor_range)
        return result

    interpreter._patch_lang_core = patch_lang_core
    had = "range" in vars(module)
    module.range = _builtin_range  # type: ignore[attr-defined]
    try:
        yield
    finally:
        interpreter._patch_lang_core = original
        if not had:
            del module.range  # type: ignore[attr-defined]


class _HostTorch:
    """torch, as ep_moe_kernels sees it on a CPU: cuda.get_device_properties answers an H200."""

    cuda = SimpleNamespace(get_device_properties=lambda device=None: _H200)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class SglangBackend(AdaptedBackend):
    """SGLang 0.5.23's DeepGEMM runner kernels (fp8_block); see the module docstring."""

    name = label = "sglang"

    def __init__(self, engine: Engine | str = Engine.AUTO) -> None:
        self.sglang = load()
        super().__init__(self.sglang.version, engine)

    # -- helpers ---------------------------------------------------------------------------------

    def _require_supported(self, problem: MoEProblem) -> None:
        if problem.recipe is not Recipe.FP8_BLOCK:
            raise StageSkipped(
                f"the SGLang adapter covers the DeepGEMM runner's fp8_block path; {problem.recipe} "
                "is not adapted"
            )
        if problem.topology.kind not in (TopologyKind.TP, TopologyKind.EP):
            raise StageSkipped(
                f"{problem.topology} runs SGLang's DeepEP pre-permutes (deepep_normal / "
                "deepep_ll); the adapter covers the standard dispatch"
            )
        if problem.batched:
            raise StageSkipped(
                "the masked layout runs SGLang's DeepEP low-latency path (deepep_ll); the adapter "
                "covers the standard dispatch's contiguous layout"
            )
        if problem.grouped_layout is GroupedLayout.PSUM:
            raise StageSkipped(
                "SGLang's contiguous DeepGEMM runner builds the per-row m_indices layout only "
                "(ep_scatter); the problem forces psum"
            )
        if problem.scale_fmt is ScaleFmt.UE8M0_PACKED:
            raise StageSkipped(
                "packed UE8M0 scales are SGLang's SM100/SM120 path (DEEPGEMM_SCALE_UE8M0): not "
                "adapted; SM90 scatters fp32 scales"
            )

    @staticmethod
    def _expert_start(ctx: StageContext) -> int:
        return expert_start(ctx.problem, ctx.shard.experts, ctx.rank)

    def _jit_cuda(self, stage: str, what: str) -> None:
        if not self.sglang.on_cuda:
            raise StageSkipped(
                f"SGLang {self.sglang.version} runs {stage} as JIT-compiled CUDA ({what}; "
                "apache-tvm-ffi), which does not exist off CUDA"
            )

    @contextlib.contextmanager
    def _on_host(self, launch: bool = False) -> Iterator[None]:
        """On a CPU: loop variables are tensors inside ep_moe_kernels' kernels, and (`launch`)
        its launch configs read an H200's device properties. Nothing on CUDA."""
        if self.sglang.on_cuda:
            yield
            return
        ep = self.sglang.ep
        saved = ep.torch
        if launch:
            ep.torch = _HostTorch()
        try:
            with _interpreter_loop_tensors(ep):
                yield
        finally:
            ep.torch = saved

    @staticmethod
    def _quant_fp8(problem: MoEProblem, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """sglang_per_token_group_quant_fp8(x, 128) as the runner calls it on SM90: row-major
        fp32 scales (their UE8M0 flavour, fp32 powers of two, for float32_ceil_ue8m0)."""
        fp8 = importlib.import_module("sglang.kernels.ops.quantization.fp8_kernel")
        return fp8.sglang_per_token_group_quant_fp8(
            x,
            problem.recipe.act_group,
            column_major_scales=False,
            scale_tma_aligned=False,
            scale_ue8m0=problem.scale_fmt is ScaleFmt.FLOAT32_CEIL_UE8M0,
        )

    def _clamp_kernel(self) -> ModuleType:
        """silu_and_mul_clamp's module, where the release has it (0.5.20's runner takes another
        kernel, from kernels/ops/attention/dsv4, which is not adapted)."""
        name = "sglang.kernels.ops.activation.silu_and_mul_clamp"
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            raise StageSkipped(
                f"SGLang {self.sglang.version} has no {name} (its runner's swiglu clamp is another "
                "kernel, not adapted)"
            ) from exc

    @staticmethod
    def grouped_layout(problem: MoEProblem, upstream: Trace) -> tuple[GroupedLayout, torch.Tensor]:
        """SGLang's contiguous runner reads m_indices, whatever the arch (no psum)."""
        return GroupedLayout.M_INDICES, upstream["permute"]["m_indices"]

    # -- stages ----------------------------------------------------------------------------------

    def dispatch(self, ctx: StageContext) -> Outputs:
        raise StageSkipped(
            "the masked layout runs SGLang's DeepEP low-latency path (deepep_ll): not adapted"
        )

    def quant_input(self, ctx: StageContext) -> Outputs:
        """sglang_per_token_group_quant_fp8(x, 128), as pre_permute_standard_to_deep_gemm calls
        it on SM90 (row-major fp32); float32_ceil_ue8m0: its row-major UE8M0 flavour (fp32
        powers of two)."""
        problem, inputs = ctx.problem, ctx.inputs
        self._require_supported(problem)
        self._jit_cuda("quant_input", "sglang_per_token_group_quant_fp8 -> per_token_group_quant")
        ceil = problem.scale_fmt is ScaleFmt.FLOAT32_CEIL_UE8M0
        q, s = self._quant_fp8(problem, inputs.hidden_states)
        out = {
            "a1q": q,
            "a1q_scale": s,
            "kernel": self._kernel(f"sglang_per_token_group_quant_fp8(scale_ue8m0={ceil})"),
        }
        # nvcc --use_fast_math's 448 / amax as an H200 computes it (the recorded table); the
        # UE8M0 flavour (another kernel) and other GPUs are matched against every recipe.
        if problem.scale_fmt is ScaleFmt.FLOAT32 and self.compiled_for_sm90(q):
            return self._declare(out, InputQuantRecipe.FAST_RECIPROCAL_SM90_CUDA.value)
        return out

    def align(self, ctx: StageContext) -> Outputs:
        """fused_moe_dispatch_index's per-expert counts; the runner's alignment and compact M_sum
        (get_contiguous_layout_alignment, _get_compact_all_tokens)."""
        problem, upstream = ctx.problem, ctx.upstream
        self._require_supported(problem)
        sg = self.sglang
        sh = ctx.shard
        ids = upstream["route"]["topk_ids"]
        e_l = sh.num_local_experts
        slots = ids.numel()
        block_e = int(sg.layout_alignment(slots, e_l))
        if block_e != problem.alignment:
            raise StageSkipped(
                f"SGLang pads each expert to A={block_e} here (get_contiguous_layout_alignment); "
                f"the problem asks A={problem.alignment}: run it with --alignment {block_e}"
            )
        counts, _unused_dst = sg.ep.fused_moe_dispatch_index(
            ids, e_l, 1, expert_start=self._expert_start(ctx)
        )
        return {
            "M_sum": int(sg.compact_all_tokens(slots, e_l, block_e)),
            "alignment": block_e,
            "counts": counts,
            "recipe": MSumRecipe.TIGHT_BOUND.value,
            "kernel": self._kernel(
                "fused_moe_dispatch_index + get_contiguous_layout_alignment + "
                "_get_compact_all_tokens"
            ),
        }

    def permute(self, ctx: StageContext) -> Outputs:
        """pad_expert_counts (the tail folded into the last expert) and ep_scatter, fed align's
        counts as the valid counts, as pre_permute_standard_to_deep_gemm does on CUDA."""
        problem, upstream = ctx.problem, ctx.upstream
        self._require_supported(problem)
        sg = self.sglang
        align, quant = upstream["align"], upstream["quant_input"]
        a1q, a1q_scale = quant["a1q"], quant["a1q_scale"]
        ids = upstream["route"]["topk_ids"]
        counts = align["counts"]
        all_tokens, block_e = int(align["M_sum"]), int(align["alignment"])
        device, hidden = a1q.device, a1q.shape[1]
        padded = sg.pad.pad_expert_counts(counts, block_e, all_tokens)
        # the workspace, or torch.empty: the runner's non-deterministic allocation
        a_perm = self._buffer(ctx, "a_perm", (all_tokens, hidden), a1q.dtype, device)
        scale = torch.zeros((all_tokens, a1q_scale.shape[1]), dtype=a1q_scale.dtype, device=device)
        cursor = torch.empty(counts.shape[0], dtype=torch.int32, device=device)
        m_indices = torch.empty(all_tokens, dtype=torch.int32, device=device)
        src2dst = torch.empty(ids.shape, dtype=torch.int32, device=device)
        with self._on_host():
            sg.ep.ep_scatter(
                a1q,
                a1q_scale,
                ids,
                padded,
                counts,
                cursor,
                a_perm,
                scale,
                m_indices,
                src2dst,
                scale_ue8m0=False,
                quant_block_size=problem.recipe.act_group,
                expert_alignment=block_e,
                expert_start=self._expert_start(ctx),
            )
        return {
            "a_perm": ctx.buffers.own(a_perm),
            "a_scale_perm": scale,
            "m_indices": m_indices,
            # ep_scatter's expert_start_loc: seeded with each padded segment's start, advanced by
            # one atomic per live slot; it ends at start_e + count_e
            "expert_ends": cursor,
            "inv_perm": src2dst,
            "layout": GroupedLayout.M_INDICES.value,
            "kernel": self._kernel("pad_expert_counts + ep_scatter"),
        }

    def act_quant(self, ctx: StageContext) -> Outputs:
        """The SM90 branch of _run_contiguous_gemm: silu_and_mul (silu_and_mul_clamp with a
        swiglu limit) into bf16, then sglang_per_token_group_quant_fp8 (row-major fp32)."""
        problem, upstream = ctx.problem, ctx.upstream
        self._require_supported(problem)
        act = problem.activation
        if act.kind != "silu":
            raise StageSkipped(
                f"SGLang's DeepGemmRunnerCore asserts activation in ('silu', 'situ'); {act.kind} "
                "does not run on its DeepGEMM runner"
            )
        self._jit_cuda("act_quant", "silu_and_mul[_clamp] + sglang_per_token_group_quant_fp8")
        mm1 = upstream["gemm1"]["mm1"]
        rows, n = mm1.shape
        down = torch.empty((rows, n // 2), dtype=torch.bfloat16, device=mm1.device)
        if act.limit is not None:
            self._clamp_kernel().silu_and_mul_clamp(mm1.view(-1, n), down, act.limit)
        else:
            activation = importlib.import_module("sglang.kernels.ops.activation.activation")
            activation.silu_and_mul(mm1.view(-1, n), down)
        q, s = self._quant_fp8(problem, down)
        out = {
            "a2q": q,
            "a2q_scale": s,
            "layout": GroupedLayout.M_INDICES.value,
            "kernel": self._kernel("silu_and_mul + sglang_per_token_group_quant_fp8"),
        }
        # silu_and_mul and the quantizer compiled with --use_fast_math, as an H200 computes them
        # (reference/activation.py `sglang_sm90_cuda_recipe`: where the golden models them)
        recipe = sglang_sm90_cuda_recipe(act, problem.scale_fmt)
        if recipe is not None and self.compiled_for_sm90(q):
            return self._declare(out, recipe.value)
        return out

    def route(self, ctx: StageContext) -> Outputs:
        """The suite's routing in SGLang's convention for routed_scaling_factor: with a factor
        other than 1, TopK leaves the weights unscaled (topk.py,
        apply_routed_scaling_factor_on_output False on the DeepGEMM runner's path) and the gather
        applies it; the route declares that reading (RoutedScalingRecipe.SCALE_ON_OUTPUT), so
        it is compared against the golden's unscaled weights and isolated mode hands the gather
        those (docs/stage-contract.md#routed-scaling)."""
        problem = ctx.problem
        if problem.routed_scaling_factor == 1.0:
            return super().route(ctx)
        unscaled = ctx.replace(problem=problem.replace(routed_scaling_factor=1.0))
        outputs = super().route(unscaled)
        # declared whatever `declares_recipes` says: it is what the weights mean, not a rounding
        outputs["recipe"] = RoutedScalingRecipe.SCALE_ON_OUTPUT.value
        return outputs

    def gather(self, ctx: StageContext) -> Outputs:
        """post_reorder_deepgemm: each token's fp32 weighted sum over the slots whose src2dst row
        is >= 0, times routed_scaling_factor, one rounding to the output dtype, as
        post_permute_deep_gemm_to_standard calls it. The factor is the problem's where the route
        it reads declares scale_on_output (its weights unscaled: SGLang's own route, or the
        golden's in that reading, isolated), else 1 (the weights carry it: the golden's plain
        route, production mode's)."""
        problem, upstream = ctx.problem, ctx.upstream
        self._require_supported(problem)
        route = upstream["route"]
        scaling = routed_scale_on_output(route, problem.routed_scaling_factor)
        ids, weights = route["topk_ids"], route["topk_weights"]
        # the kernel indexes rows by hidden_size: hand it a contiguous mm2
        mm2 = upstream["gemm2"]["mm2"].contiguous()
        tokens, hidden = ids.shape[0], mm2.shape[1]
        out = self._buffer(ctx, "out", (tokens, hidden), torch.bfloat16, mm2.device)
        if tokens:
            with self._on_host(launch=True):
                self.sglang.ep.post_reorder_deepgemm(
                    mm2,
                    out,
                    upstream["permute"]["inv_perm"].contiguous(),
                    ids,
                    weights.contiguous(),
                    ids.shape[1],
                    tokens,
                    hidden,
                    scaling,
                )
        return {"out": ctx.buffers.own(out), "kernel": self._kernel("post_reorder_deepgemm")}

    # -- GEMMs: the suite's engine (SGLang's deep_gemm_wrapper is not adapted: no gemm_wrapper) --

    @staticmethod
    def _noted(outputs: Outputs) -> Outputs:
        why = outputs.get("engine_reason")
        outputs["engine_reason"] = (
            f"{why}; " if why else ""
        ) + "the suite's engine (SGLang's deep_gemm_wrapper GEMMs are not adapted)"
        return outputs
