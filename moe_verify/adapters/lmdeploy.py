"""LmdeployBackend: LMDeploy's installed PyTorch-engine FP8 block MoE path, stage by stage.

LMDeploy 0.18's DeepEP normal-mode MoE (`FusedMoENormal.forward`,
lmdeploy/pytorch/backends/cuda/moe/blocked_fp8.py:68) quantizes the hidden states, lets DeepEP
dispatch them (local expert ids, -1 for remote slots, per-expert counts already rounded up to
`expert_alignment=128` on the host), and runs `fused_moe_v3_fp8`
(lmdeploy/pytorch/kernels/cuda/moe/ep_fp8.py:148). Every stage LMDeploy owns calls the installed
LMDeploy function that `fused_moe_v3_fp8` (or its caller) calls; none of its code is copied:

| stage       | LMDeploy 0.18 (lmdeploy.pytorch.kernels.cuda.…)                                  |
| ----------- | -------------------------------------------------------------------------------- |
| quant_input | blocked_gemm_fp8.per_token_group_quant_fp8(x, 128, scale_fmt=None or 'ue8m0')     |
| align       | (DeepEP's count; M_sum = sum of the aligned counts, as ep_fp8.py:159 sizes it)    |
| permute     | moe.ep_fp8.ep_scatter_fp8 (fed DeepEP's aligned counts and local ids)            |
| gemm1/gemm2 | third_party.deep_gemm.m_grouped_fp8_gemm_nt_contiguous where DeepGEMM runs       |
| act_quant   | activation.silu_and_mul + blocked_gemm_fp8.per_token_group_quant_fp8(y, 128)     |
| gather      | moe.ep.ep_gather                                                                 |

route and shared are the suite's, and so is align's count (DeepEP's dispatch computes it in
LMDeploy); the GEMMs run on the suite's Triton engine where DeepGEMM is absent (recorded).

Fixed parameters are declared, and a problem asking another is skipped with the reason: the
alignment is 128 (`expert_alignment=128`, blocked_fp8.py:48; `ep_scatter_fp8` asserts
`m_indices.shape[0] % 128 == 0`, ep_fp8.py:102), the grouped layout is m_indices (LMDeploy passes
no psum layout), the activation is plain silu (`silu_and_mul` has no clamp, no swigluoai), the
scales are fp32 (the ue8m0 packed format is not on this path), H is a multiple of 1024
(`ep_gather` asserts `hidden_size % BLOCK_D == 0` with BLOCK_D = 1024 in 0.18, moe/ep.py:181;
the gather reports that assertion as ep_gather raises it, with the BLOCK_D read from its frame),
and EP places E/N contiguous experts per rank (`num_local_experts = num_experts // ep_size`,
blocked_fp8.py:54, and DeepEP's local ids).

What LMDeploy produces is returned as produced, with these explicit conversions (each in the
stage's `derived` entry): `inv_perm` is `ep_scatter_fp8`'s `output_index` (int64, like the ids
DeepEP hands it) cast to int32; `expert_ends` is the scatter's `expert_start_loc` after the
kernel, whose atomic cursor starts at each aligned segment start and ends at start + live count.
The GEMM's scale layout transform (`get_mn_major_tma_aligned_tensor`) is DeepGEMM's and runs only
where DeepGEMM is installed.

Releases (WINDOW, docs/engines.md): those whose -m lmdeploy tier passed (releases.json), and any
whose kernel sources are byte-identical to theirs (0.17.0's are 0.18.0's); another only with
MOE_VERIFY_LMDEPLOY_UNTESTED=1.

Importing: `lmdeploy/__init__.py` imports the whole serving stack (TurboMind, the API server);
the adapter puts a bare package object for `lmdeploy` (its `__path__` the installed package's)
in sys.modules before importing the kernel modules, so only their closure is imported
(~36 modules, 394 KiB; psutil, pydantic and transformers are its third-party imports).

On a CPU (the Triton interpreter) two switches, and only there: LMDeploy's launchers size their
grids from `kernels.cuda.utils.get_device_props`, which reads `torch.cuda.get_device_properties`;
while an LMDeploy stage runs without CUDA, the name in `blocked_gemm_fp8` and `activation` answers
an H200's properties (132 SMs, 64 warps and 32 blocks per SM, LMDeploy's own SM90 table). The
grids are grid-stride loops, so the properties change the launch, not the result. And
`activation.fast_expf`, a module-level alias of `tl.math.exp` (activation.py:8) that the
interpreter cannot patch, is looked up at call time instead (the same tl.math.exp).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import linecache
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import torch

from moe_verify.adapters import common
from moe_verify.adapters.common import AdaptedBackend, Operand
from moe_verify.adapters.releases import Evidence, ReleaseWindow, module_source, recorded
from moe_verify.spec import (
    ActQuantRecipe,
    Engine,
    GroupedLayout,
    InputQuantRecipe,
    MoEProblem,
    MSumRecipe,
    Placement,
    Recipe,
    ScaleFmt,
    StageContext,
    StageSkipped,
    TopologyKind,
    Trace,
    round_up,
)
from optimized.backend import Outputs
from optimized.deepgemm import choose_grouped_layout
from optimized.topology import hosted_experts

# DeepEP normal mode's expert_alignment in FusedMoENormal (blocked_fp8.py:48), and ep_scatter_fp8's
# BLOCK_E, whose multiple M_sum must be (ep_fp8.py:102).
ALIGNMENT = 128
# _quant_fp8_kernel's columns per CTA for bf16 input (512 bytes a warp, 2 warps): a K that is a
# multiple takes the unmasked branch, the one the Triton interpreter runs.
INTERPRETED_QUANT_COLUMNS = 512
# LMDeploy's own SM90 entries (kernels/cuda/utils.py WARPS_PER_SM, BLOCKS_PER_SM) and an H200's SMs.
H200_PROPS = {
    "multi_processor_count": 132,
    "compute_capability": (9, 0),
    "warps_per_sm": 64,
    "blocks_per_sm": 32,
}

_CUDA = "lmdeploy.pytorch.kernels.cuda"
# attribute -> (module, the names the adapter calls in it)
_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "quant": (f"{_CUDA}.blocked_gemm_fp8", ("per_token_group_quant_fp8", "get_device_props")),
    "activation": (f"{_CUDA}.activation", ("silu_and_mul", "get_device_props")),
    "ep_fp8": (f"{_CUDA}.moe.ep_fp8", ("ep_scatter_fp8", "fused_moe_v3_fp8")),
    "ep": (f"{_CUDA}.moe.ep", ("ep_gather",)),
}


# The releases the adapter admits, on what evidence (moe_verify/adapters/releases.py): those whose
# -m lmdeploy tier passed, and any whose kernel sources are identical to theirs: the modules above,
# get_device_props' (kernels/cuda/utils.py) and the DeepGEMM wrapper the GEMMs call on a GPU.
WINDOW = ReleaseWindow(
    engine="LMDeploy",
    key="lmdeploy",
    package="lmdeploy",
    dists=("lmdeploy",),
    sources=(
        *(module_source(name) for name, _ in _MODULES.values()),
        "pytorch/kernels/cuda/utils.py",
        "pytorch/third_party/deep_gemm/__init__.py",
    ),
    untested_env="MOE_VERIFY_LMDEPLOY_UNTESTED",
    records=recorded("lmdeploy"),
)
# Set to 1 to run a release outside the window (its kernels may have changed their contract).
UNTESTED_ENV = WINDOW.untested_env


class LmdeployUnavailable(RuntimeError):
    """LMDeploy cannot be adapted here; the message says why and what to do."""


@dataclass(frozen=True)
class LmdeployKernels:
    """The installed LMDeploy's kernel modules the adapter calls, its version, and the switches."""

    version: str
    evidence: Evidence  # what admitted the release (releases.py)
    quant: ModuleType
    activation: ModuleType
    ep_fp8: ModuleType
    ep: ModuleType
    deep_gemm: ModuleType | None  # lmdeploy.pytorch.third_party.deep_gemm, where DeepGEMM imports
    on_cuda: bool
    switches: tuple[str, ...]


