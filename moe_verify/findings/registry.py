"""The findings as data: what the suite found wrong in an engine's kernels, where, on which
releases, the test that shows it, the upstream reference and what a user should do.

One `Finding` per entry, numbered as docs/implementations.md numbers them. A defect is a kernel
that computes something no legitimate recipe explains; a control is the same edge judged on
another engine, where it holds (finding 2: SGLang bounds the stale ids vLLM indexes by, finding
1): kept here so the engine's tier notices the day it stops holding. Ids are never reused:
`RETIRED` names the ids that left the registry and why.

`seen_in` and `fixed_in` are facts from runs: the releases whose engine tier ran the entry's check
and saw it reproduce (a control: hold), or not. The tiers assert every entry on every release they
run (moe_verify/findings/verdict.py says how a run that disagrees is reported).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from moe_verify.spec import Stage


class Kind(enum.StrEnum):
    DEFECT = "defect"  # the engine's kernel is wrong
    CONTROL = "control"  # the edge a defect is about, judged on another engine: it holds there


# The engines adapted in moe_verify/adapters/, by the name `--backend` takes.
ENGINES = {"vllm": "vLLM", "sglang": "SGLang", "lmdeploy": "LMDeploy"}


@dataclass(frozen=True)
class Upstream:
    """An issue or pull request in the engine's public repository, as last read."""

    repo: str  # owner/name
    number: int
    kind: str  # "pull" or "issue"
    title: str
    state: str  # "open", "merged", "closed"

    @property
    def url(self) -> str:
        return f"https://github.com/{self.repo}/{self.kind}/{self.number}"

    def short(self) -> str:
        return f"{self.repo}#{self.number} ({self.state})"


@dataclass(frozen=True)
class Finding:
    id: int
    engine: str  # a key of ENGINES
    kind: Kind
    seen_in: tuple[str, ...]  # releases where the check reproduced (a control: held)
    stages: tuple[Stage, ...]  # where it shows, in stage order
    what: str  # one sentence
    detail: str  # the code on the engine's side, the conditions, the numbers measured
    where: tuple[str, ...]  # the engine's files and functions, as paths in its package
    evidence: tuple[str, ...]  # pytest node ids that show it
    action: str  # what a user of the engine should do
    upstream: Upstream | None = None
    fixed_in: tuple[str, ...] = ()  # releases where the check ran and it no longer reproduced
    control_of: int | None = None  # a control: the defect whose edge it judges

    @property
    def label(self) -> str:
        return f"finding {self.id}"

    @property
    def engine_name(self) -> str:
        return ENGINES[self.engine]


