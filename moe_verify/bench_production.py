"""`moe-verify bench --production`: the production forward timed as vLLM runs it, beside what
bounds it: DeepGEMM's GEMMs alone on the same operands and the byte floor of the memory stages.

Issue #13's targets on the H200 are named constants below (`TARGETS`), each with its reason, and
every row says met, not met or n/a. All numbers of one table come from one process, side by side:

- production stages: a forward with taps gives each stage its inputs; each stage method of the
  backend (`OptimizedBackend`, run as production mode runs it: graph-safe) is then captured
  alone in its own CUDA graph (after a warm-up call, `CALLS_PER_GRAPH` calls back to back) and
  timed by replaying it (CUDA events, median of repeats, divided by the calls). No validation:
  production mode has none.
- the whole forward: the op (`torch.ops.moe_verify.fused_moe`) captured once and replayed.
- DeepGEMM alone: deep_gemm's grouped GEMM called directly on the very tensors the production
  GEMM stage read and wrote (permuted operands, grouped-layout tensor, output buffer), captured
  and replayed the same way, so the ratio is the cost of everything around DeepGEMM's kernel.
- the byte floor: `floor_bytes` of each memory-bound stage at the copy bandwidth measured in the
  same run (`bench.copy_bandwidth`, a 1 GiB copy: it does not fit in L2).
- launches: the GPU's kernel events of one eager forward (torch.profiler).
- verification mode: `OptimizedBackend` eager, with its host validation, per stage, apart.

Replaying one stage keeps its inputs in L2 where they fit, as a real layer's neighbours would
not; DeepGEMM alone runs under the same condition, so that ratio is fair, and the floor's
bandwidth is a DRAM figure, so a memory stage small enough to live in L2 can exceed 100% of it.

The exact-count path (ep:N+ht) reads the counts on the host and cannot be captured: it is timed
eagerly on the GPU and says so. Without a GPU everything is eager (perf_counter), the tables say
"eager (no CUDA graphs on this machine)", and no target is judged: those numbers are the
tool's plumbing, not performance.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moe_verify.bench import copy_bandwidth
from moe_verify.device import default_device
from moe_verify.inputs import make_inputs
from moe_verify.spec import (
    MAX_TOKENS,
    Engine,
    GroupedLayout,
    MoEInputs,
    MoEProblem,
    Stage,
    Trace,
    check_int,
)
from moe_verify.timing import median_seconds, replay_seconds
from optimized import deepgemm, op, production
from optimized.production import (
    BATCHED,
    CarvedBuffers,
    ForwardConfig,
    RankWeights,
    Taps,
    prepare_rank_weights,
    rank_inputs,
    workspace_bytes,
    workspace_layout,
)
from reference.moe import ReferenceBackend

DECODE_TOKENS = (1, 8, 32, 128)

# Calls captured back to back in one graph and timed as one replay: a replay costs a few
# microseconds of launch on its own, which vLLM pays once per model graph, not once per stage.
CALLS_PER_GRAPH = 10
GRAPH_TIMING = (
    f"CUDA graph replay (each stage captured alone, {CALLS_PER_GRAPH} calls per graph, "
    "time per call)"
)
CPU_TIMING = "eager (no CUDA graphs on this machine)"
HT_TIMING = (
    "eager on the GPU: the exact-count path (ep:N+ht) reads the counts on the host once per "
    "call, so it cannot be captured"
)
NOT_JUDGED = "targets are stated for graph-replayed times on the H200"


class Verdict(enum.StrEnum):
    MET = "met"
    NOT_MET = "not met"
    NA = "n/a"


@dataclass(frozen=True)
class Target:
    """One of issue #13's performance targets: `value <= limit` (at_most) or `>= limit`, at the
    token counts it is stated for (`tokens`; empty: every T)."""

    name: str
    limit: float
    at_most: bool
    reason: str
    tokens: tuple[int, ...] = ()

    def judge(self, value: float | None, tokens: int) -> Verdict:
        """MET or NOT_MET for a measured `value` at `tokens`; NA when there is no value or the
        target is not stated for this T."""
        if value is None or not math.isfinite(value):
            return Verdict.NA
        if self.tokens and tokens not in self.tokens:
            return Verdict.NA
        ok = value <= self.limit if self.at_most else value >= self.limit
        return Verdict.MET if ok else Verdict.NOT_MET

    @property
    def text(self) -> str:
        return self.name.format(limit=self.limit)


GEMM_VS_DEEPGEMM = Target(
    "<= {limit:.2f}x DeepGEMM alone",
    1.05,
    True,
    "a production GEMM stage is DeepGEMM's kernel plus nothing a graph replays but its own "
    "launch: more than 5% over the kernel alone is work around it that should not be there",
)
MEMORY_BANDWIDTH = Target(
    ">= {limit:.0%} of copy bandwidth",
    0.70,
    False,
    "input quant, scatter, act_quant and gather only move bytes: each should stream its byte "
    "floor at no less than 70% of what a plain device copy achieves in the same run",
)
FORWARD_VS_FLOOR = Target(
    "<= {limit:.2f}x (GEMMs alone + byte floor)",
    1.15,
    True,
    "at prefill sizes the forward is its two GEMMs plus bandwidth-bound stages; 15% over their "
    "sum bounds what launches, gaps and padding may cost",
    tokens=(512, 4096),
)
DECODE_VS_GEMMS = Target(
    "<= {limit:.2f}x the two GEMMs alone",
    1.3,
    True,
    "at decode sizes (DeepSeek-V3 EP8-local) the GEMMs read the weights and dominate; the other "
    "stages and the launches may add at most 30%",
    tokens=DECODE_TOKENS,
)
TARGETS = (GEMM_VS_DEEPGEMM, MEMORY_BANDWIDTH, FORWARD_VS_FLOOR, DECODE_VS_GEMMS)

# Memory-bound stages with a byte target; dispatch has a floor (any replacement must move its
# bytes) but no target: it stands in for DeepEP's low-latency dispatch, a communication kernel.
MEMORY_STAGES = (Stage.QUANT_INPUT, Stage.PERMUTE, Stage.ACT_QUANT, Stage.GATHER)
FLOORED_STAGES = (*MEMORY_STAGES, Stage.DISPATCH)
GEMM_STAGES = (Stage.GEMM1, Stage.GEMM2)
CONTIGUOUS_STAGES = (
    Stage.QUANT_INPUT, Stage.ALIGN, Stage.PERMUTE, Stage.GEMM1, Stage.ACT_QUANT, Stage.GEMM2,
    Stage.GATHER,
)  # fmt: skip
BATCHED_STAGES = (
    Stage.QUANT_INPUT, Stage.DISPATCH, Stage.GEMM1, Stage.ACT_QUANT, Stage.GEMM2, Stage.GATHER,
)  # fmt: skip
_NO_TARGET = {
    Stage.ALIGN: "a count over T*k ids: latency-bound bookkeeping, no byte target",
    Stage.DISPATCH: "stands in for DeepEP's low-latency dispatch (communication, not under test)",
}


# -- the byte floor --------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """What one call's memory-bound stages must move, read from the call's own routing.

    tokens: rows of hidden states this rank quantizes (the received tokens on ep:N+ht);
    live_tokens: those with at least one slot on this rank's experts; live_slots: the (token, k)
    slots on this rank's experts (past the capacity of the batched layout: dropped, not live);
    a1_scale_row / a2_scale_row: bytes of one row of a1q_scale / a2q_scale in the format the
    recipe uses (fp32 groups, E8M0 bytes, or packed UE8M0 int32 words).
    """

    tokens: int
    live_tokens: int
    live_slots: int
    hidden: int
    intermediate: int
    a1_scale_row: int
    a2_scale_row: int


def floor_bytes(stage: Stage | str, t: Traffic) -> int:
    """Bytes `stage` must move (reads + writes), the numerator of its fraction of bandwidth.

    Only bytes no correct implementation can avoid count, so the floor is never inflated and a
    stage's fraction is never flattered:
    - live rows only, never padding rows (each segment's tail up to the alignment, and the rows
      between the exact M_sum and the bound): vLLM leaves them unwritten and the GEMMs skip
      them, so a kernel that zeroes or processes them pays for it in its fraction;
    - a token row is read once, however many of its slots are live (scatter, dispatch);
    - routing metadata (ids, weights, inv_perm, m_indices, counts: O(T*k) small ints) is left
      out: what a kernel reads of it depends on its layout choice, and it is < 1% at H >= 1024.

    quant_input: read T*H bf16; write T*H fp8 and T scale rows.
    permute, dispatch: read live_tokens rows of a1q and their scales; write live_slots of them.
    act_quant: read live_slots rows of mm1 (2I bf16); write live_slots rows of a2q (I fp8) and
        their scales.
    gather: read live_slots rows of mm2 (H bf16); write T*H bf16 (every token: zero where none
        of its slots is live).
    """
    h, i = t.hidden, t.intermediate
    a1_row = h + t.a1_scale_row
    stage = Stage(stage)
    if stage is Stage.QUANT_INPUT:
        return t.tokens * h * 2 + t.tokens * a1_row
    if stage in (Stage.PERMUTE, Stage.DISPATCH):
        return t.live_tokens * a1_row + t.live_slots * a1_row
    if stage is Stage.ACT_QUANT:
        return t.live_slots * 2 * i * 2 + t.live_slots * (i + t.a2_scale_row)
    if stage is Stage.GATHER:
        return t.live_slots * h * 2 + t.tokens * h * 2
    raise ValueError(
        f"floor_bytes: stage: expected one of {[s.value for s in FLOORED_STAGES]}, got "
        f"{stage.value!r}"
    )


def _scale_row_bytes(scale: torch.Tensor) -> int:
    return scale.shape[-1] * scale.element_size()


def traffic_of(cfg: ForwardConfig, hidden: torch.Tensor, taps: Taps) -> Traffic:
    """The Traffic of the tapped call (one host read of the slot maps: bench, not production)."""
    if cfg.layout == BATCHED:
        live = taps[Stage.DISPATCH.value]["slot"] >= 0
    else:
        live = taps[Stage.PERMUTE.value]["inv_perm"] >= 0
    return Traffic(
        tokens=hidden.shape[0],
        live_tokens=int(live.any(dim=1).sum()),
        live_slots=int(live.sum()),
        hidden=cfg.hidden,
        intermediate=cfg.intermediate,
        a1_scale_row=_scale_row_bytes(taps[Stage.QUANT_INPUT.value]["a1q_scale"]),
        a2_scale_row=_scale_row_bytes(taps[Stage.ACT_QUANT.value]["a2q_scale"]),
    )


# -- rows ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageRow:
    """One production stage: its time and what bounds it (a byte floor or DeepGEMM alone).

    of_bandwidth: floor_us / median_us (the floor streamed at this fraction of copy bandwidth);
    vs_deepgemm: median_us / deepgemm_us. note: why a bound or the verdict is absent.
    """

    stage: str
    median_us: float
    floor_bytes: int | None = None
    floor_us: float | None = None
    of_bandwidth: float | None = None
    deepgemm_us: float | None = None
    vs_deepgemm: float | None = None
    target: str = ""
    verdict: Verdict = Verdict.NA
    note: str = ""


def memory_row(
    stage: Stage,
    seconds: float,
    nbytes: int,
    bandwidth: float,
    tokens: int,
    judged: bool,
) -> StageRow:
    """A floored stage's row; `bandwidth` in bytes/s (read + write counted, as the floor is)."""
    floor = nbytes / bandwidth
    fraction = floor / seconds if seconds > 0 else None
    if stage not in MEMORY_STAGES:
        return StageRow(
            stage.value, seconds * 1e6, nbytes, floor * 1e6, fraction, note=_NO_TARGET[stage]
        )
    verdict = MEMORY_BANDWIDTH.judge(fraction, tokens) if judged else Verdict.NA
    return StageRow(
        stage.value, seconds * 1e6, nbytes, floor * 1e6, fraction,
        target=MEMORY_BANDWIDTH.text, verdict=verdict, note="" if judged else NOT_JUDGED,
    )  # fmt: skip