def installed_version() -> str:
    return common.installed_version(
        WINDOW.dists,
        LmdeployUnavailable,
        "LMDeploy is not installed; it pins torch<=2.12.1 and triton<=3.7.1, so install it "
        "without its dependencies: pip install --no-deps lmdeploy==0.18.0 psutil pydantic "
        "transformers (docs/implementations.md)",
    )


def check_version(version: str, root: Path | None = None) -> Evidence:
    """The evidence that admits `version` (its kernel sources read under `root`, default the
    installed lmdeploy package), or LmdeployUnavailable naming the window and the opt-in."""
    return common.check_release(WINDOW, version, LmdeployUnavailable, root)


@functools.cache
def load() -> LmdeployKernels:
    """Check the installed LMDeploy, import its kernel modules without its package root."""
    version = installed_version()
    evidence = check_version(version)
    # lmdeploy/__init__.py imports the serving stack and TurboMind
    stub = "lmdeploy/__init__.py not run: a bare package object stands for it"
    switches = [s for s in (common.stub_package("lmdeploy", LmdeployUnavailable, stub),) if s]
    modules = common.import_kernels(_MODULES, f"LMDeploy {version}", LmdeployUnavailable)
    deep_gemm = None
    if importlib.util.find_spec("deep_gemm") is not None:
        deep_gemm = common.import_module(
            "lmdeploy.pytorch.third_party.deep_gemm", LmdeployUnavailable
        )
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        switches.append("kernels.cuda.utils.get_device_props answers an H200's (no CUDA)")
    return LmdeployKernels(
        version=version,
        evidence=evidence,
        deep_gemm=deep_gemm,
        on_cuda=on_cuda,
        switches=tuple(switches),
        **modules,
    )