FINDINGS: tuple[Finding, ...] = (
    Finding(
        id=1,
        engine="vllm",
        kind=Kind.DEFECT,
        seen_in=("0.32.0", "0.33.0", "0.34.0"),
        stages=(Stage.ALIGN, Stage.PERMUTE),
        what="count_expert_num_tokens and ep_scatter index by stale positive expert ids "
        "(CUDA-graph padding rows), reading past the expert map and writing past the segment "
        "cursors.",
        detail="`_count_expert_num_tokens` loads `expert_map + expert_ids` masked by "
        "`expert_ids >= 0` only, so an id at or past the map's length is read from past its end "
        "(align, under EP); `_fwd_kernel_ep_scatter_2` does `atomic_add(expert_start_loc + "
        "expert_id, 1)` under `expert_id >= 0` only, then stores the row at the index it got "
        "(permute, without an expert map). The production op skips ids outside [0, E_global), as "
        "vLLM's own tests/kernels/moe/test_expert_map_bounds.py asks; `moe-verify graph` plants "
        "stale ids (123456789 and 2071690107, beside in-range ones) in the padding rows of a "
        "half-live replay, and under the Triton interpreter the out-of-bounds access is a "
        "segfault. On a GPU (an H100, vLLM 0.34.0's kernel compiled by Triton, through "
        "`moe-verify repro --finding 1`) an id one past the map gives a silently wrong count "
        "(10 for 2) and the large stale ids an illegal memory access; through `moe-verify "
        "graph --backend vllm --replays half-live` the captured replay faults (FAULT, exit 1) "
        "on ep:2 and tp:1 while full replays pass. The stages after "
        "them index by the same ids as read in the code (ep_scatter's and ep_gather's "
        "`apply_expert_map`, masked by `expert_id != -1`); the replay never reaches them.",
        where=(
            "vllm/model_executor/layers/fused_moe/utils.py: _count_expert_num_tokens",
            "vllm/model_executor/layers/fused_moe/deep_gemm_utils.py: _fwd_kernel_ep_scatter_2",
        ),
        evidence=(
            "tests/adapters/test_vllm_graph.py::test_vllm_indexes_by_stale_padding_ids[ep:2]",
            "tests/adapters/test_vllm_graph.py::test_vllm_indexes_by_stale_padding_ids[tp:1]",
        ),
        action="Never let stale ids reach these kernels: fill the padded rows of the topk_ids "
        "buffer with -1 (or run the router over every padded row) before a captured MoE layer "
        "runs, or use a release whose kernels bound ids by the expert count (the open pull "
        "request below).",
        upstream=Upstream(
            "vllm-project/vllm",
            50845,
            "pull",
            "[Bugfix][MoE] Bound expert_map gathers on data-derived expert ids",
            "open",
        ),
    ),
    Finding(
        id=2,
        engine="sglang",
        kind=Kind.CONTROL,
        control_of=1,
        seen_in=("0.5.23",),
        stages=(Stage.ALIGN, Stage.PERMUTE, Stage.GATHER),
        what="fused_moe_dispatch_index, ep_scatter and post_reorder_deepgemm skip stale expert "
        "ids: the edge of finding 1 holds on SGLang.",
        detail="`fused_moe_dispatch_index` and `_fwd_kernel_ep_scatter_2` keep an id only when "
        "`(expert_id >= 0) & (expert_id < num_experts)` after subtracting the rank's first expert; "
        "the scatter writes -1 to `src2dst` for every other slot and the gather skips those. Run "
        "with the -1 slots of an invalid_slots case replaced by stale ids "
        "(123456789, 2071690107 and one past the expert count), align, permute and gather match "
        "the golden in isolated mode (SGLang's quantizers are JIT CUDA, so `moe-verify graph` "
        "cannot run it on a CPU).",
        where=("sglang/kernels/ops/moe/ep_moe_kernels.py: fused_moe_dispatch_index, ep_scatter",),
        evidence=(
            "tests/adapters/test_sglang_findings.py::test_finding_on_the_installed_release[finding2]",
        ),
        action="Nothing: stale ids in CUDA-graph padding rows are skipped.",
    ),
    Finding(
        id=4,
        engine="lmdeploy",
        kind=Kind.DEFECT,
        seen_in=("0.17.0", "0.18.0"),
        stages=(Stage.PERMUTE,),
        what="ep_scatter_fp8 leaves the activation scales of padding rows unwritten, which "
        "ceil-UE8M0 scales cannot afford.",
        detail="`ep_scatter_fp8` writes the scales of live rows only; the rest keep what "
        "`torch.empty` left (NaN under the harness's poison: at ep:2, 5,032 of 5,120 padding "
        "scales of rank 0). With plain fp32 scales that is legitimate (convention 5). With "
        "ceil-UE8M0 scales DeepGEMM's SM100 packer asserts every row it reads is a power of two, "
        "so stale memory there traps the kernel (vLLM hit the same: vllm-project/vllm#49783, "
        "#49784). Harmless on SM90, where DeepGEMM reads fp32 scales row by row.",
        where=("lmdeploy/pytorch/kernels/cuda/moe/ep_fp8.py: ep_scatter_fp8",),
        evidence=(
            "tests/adapters/test_lmdeploy_matrix.py::test_lmdeploy_stage_verdicts"
            "[fp8_block-ep2-T12-H1024-I512-E8-k2-empty_middle-ceil-m_indices]",
        ),
        action="Zero the padding scales (allocate them with torch.zeros, as vLLM does since "
        "#49784) before running ceil-UE8M0 scales on SM100.",
    ),
    Finding(
        id=5,
        engine="lmdeploy",
        kind=Kind.DEFECT,
        seen_in=("0.17.0", "0.18.0"),
        stages=(Stage.ACT_QUANT,),
        what="fused_moe_v3_fp8 quantizes the activations with plain fp32 scales where the input's "
        "are ceil-UE8M0.",
        detail="`fused_moe_v3_fp8` calls `per_token_group_quant_fp8` on the activations without "
        "`scale_fmt`, while the input is quantized with it: at T=12, H=1024, I=512, E=8, k=2 all "
        "44 live scale groups differ (0.00851 vs 0.01562). Harmless on SM90, where DeepGEMM reads "
        "fp32; on SM100 DeepGEMM converts them itself.",
        where=("lmdeploy/pytorch/kernels/cuda/moe/ep_fp8.py: fused_moe_v3_fp8",),
        evidence=(
            "tests/adapters/test_lmdeploy_matrix.py::test_lmdeploy_stage_verdicts"
            "[fp8_block-ep2-T12-H1024-I512-E8-k2-empty_middle-ceil-m_indices]",
        ),
        action="Running E8M0 scales on SM100, expect DeepGEMM's own conversion of the "
        "activation scales, not the model's UE8M0 rounding.",
    ),
    Finding(
        id=6,
        engine="lmdeploy",
        kind=Kind.DEFECT,
        seen_in=("0.17.0", "0.18.0"),
        stages=(Stage.GATHER,),
        what="ep_gather accumulates each token's weighted sum in bf16, not in fp32 with one "
        "rounding.",
        detail="`_fwd_kernel_ep_gather` sets `compute_dtype` to the output's dtype ('align with "
        "xtuner rl'): each product and each partial sum is rounded to bf16. 229-1120 of 12,288 "
        "elements beyond 1 bf16 ulp (up to 29,790 ulp near zero: -0.000212 vs 0.00195), the "
        "per-token error within its bound (0.0075 <= 0.0156). Where a rank sees at most one live "
        "slot per token the sum has one term, is rounded once, and passes.",
        where=("lmdeploy/pytorch/kernels/cuda/moe/ep.py: _fwd_kernel_ep_gather",),
        evidence=(
            "tests/adapters/test_lmdeploy_matrix.py::test_lmdeploy_stage_verdicts"
            "[fp8_block-tp1-T12-H1024-I512-E8-k2-softmax-m_indices]",
        ),
        action="Know that the fp32 accumulation vLLM's and SGLang's gathers do is not there.",
    ),
    Finding(
        id=7,
        engine="lmdeploy",
        kind=Kind.DEFECT,
        seen_in=("0.17.0", "0.18.0"),
        stages=(Stage.GATHER,),
        what="ep_gather refuses a hidden size that is not a multiple of 1024.",
        detail="`ep_gather` asserts `hidden_size % BLOCK_D == 0` with BLOCK_D = 1024, so the "
        "fused path refuses H = 384 or 1536 (the adapter reports the gather skipped with that "
        "reason, and every other stage is still judged). H = 7168 (DeepSeek-V3) runs.",
        where=("lmdeploy/pytorch/kernels/cuda/moe/ep.py: ep_gather",),
        evidence=(
            "tests/adapters/test_lmdeploy_findings.py::test_finding_on_the_installed_release"
            "[finding7]",
        ),
        action="Models whose H is not a multiple of 1024 need another LMDeploy MoE path.",
    ),
)