def gemm_row(
    stage: Stage,
    seconds: float,
    deepgemm_seconds: float | None,
    absent: str,
    tokens: int,
    judged: bool,
) -> StageRow:
    """A GEMM stage's row beside DeepGEMM alone (`absent`: why there is no DeepGEMM time)."""
    if deepgemm_seconds is None:
        return StageRow(
            stage.value, seconds * 1e6, target=GEMM_VS_DEEPGEMM.text,
            note=f"DeepGEMM alone absent: {absent}",
        )  # fmt: skip
    ratio = seconds / deepgemm_seconds
    verdict = GEMM_VS_DEEPGEMM.judge(ratio, tokens) if judged else Verdict.NA
    return StageRow(
        stage.value, seconds * 1e6, deepgemm_us=deepgemm_seconds * 1e6, vs_deepgemm=ratio,
        target=GEMM_VS_DEEPGEMM.text, verdict=verdict, note="" if judged else NOT_JUDGED,
    )  # fmt: skip


@dataclass(frozen=True)
class VerificationRow:
    """A stage of verification mode: `OptimizedBackend` eager, with host validation."""

    stage: str
    median_us: float


@dataclass(frozen=True)
class Environment:
    """Where the numbers were measured (the header of every table; the lead adds the commit)."""

    date: str
    device: str
    torch: str
    triton: str
    deep_gemm: str

    @staticmethod
    def here(device: torch.device) -> Environment:
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = "absent"
        status = deepgemm.probe()
        dg = str(status.version) if status.usable else f"unusable ({status.reason})"
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
        return Environment(
            datetime.date.today().isoformat(), name, torch.__version__, triton_version, dg
        )

    @property
    def line(self) -> str:
        return (
            f"{self.date} · {self.device} · torch {self.torch} · triton {self.triton} · "
            f"deep_gemm {self.deep_gemm}"
        )


