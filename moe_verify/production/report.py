"""The tables of `moe-verify bench --production [--decode]`: one rank's production forward
stage by stage beside its bounds (`ProductionBench`), the forward at decode sizes
(`DecodeBench`), verification mode's times apart, and where it all was measured (`Environment`).
Each `to_markdown` renders what `moe_verify.production.bench_production` measured; nothing here
times.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from moe_verify.production.targets import (
    DECODE_VS_GEMMS,
    FORWARD_VS_FLOOR,
    GEMM_STAGES,
    GRAPH_TIMING,
    NOT_JUDGED,
    StageRow,
    Target,
    Traffic,
    Verdict,
)
from moe_verify.spec import MoEProblem
from optimized import deepgemm


@dataclass(frozen=True)
class VerificationRow:
    """A stage of verification mode: the stage method eager, with its host validation
    (`median_us`); the same call with validation off (`unchecked_us`: what eager launching alone
    costs, so the difference is the checks); and the host reads the checked call made."""

    stage: str
    median_us: float
    unchecked_us: float | None = None
    host_reads: int | None = None


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
        dg = (
            f"{status.version} ({status.source})"
            if status.usable
            else f"unusable ({status.reason})"
        )
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
    # verification mode's whole forward: the stages chained eagerly with their checks
    verification_forward_us: float | None = None

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
                "Verification mode (the same stage methods called eagerly, with host "
                "validation; not what production runs, timed apart):",
                "",
                "| stage | median us | vs production | without host checks us | host reads |",
                "| --- | --- | --- | --- | --- |",
            ]
            for v in self.verification:
                prod = self.stage_us(v.stage)
                lines.append(
                    f"| {v.stage} | {_num(v.median_us)} | "
                    f"{_ratio(v.median_us / prod if prod else None)} | "
                    f"{_num(v.unchecked_us)} | {_count(v.host_reads)} |"
                )
            unchecked = _total([v.unchecked_us for v in self.verification])
            reads = _total([v.host_reads for v in self.verification])
            lines.append(
                f"| total | {_num(total)} | {_ratio(total / self.forward_us)} (vs the forward) | "
                f"{_num(unchecked)} | {_count(None if reads is None else int(reads))} |"
            )
            if self.verification_forward_us is not None:
                ratio = self.verification_forward_us / self.forward_us
                lines += [
                    "",
                    "The verification-mode forward, the stages chained eagerly with their host "
                    "checks (the rows above each end in a sync; a run does not): "
                    f"{_num(self.verification_forward_us)} us, **{_ratio(ratio)}** the "
                    "production forward.",
                ]
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


def _total(values: list[float | None] | list[int | None]) -> float | None:
    """The sum, or None where any row lacks the number."""
    known = [v for v in values if v is not None]
    return sum(known) if len(known) == len(values) else None


def _count(x: int | None) -> str:
    return "-" if x is None else str(x)