def availability() -> tuple[bool, str]:
    """(usable, why): whether the adapter can load the installed LMDeploy here."""
    return common.availability(load, LmdeployUnavailable, "LMDeploy")


def aligned_counts(counts: torch.Tensor, alignment: int) -> torch.Tensor:
    """int32 [E_l]: each expert's count rounded up to the alignment, as DeepEP's normal dispatch
    hands `num_recv_tokens_per_expert` to fused_moe_v3_fp8 (expert_alignment)."""
    c = counts.to(torch.int64)
    return round_up(c, alignment).to(torch.int32)


def local_ids(ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """int64 [M,k]: the ids as DeepEP's dispatch hands them to LMDeploy: local expert ids, -1 for
    a slot no local expert serves (and for -1 slots)."""
    ids = ids.to(torch.int64)
    if expert_map is None:
        return ids
    return torch.where(ids >= 0, expert_map[ids.clamp(min=0)].to(torch.int64), -1)


def _interpreted_exp(x: Any) -> Any:
    """tl.math.exp looked up when called: the Triton interpreter patches tl.math while a kernel
    runs, but not the module-level alias `activation.fast_expf = tl.math.exp` bound at import."""
    import triton.language as tl

    return tl.math.exp(x)


class LmdeployBackend(AdaptedBackend):
    """LMDeploy's fused_moe_v3_fp8 path (fp8_block, SM90 scales) as a Backend; see the module
    docstring."""

    name = label = "lmdeploy"
    gemm_wrapper = "lmdeploy.pytorch.third_party.deep_gemm"

    def __init__(self, engine: Engine | str = Engine.AUTO) -> None:
        self.lmd = load()
        super().__init__(
            self.lmd.version,
            engine,
            wrapper_runs=self.lmd.deep_gemm is not None,
            fallback="no DeepGEMM for lmdeploy.pytorch.third_party.deep_gemm: Triton",
            # LMDeploy sizes the permuted buffer from DeepEP's host counts (ep_fp8.py:159)
            exact_m_sum=True,
        )

    # -- helpers ---------------------------------------------------------------------------------

    def _require_supported(self, problem: MoEProblem) -> None:
        if problem.recipe is not Recipe.FP8_BLOCK:
            raise StageSkipped(f"LMDeploy's fused_moe_v3_fp8 runs fp8_block; not {problem.recipe}")
        if problem.scale_fmt is ScaleFmt.UE8M0_PACKED:
            raise StageSkipped(
                "fused_moe_v3_fp8 hands DeepGEMM fp32 scales (per_token_group_quant_fp8 packs "
                "nothing); the ue8m0_packed format is not on this path"
            )
        topo = problem.topology
        if problem.batched:
            raise StageSkipped(
                "the masked layout (ep:N+ll's) runs LMDeploy's FusedMoELowLatency; not adapted"
            )
        if topo.kind in (TopologyKind.EP, TopologyKind.EP_HT):
            per = problem.num_experts // topo.size
            if topo.placement is Placement.EXPLICIT or problem.num_experts % topo.size:
                raise StageSkipped(
                    "LMDeploy places num_experts // ep_size contiguous experts per rank "
                    "(blocked_fp8.py:54); this placement is not one it runs"
                )
            assert per > 0

    def _check_placement(self, problem: MoEProblem, rank: int) -> None:
        if problem.topology.kind is TopologyKind.TP:
            return
        per = problem.num_experts // problem.topology.size
        if hosted_experts(problem, rank) != list(range(rank * per, (rank + 1) * per)):
            raise StageSkipped("the suite's placement is not LMDeploy's contiguous E/N blocks")

    def _require_layout(self, problem: MoEProblem) -> None:
        if choose_grouped_layout(problem).layout is not GroupedLayout.M_INDICES:
            raise StageSkipped(
                "fused_moe_v3_fp8 hands DeepGEMM m_indices (no psum layout): run it with "
                "--grouped-layout m_indices or auto"
            )

    @contextlib.contextmanager
    def _device_props(self) -> Iterator[None]:
        """Without CUDA, get_device_props (torch.cuda.get_device_properties) raises: answer an
        H200's while an LMDeploy stage runs (the CPU switch; never with CUDA)."""
        if self.lmd.on_cuda:
            yield
            return

        def props(device: Any = None) -> dict[str, Any]:
            return dict(H200_PROPS)

        with (
            mock.patch.object(self.lmd.quant, "get_device_props", props),
            mock.patch.object(self.lmd.activation, "get_device_props", props),
            mock.patch.object(self.lmd.activation, "fast_expf", _interpreted_exp),
        ):
            yield

    def _require_interpretable_quant(self, name: str, columns: int) -> None:
        """Under the Triton interpreter (3.9) the masked branch of LMDeploy's _quant_fp8_kernel
        fails ('mask has unsupported dtype', blocked_gemm_fp8.py:87): a CPU limit, not
        LMDeploy's; it runs only widths that are a multiple of the columns a CTA takes."""
        if not self.lmd.on_cuda and columns % INTERPRETED_QUANT_COLUMNS:
            raise StageSkipped(
                "under the Triton interpreter (3.9) the masked branch of LMDeploy's "
                "_quant_fp8_kernel fails ('mask has unsupported dtype', blocked_gemm_fp8.py:87): "
                f"{name} must be a multiple of {INTERPRETED_QUANT_COLUMNS} on a CPU; "
                f"{name} = {columns}"
            )

    def _tma_aligned(self, scale: torch.Tensor) -> torch.Tensor:
        """DeepGEMM's MN-major TMA-aligned scales, as fused_moe_v3_fp8 hands them to the GEMM."""
        if self.lmd.deep_gemm is None:
            return scale
        return self.lmd.deep_gemm.get_mn_major_tma_aligned_tensor(scale)

    # -- stages ----------------------------------------------------------------------------------

    def dispatch(self, ctx: StageContext) -> Outputs:
        raise StageSkipped("ep:N+ll runs LMDeploy's FusedMoELowLatency; not adapted")

    def quant_input(self, ctx: StageContext) -> Outputs:
        """FusedMoENormal.forward's quantizer (blocked_fp8.py:79): per_token_group_quant_fp8 with
        the model's scale_fmt ('ue8m0' rounds the scale up to a power of two)."""
        problem, inputs, upstream = ctx.problem, ctx.inputs, ctx.upstream
        self._require_supported(problem)
        hidden = inputs.hidden_states
        if "token_index" in upstream["route"]:
            hidden = hidden[upstream["route"]["token_index"]]
        fmt = "ue8m0" if problem.scale_fmt.is_ue8m0 else None
        self._require_interpretable_quant("H", hidden.shape[1])
        with self._device_props():
            q, s = self.lmd.quant.per_token_group_quant_fp8(
                hidden, problem.recipe.act_group, scale_fmt=fmt
            )
        out = {"a1q": q, "a1q_scale": s, "kernel": self._kernel("per_token_group_quant_fp8")}
        # Under the interpreter 448 / amax is the IEEE quotient; compiled for an H200 it is
        # div.full.f32, the recorded table's (docs/implementations.md, convention 7). On another
        # GPU no table was recorded: the stage declares nothing and is matched against all.
        if self.compiled_for_sm90(q):
            return self._declare(out, InputQuantRecipe.AMAX_RECIPROCAL_SM90_TRITON.value)
        if q.device.type == "cuda":
            return out
        return self._declare(out, InputQuantRecipe.AMAX_RECIPROCAL.value)

    def align(self, ctx: StageContext) -> Outputs:
        """DeepEP's count (the suite's here) and the M_sum fused_moe_v3_fp8 allocates:
        sum(num_recv_tokens_per_expert), the counts rounded up to 128 (exact_counts)."""
        problem, rank = ctx.problem, ctx.rank
        self._require_supported(problem)
        self._check_placement(problem, rank)
        if problem.alignment != ALIGNMENT:
            raise StageSkipped(
                f"LMDeploy's DeepEP dispatch aligns each expert to {ALIGNMENT} "
                f"(expert_alignment, blocked_fp8.py:48); run it with --alignment {ALIGNMENT}"
            )
        out = super().align(ctx)
        out["recipe"] = MSumRecipe.EXACT_COUNTS.value
        return self.suite_code(out, "count in DeepEP's role; M_sum as fused_moe_v3_fp8 sizes it")

    def permute(self, ctx: StageContext) -> Outputs:
        """ep_scatter_fp8 on DeepEP's inputs: local ids, the aligned counts, M_sum rows."""
        problem, upstream = ctx.problem, ctx.upstream
        self._require_supported(problem)
        self._require_layout(problem)
        sh = ctx.shard
        align, quant = upstream["align"], upstream["quant_input"]
        a1q, a1q_scale = quant["a1q"], quant["a1q_scale"]
        if a1q_scale.dtype != torch.float32:
            raise StageSkipped(f"ep_scatter_fp8 copies fp32 scales; got {a1q_scale.dtype}")
        ids = local_ids(upstream["route"]["topk_ids"], sh.expert_map)
        m_sum, hidden = int(align["M_sum"]), a1q.shape[1]
        dev = a1q.device
        ws = ctx.buffers
        # allocated as fused_moe_v3_fp8 does (torch.empty, ep_fp8.py:167-171), or the workspace's
        a_perm = self._buffer(ctx, "a_perm", (m_sum, hidden), a1q.dtype, dev)
        a_scale_perm = self._buffer(
            ctx, "a_scale_perm", (m_sum, a1q_scale.shape[1]), torch.float32, dev
        )
        m_indices = self._buffer(ctx, "m_indices", (m_sum,), torch.int32, dev)
        output_index = torch.empty_like(ids)
        recv = aligned_counts(align["counts"], int(align["alignment"]))
        expert_start_loc = torch.empty_like(recv)
        self.lmd.ep_fp8.ep_scatter_fp8(
            a1q,
            a1q_scale,
            ids,
            recv,
            expert_start_loc,
            a_perm,
            a_scale_perm,
            m_indices,
            output_index,
        )
        return {
            "a_perm": ws.own(a_perm),
            "a_scale_perm": ws.own(a_scale_perm),
            "m_indices": ws.own(m_indices),
            "expert_ends": expert_start_loc,
            "inv_perm": output_index.to(torch.int32),
            "layout": GroupedLayout.M_INDICES.value,
            "derived": "inv_perm: ep_scatter_fp8's int64 output_index cast to int32; "
            "expert_ends: its expert_start_loc after the kernel (the atomic cursor, which ends "
            "at segment start + live count)",
            "kernel": self._kernel("ep_scatter_fp8"),
        }

    def act_quant(self, ctx: StageContext) -> Outputs:
        """silu_and_mul into bf16, then per_token_group_quant_fp8 with no scale_fmt, as
        fused_moe_v3_fp8 calls them (ep_fp8.py:186-189)."""
        problem, upstream = ctx.problem, ctx.upstream
        self._require_supported(problem)
        self._require_layout(problem)
        act = problem.activation
        if act.kind != "silu" or act.limit is not None:
            raise StageSkipped(f"LMDeploy's silu_and_mul is plain silu; not {act}")
        mm1 = upstream["gemm1"]["mm1"]
        rows, width = mm1.shape[0], mm1.shape[1] // 2
        self._require_interpretable_quant("Ip", width)
        down_input = torch.empty((rows, width), dtype=torch.bfloat16, device=mm1.device)
        with self._device_props():
            self.lmd.activation.silu_and_mul(mm1, down_input)
            q, s = self.lmd.quant.per_token_group_quant_fp8(down_input, problem.recipe.act_group)
        out = {
            "a2q": q,
            "a2q_scale": s,
            "layout": GroupedLayout.M_INDICES.value,
            "kernel": self._kernel("silu_and_mul + per_token_group_quant_fp8"),
        }
        # Compiled for an H200: tl.exp and the divisions as the recorded tables hold them
        # (docs/implementations.md, convention 7); on another GPU nothing is declared.
        if self.compiled_for_sm90(q):
            return self._declare(out, ActQuantRecipe.COLMAJOR_AMAX_RECIPROCAL_SM90_TRITON.value)
        if q.device.type == "cuda":
            return out
        return self._declare(out, ActQuantRecipe.COLMAJOR_AMAX_RECIPROCAL.value)

    def gather(self, ctx: StageContext) -> Outputs:
        """ep_gather: each token's weighted sum over its local slots."""
        problem, upstream = ctx.problem, ctx.upstream
        self._require_supported(problem)
        mm2 = upstream["gemm2"]["mm2"]
        route = upstream["route"]
        ids = local_ids(route["topk_ids"], ctx.shard.expert_map)
        out = self._buffer(ctx, "out", (ids.shape[0], mm2.shape[1]), torch.bfloat16, mm2.device)
        try:
            self.lmd.ep.ep_gather(
                mm2, ids, route["topk_weights"], upstream["permute"]["inv_perm"], out
            )
        except AssertionError as exc:  # checked on the host, before any launch
            raise StageSkipped(self._gather_refusal(exc, mm2.shape[1])) from exc
        return {"out": ctx.buffers.own(out), "kernel": self._kernel("ep_gather")}

    def _gather_refusal(self, exc: AssertionError, hidden: int) -> str:
        """ep_gather's own shape assertion, named with the BLOCK_D it checked, read from its
        frame: a release that changes BLOCK_D is followed, not restated (finding 7). Any other
        assertion is re-raised."""
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is None or tb.tb_frame.f_code.co_name != "ep_gather":
            raise exc
        frame = tb.tb_frame
        if "BLOCK_D" not in frame.f_locals:
            raise exc
        where = f"{Path(frame.f_code.co_filename).name}:{tb.tb_lineno}"
        line = linecache.getline(frame.f_code.co_filename, tb.tb_lineno).strip()
        return (
            f"LMDeploy {self.lmd.version}'s ep_gather refuses this shape: `{line}` ({where}) with "
            f"BLOCK_D = {frame.f_locals['BLOCK_D']}, H = {hidden} "
            "(docs/implementations.md, finding 7)"
        )

    # -- GEMMs: LMDeploy's DeepGEMM wrapper where DeepGEMM runs (common.AdaptedBackend) -------

    def _check_gemm(self, problem: MoEProblem) -> None:
        self._require_layout(problem)

    def _call_gemm(
        self, problem: MoEProblem, upstream: Trace, a: Operand, b: Operand, out: torch.Tensor
    ) -> None:
        """m_grouped_fp8_gemm_nt_contiguous as _deepgemm_grouped_fp8_nt_contiguous calls it
        (ep_fp8.py:143): activation scales MN-major TMA-aligned, LMDeploy's m_indices."""
        dg = self.lmd.deep_gemm
        assert dg is not None
        a_q, a_scale = a
        dg.m_grouped_fp8_gemm_nt_contiguous(
            (a_q, self._tma_aligned(a_scale)), b, out, upstream["permute"]["m_indices"]
        )