@dataclass(frozen=True)
class ProductionBench:
    """One rank's production forward, stage by stage, beside its bounds (`to_markdown`).

    floor_us: the byte floor of every floored stage (the memory stages, and the dispatch when
    batched: whatever replaces that stand-in must move its bytes too);
    gemms_alone_us: both GEMMs through DeepGEMM alone (None: the GEMM rows say why);
    forward_vs_bound: forward_us / (gemms_alone_us + floor_us), judged by FORWARD_VS_FLOOR;
    forward_vs_gemms: forward_us / gemms_alone_us, judged by DECODE_VS_GEMMS (bench_decode).
    launches: kernels of one eager forward, memops its memsets and copies (None: launch_note).
    """

    problem: MoEProblem
    rank: int
    engine: str
    layout: str
    timing: str
    repeats: int
    environment: Environment
    bandwidth: float  # bytes/s of the same-run device copy
    traffic: Traffic
    m_sum_rows: int  # rows the GEMMs run over (M_sum, or E_l * capacity when batched)
    stages: tuple[StageRow, ...]
    forward_us: float
    gemms_alone_us: float | None
    floor_us: float
    launches: int | None
    memops: int | None
    launch_note: str
    verification: tuple[VerificationRow, ...] = ()

    @property
    def tokens(self) -> int:
        return self.problem.tokens

    @property
    def judged(self) -> bool:
        return self.timing == GRAPH_TIMING

    @property
    def forward_vs_bound(self) -> float | None:
        if self.gemms_alone_us is None:
            return None
        return self.forward_us / (self.gemms_alone_us + self.floor_us)

    @property
    def forward_vs_gemms(self) -> float | None:
        return None if self.gemms_alone_us is None else self.forward_us / self.gemms_alone_us

    def forward_verdict(self, target: Target) -> Verdict:
        value = self.forward_vs_gemms if target is DECODE_VS_GEMMS else self.forward_vs_bound
        return target.judge(value, self.tokens) if self.judged else Verdict.NA

    def stage_us(self, stage: str) -> float | None:
        return next((r.median_us for r in self.stages if r.stage == stage), None)

    def to_markdown(self) -> str:
        t = self.traffic
        rows_note = f"live slots {t.live_slots} of {self.m_sum_rows} permuted rows"
        lines = [
            f"### Production mode: {self.problem.id}, rank {self.rank}",
            "",
            self.environment.line,
            "",
            f"engine {self.engine}, layout {self.layout}; timing: {self.timing}, median of "
            f"{self.repeats}; copy bandwidth {self.bandwidth / 1e9:.1f} GB/s (same run); "
            f"{t.tokens} tokens, {rows_note}",
            "",
            "| stage | median us | floor MB | floor us | of copy bw | DeepGEMM alone us | "
            "vs DeepGEMM | target | verdict | note |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in self.stages:
            lines.append(
                f"| {r.stage} | {_num(r.median_us)} | {_mb(r.floor_bytes)} | {_num(r.floor_us)} "
                f"| {_pct(r.of_bandwidth)} | {_num(r.deepgemm_us)} | {_ratio(r.vs_deepgemm)} | "
                f"{r.target or '-'} | {r.verdict} | {r.note or '-'} |"
            )
        why = NOT_JUDGED if not self.judged else "-"
        if self.gemms_alone_us is None:
            why = "no DeepGEMM alone: see the GEMM rows"
        lines += [
            "",
            "| whole forward | median us | GEMMs alone us | byte floor us | ratio | target | "
            "verdict | kernels | memsets/copies | note |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| {self.problem.id} | {_num(self.forward_us)} | {_num(self.gemms_alone_us)} | "
            f"{_num(self.floor_us)} | {_ratio(self.forward_vs_bound)} | {FORWARD_VS_FLOOR.text} "
            f"(T in {FORWARD_VS_FLOOR.tokens}) | {self.forward_verdict(FORWARD_VS_FLOOR)} | "
            f"{_count(self.launches)} | {_count(self.memops)} | "
            f"{'; '.join(n for n in (why, self.launch_note) if n and n != '-') or '-'} |",
        ]
        if self.verification:
            total = sum(v.median_us for v in self.verification)
            lines += [
                "",
                "Verification mode (eager `OptimizedBackend`, with host validation; not what "
                "production runs, timed apart):",
                "",
                "| stage | median us | vs production |",
                "| --- | --- | --- |",
            ]
            for v in self.verification:
                prod = self.stage_us(v.stage)
                lines.append(
                    f"| {v.stage} | {_num(v.median_us)} | "
                    f"{_ratio(v.median_us / prod if prod else None)} |"
                )
            lines.append(
                f"| total | {_num(total)} | {_ratio(total / self.forward_us)} (vs the forward) |"
            )
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class DecodeBench:
    """The forward at decode sizes: one ProductionBench per T (`to_markdown`: one row each)."""

    problem: MoEProblem
    rows: tuple[ProductionBench, ...]

    def to_markdown(self) -> str:
        first = self.rows[0]
        stages = [r.stage for r in first.stages]
        lines = [
            f"### Decode sizes: {self.problem.id} (T varied), rank {first.rank}",
            "",
            first.environment.line,
            "",
            f"engine {first.engine}, layout {first.layout}; timing: {first.timing}, median of "
            f"{first.repeats}; target {DECODE_VS_GEMMS.text}",
            "",
            "| T | forward us | GEMMs alone us | ratio | verdict | kernels | "
            + " | ".join(f"{s} us" for s in stages)
            + " |",
            "| --- " * (6 + len(stages)) + "|",
        ]
        for row in self.rows:
            per_stage = " | ".join(_num(row.stage_us(s)) for s in stages)
            lines.append(
                f"| {row.tokens} | {_num(row.forward_us)} | {_num(row.gemms_alone_us)} | "
                f"{_ratio(row.forward_vs_gemms)} | {row.forward_verdict(DECODE_VS_GEMMS)} | "
                f"{_count(row.launches)} | {per_stage} |"
            )
        notes = sorted({n for row in self.rows for n in _decode_notes(row)})
        lines += ["", *(f"- {n}" for n in notes)] if notes else []
        return "\n".join(lines) + "\n"


def _decode_notes(row: ProductionBench) -> list[str]:
    notes = [r.note for r in row.stages if r.stage in GEMM_STAGES and r.deepgemm_us is None]
    if not row.judged:
        notes.append(NOT_JUDGED)
    if row.launch_note:
        notes.append(row.launch_note)
    return notes


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _mb(x: int | None) -> str:
    return "-" if x is None else f"{x / 1e6:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _count(x: int | None) -> str:
    return "-" if x is None else str(x)


# -- measuring -------------------------------------------------------------------------------


def _time(fn: Callable[[], object], capture: bool, device: torch.device, repeats: int) -> float:
    """Median seconds of one call of `fn`: replays of its graph (divided by the calls captured
    in it) when `capture`, else eager calls."""
    if not capture:
        return median_seconds(fn, repeats)
    return replay_seconds(fn, device, repeats, CALLS_PER_GRAPH)


def _deepgemm_alone(
    cfg: ForwardConfig, stage: Stage, taps: Taps, w: RankWeights
) -> Callable[[], None]:
    """deep_gemm's own grouped GEMM on the tensors the production `stage` read and wrote.

    The arguments are those `optimized.deepgemm.m_grouped_gemm(_masked)` passes, minus the
    wrapper: no host checks, and no device-side layout copy of the scales (SM100 psum), which
    belongs to the stage's cost, not the kernel's.
    """
    dg = deepgemm.module()
    weight, w_scale = (w.w13, w.w13_scale) if stage is Stage.GEMM1 else (w.w2, w.w2_scale)
    if stage is Stage.GEMM1 and cfg.layout == BATCHED:
        d = taps[Stage.DISPATCH.value]
        a, a_scale = d["a_batched"], d["a_scale_batched"]
        out = taps[Stage.GEMM1.value]["mm1"]
    elif stage is Stage.GEMM1:
        perm = taps[Stage.PERMUTE.value]
        a, a_scale = perm["a_perm"], perm["a_scale_perm"]
        out = taps[Stage.GEMM1.value]["mm1"]
    else:
        a, a_scale = taps[Stage.ACT_QUANT.value]["a2q"], taps[Stage.ACT_QUANT.value]["a2q_scale"]
        out = taps[Stage.GEMM2.value]["mm2"]
    disable_cast = not cfg.scale_fmt.is_ue8m0
    if cfg.layout == BATCHED:
        d = taps[Stage.DISPATCH.value]
        masked_m, expected_m = d["masked_m"], int(d["expected_m"])

        def masked() -> None:
            dg.m_grouped_fp8_gemm_nt_masked(
                (a, a_scale), (weight.q, w_scale), out, masked_m, expected_m,
                disable_ue8m0_cast=disable_cast,
            )  # fmt: skip

        return masked
    psum = cfg.layout == GroupedLayout.PSUM.value
    grouped = taps[Stage.PERMUTE.value]["expert_ends" if psum else "m_indices"]
    kwargs: dict[str, object] = {"disable_ue8m0_cast": disable_cast}
    if weight.fp4 or weight.block != (128, 128):
        kwargs["recipe_a"] = (1, cfg.recipe.act_group)
        kwargs["recipe_b"] = (1, weight.block[1])
    if psum:
        kwargs["use_psum_layout"] = True
        if a_scale.dtype == torch.float32 and deepgemm.probe().arch_major == 10:
            a_scale = a_scale.contiguous()
    gemm = (
        dg.m_grouped_fp8_fp4_gemm_nt_contiguous
        if weight.fp4
        else dg.m_grouped_fp8_gemm_nt_contiguous
    )
    b = weight.q.view(torch.int8) if weight.fp4 else weight.q

    def contiguous() -> None:
        with deepgemm.alignment_scope(cfg.alignment):
            gemm((a, a_scale), (b, w_scale), out, grouped, **kwargs)

    return contiguous


def _deepgemm_absent(
    cfg: ForwardConfig, problem: MoEProblem, engine: Engine, device: torch.device
) -> str:
    """Why DeepGEMM alone cannot be timed beside this forward ("" when it can)."""
    status = deepgemm.probe()
    if device.type != "cuda" or not status.usable:
        return status.reason
    if cfg.engine is not Engine.DEEPGEMM:
        why = deepgemm.choose_engine(problem, problem.tokens, engine).reason
        return (
            f"the production GEMMs run on {cfg.engine.value} ({why}); engine deepgemm puts "
            "DeepGEMM under them"
        )
    return ""


def count_launches(
    fn: Callable[[], object], device: torch.device
) -> tuple[int | None, int | None, str]:
    """(kernels, memsets and copies) one call of `fn` puts on the GPU, read from torch.profiler's
    device events; (None, None, why) without a GPU."""
    if device.type != "cuda":
        return None, None, "no CUDA device: launches are counted from the GPU's kernel events"
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()  # compiles and caches outside the profiled call
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    memops = sum(1 for e in events if e.name.startswith(("Memset", "Memcpy")))
    return len(events) - memops, memops, ""


def _permuted_rows(cfg: ForwardConfig, taps: Taps) -> int:
    """Rows the GEMMs run over in the tapped call: M_sum, or E_l * capacity when batched."""
    if cfg.layout == BATCHED:
        a = taps[Stage.DISPATCH.value]["a_batched"]
        return a.shape[0] * a.shape[1]
    return int(taps[Stage.ALIGN.value]["M_sum"])


def _slice_inputs(inputs: MoEInputs, tokens: int) -> MoEInputs:
    """The first `tokens` tokens of `inputs` (weights shared): one set of weights serves every
    decode size, and each token's routing depends on its own logits only."""

    def head(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[:tokens]

    return dataclasses.replace(
        inputs,
        hidden_states=inputs.hidden_states[:tokens],
        router_logits=inputs.router_logits[:tokens],
        topk_ids=head(inputs.topk_ids),
        topk_weights=head(inputs.topk_weights),
    )


def _measure(
    problem: MoEProblem,
    inputs: MoEInputs,
    rank: int,
    engine: Engine,
    repeats: int,
    bandwidth: float,
    verification: bool,
    backend: str,
) -> ProductionBench:
    device = inputs.hidden_states.device
    on_gpu = device.type == "cuda"
    cfg = ForwardConfig.for_problem(problem, rank, problem.tokens, engine)
    capture = on_gpu and cfg.capturable
    timing = GRAPH_TIMING if capture else (HT_TIMING if on_gpu else CPU_TIMING)
    judged = timing == GRAPH_TIMING
    route = ReferenceBackend().run_stage(Stage.ROUTE, problem, inputs, Trace("golden"), rank)
    hidden = inputs.hidden_states
    if "token_index" in route:  # ep:N+ht: this rank computes only the tokens it receives
        hidden = hidden[route["token_index"]]
    ids, weights_k = route["topk_ids"], route["topk_weights"]
    weights = prepare_rank_weights(cfg, inputs.w13_q, inputs.w2_q)
    t = hidden.shape[0]
    layout = workspace_layout(cfg, t)
    workspace = torch.empty(workspace_bytes(cfg, t), dtype=torch.uint8, device=device)
    runner = op.registered_backend(backend)
    taps: Taps = {}
    production.forward(runner, cfg, hidden, ids, weights_k, weights, workspace, taps)
    upstream = Trace(runner.name, rank)
    for name, outputs in taps.items():
        upstream.add(name, outputs)
    x = rank_inputs(hidden, weights)
    buffers = CarvedBuffers(layout, workspace)
    traffic = traffic_of(cfg, hidden, taps)
    absent = _deepgemm_absent(cfg, problem, engine, device)

    rows = []
    floor_total = 0.0
    gemms_alone: float | None = 0.0
    for stage in BATCHED_STAGES if cfg.layout == BATCHED else CONTIGUOUS_STAGES:

        def call(stage: Stage = stage) -> None:
            with runner.production(cfg, weights, buffers):
                runner.run_stage(stage, problem, x, upstream, rank)

        seconds = _time(call, capture, device, repeats)
        if stage in FLOORED_STAGES:
            nbytes = floor_bytes(stage, traffic)
            floor_total += nbytes / bandwidth
            rows.append(memory_row(stage, seconds, nbytes, bandwidth, problem.tokens, judged))
        elif stage in GEMM_STAGES:
            alone = None
            if not absent:
                alone = _time(_deepgemm_alone(cfg, stage, taps, weights), capture, device, repeats)
            gemms_alone = None if alone is None or gemms_alone is None else gemms_alone + alone
            rows.append(gemm_row(stage, seconds, alone, absent, problem.tokens, judged))
        else:
            rows.append(StageRow(stage.value, seconds * 1e6, note=_NO_TARGET[stage]))

    forward = functools.partial(op.call, cfg, hidden, ids, weights_k, weights, workspace, backend)
    forward_s = _time(forward, capture, device, repeats)
    kernels, memops, launch_note = count_launches(forward, device)
    return ProductionBench(
        problem=problem,
        rank=rank,
        engine=cfg.engine.value,
        layout=cfg.layout,
        timing=timing,
        repeats=repeats,
        environment=Environment.here(device),
        bandwidth=bandwidth,
        traffic=traffic,
        m_sum_rows=_permuted_rows(cfg, taps),
        stages=tuple(rows),
        forward_us=forward_s * 1e6,
        gemms_alone_us=None if gemms_alone is None else gemms_alone * 1e6,
        floor_us=floor_total * 1e6,
        launches=kernels,
        memops=memops,
        launch_note=launch_note,
        verification=_verification(problem, inputs, rank, cfg.engine, repeats, backend)
        if verification
        else (),
    )


def _verification(
    problem: MoEProblem, inputs: MoEInputs, rank: int, engine: Engine, repeats: int, name: str
) -> tuple[VerificationRow, ...]:
    """Verification mode's stages, each fed the backend's own upstream (chained), on the
    production engine: eager calls with every host check the backend runs (a fresh instance of
    the registered backend's class)."""
    backend = type(op.registered_backend(name))(engine=engine)
    trace = backend.run(problem, inputs, rank)
    rows = []
    for stage in problem.stages:
        if stage is Stage.ROUTE:
            continue  # production takes the routing as its input
        run = functools.partial(backend.run_stage, stage, problem, inputs, trace.upto(stage), rank)
        rows.append(VerificationRow(stage.value, median_seconds(run, repeats) * 1e6))
    return tuple(rows)


def _checked(
    problem: object, rank: object, engine: object, repeats: object, device: object
) -> tuple[MoEProblem, int, Engine, int, torch.device]:
    if not isinstance(problem, MoEProblem):
        raise TypeError(f"problem: expected a MoEProblem, got {type(problem).__name__}")
    if problem.tokens < 1:
        raise ValueError(f"problem.tokens: expected >= 1 to time a forward, got {problem.tokens}")
    rank = check_int(f"rank (topology {problem.topology})", rank, 0, problem.topology.size - 1)
    repeats = check_int("repeats", repeats, 1, 1 << 20)
    dev = default_device() if device is None else torch.device(device)
    if dev.type == "cpu" and default_device().type == "cuda":
        raise ValueError(
            "device: expected the GPU on a machine that has one (the Triton kernels run on the "
            "CPU only under the interpreter: hide the GPU with CUDA_VISIBLE_DEVICES= to time "
            f"that), got {dev}"
        )
    return problem, rank, deepgemm.as_engine(engine), repeats, dev


def _bandwidth(device: torch.device) -> float:
    # On a CPU the number only feeds the plumbing: a 16 MiB copy keeps the tests fast.
    return copy_bandwidth(device) if device.type == "cuda" else copy_bandwidth(device, 1 << 24, 3)


def bench_production(
    problem: MoEProblem,
    rank: int = 0,
    engine: Engine | str = Engine.AUTO,
    repeats: int = 20,
    device: torch.device | str | None = None,
    verification: bool = True,
    backend: str = "optimized",
) -> ProductionBench:
    """Time `rank` of `problem` in production mode beside DeepGEMM alone and the byte floor,
    with verification mode's times apart (`verification=False` leaves them out). `backend`: the
    registered backend the op runs (`moe_verify.runner.production_backend` registers one)."""
    problem, rank, engine, repeats, dev = _checked(problem, rank, engine, repeats, device)
    op.registered_backend(backend)  # a clear error before any work
    inputs = make_inputs(problem, dev)
    bandwidth = _bandwidth(dev)
    return _measure(problem, inputs, rank, engine, repeats, bandwidth, verification, backend)


def bench_decode(
    problem: MoEProblem,
    tokens: Sequence[int] = DECODE_TOKENS,
    rank: int = 0,
    engine: Engine | str = Engine.AUTO,
    repeats: int = 20,
    device: torch.device | str | None = None,
    backend: str = "optimized",
) -> DecodeBench:
    """The production forward of `problem` at each decode size in `tokens` (problem.tokens is
    replaced): latency, the two GEMMs alone, their ratio, launches, per-stage latencies. One set
    of inputs is made at the largest T and its first T tokens feed each size."""
    problem, rank, engine, repeats, dev = _checked(problem, rank, engine, repeats, device)
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or not tokens:
        raise ValueError(f"tokens: expected a non-empty sequence of token counts, got {tokens!r}")
    sizes = [check_int("tokens[]", t, 1, MAX_TOKENS) for t in tokens]
    inputs = make_inputs(problem.replace(tokens=max(sizes)), dev)
    bandwidth = _bandwidth(dev)
    rows = tuple(
        _measure(
            problem.replace(tokens=t),
            _slice_inputs(inputs, t),
            rank,
            engine,
            repeats,
            bandwidth,
            verification=False,
            backend=backend,
        )  # fmt: skip
        for t in sizes
    )
    return DecodeBench(problem, rows)