# Ids that left the registry: never reused.
RETIRED = {
    3: "LMDeploy's quantizer divides as x * (448 / amax): a legitimate recipe now "
    "(amax_reciprocal, docs/implementations.md convention 6)",
}


class RegistryError(ValueError):
    """The registry contradicts itself; the message names the entry."""


def validate(findings: Iterable[Finding] = FINDINGS) -> None:
    """Unique ids (none retired), known engines and stages, releases, evidence, a control's
    defect: the registry's own consistency (whether the evidence collects is a test's)."""
    entries = list(findings)
    by_id = {f.id: f for f in entries}
    if len(by_id) != len(entries):
        dup = sorted({f.id for f in entries if sum(g.id == f.id for g in entries) > 1})
        raise RegistryError(f"finding ids {dup} appear more than once")
    for f in entries:
        where = f"finding {f.id}"
        if f.id in RETIRED:
            raise RegistryError(f"{where}: id {f.id} was retired ({RETIRED[f.id]})")
        if f.engine not in ENGINES:
            raise RegistryError(f"{where}: engine {f.engine!r} is not one of {sorted(ENGINES)}")
        if not f.stages or any(not isinstance(s, Stage) for s in f.stages):
            raise RegistryError(f"{where}: stages must be Stage members, got {f.stages!r}")
        if not f.seen_in:
            raise RegistryError(f"{where}: seen_in is empty (a finding is seen somewhere)")
        both = set(f.seen_in) & set(f.fixed_in)
        if both:
            raise RegistryError(f"{where}: {sorted(both)} both in seen_in and fixed_in")
        if not f.evidence or any("::" not in e for e in f.evidence):
            raise RegistryError(f"{where}: evidence must be pytest node ids, got {f.evidence!r}")
        if (f.kind is Kind.CONTROL) != (f.control_of is not None):
            raise RegistryError(f"{where}: a control (and only a control) names control_of")
        if f.control_of is not None and by_id.get(f.control_of, f).kind is not Kind.DEFECT:
            raise RegistryError(f"{where}: control_of {f.control_of} is not a defect")
        if not f.what.endswith("."):
            raise RegistryError(f"{where}: `what` is one sentence, ending with a period")


def finding(finding_id: int) -> Finding:
    """The entry `finding_id`; a ValueError naming the ids there are."""
    for f in FINDINGS:
        if f.id == finding_id:
            return f
    retired = f" (retired: {RETIRED[finding_id]})" if finding_id in RETIRED else ""
    known = ", ".join(str(f.id) for f in FINDINGS)
    raise ValueError(f"no finding {finding_id}{retired}; the registry has {known}")


def for_engine(engine: str) -> tuple[Finding, ...]:
    """The entries of `engine` (a key of ENGINES), in id order."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; engines: {', '.join(ENGINES)}")
    return tuple(f for f in FINDINGS if f.engine == engine)


validate()
