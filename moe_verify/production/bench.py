"""`moe-verify bench`: time each optimized stage and hold it against the machine's own limits.

Benchmarks are not tests. Every ratio is measured side by side in one run: each stage is fed the
golden's upstream (isolated, so stages are timed on identical inputs), timed with CUDA events as
the median of repeats, and compared with a device-to-device copy (bandwidth-bound stages) and a
dense bf16 matmul (GEMMs) measured in the same process, plus the Triton vs DeepGEMM engines on
the same GEMM. GEMM FLOPs count live rows only (padding rows are waste, reported apart).
`compare_cost` times the suite's own comparisons on the golden's device against the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moe_verify.common import progress
from moe_verify.common.timing import median_seconds
from moe_verify.run.inputs import make_inputs
from moe_verify.spec import (
    GEMM_OUTPUT,
    Engine,
    Mode,
    MoEProblem,
    Stage,
    StageContext,
    Trace,
    call_stage,
)

# Bytes moved by a bandwidth-bound stage, from its inputs and outputs (read + write).
_GEMM_STAGES = (Stage.GEMM1, Stage.GEMM2)


@dataclass(frozen=True)
class StageTiming:
    stage: str
    engine: str
    median_us: float
    work: float  # bytes for bandwidth-bound stages, live FLOPs for GEMMs
    unit: str  # "GB/s" or "TFLOPS"
    achieved: float
    ceiling: float  # the same-run copy bandwidth or dense bf16 matmul rate
    padded_fraction: float = 0.0  # GEMMs: share of computed rows that are padding

    @property
    def of_ceiling(self) -> float:
        return self.achieved / self.ceiling if self.ceiling else float("nan")


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), measured now."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() / seconds


def matmul_rate(device: torch.device, m: int, n: int, k: int, repeats: int = 10) -> float:
    """FLOP/s of a dense bf16 matmul of the given shape, measured now."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    seconds = median_seconds(lambda: a @ b, repeats)
    return 2.0 * m * n * k / seconds


def _nbytes(*tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _stage_bytes(stage: str, up: Trace, out: dict[str, object]) -> int:
    if stage == "quant_input":
        return _nbytes(out["a1q"], out["a1q_scale"]) + _nbytes(out["a1q"]) * 2  # bf16 in
    if stage == "permute":
        live = int((up["route"]["topk_ids"] >= 0).sum())
        row = up["quant_input"]["a1q"].shape[1]
        return 2 * live * row + _nbytes(out["m_indices"], out["inv_perm"])
    if stage == "act_quant":
        return _nbytes(up["gemm1"]["mm1"], out["a2q"], out["a2q_scale"])
    if stage == "gather":
        live = int((up["permute"]["inv_perm"] >= 0).sum())
        hidden = out["out"].shape[1]
        return 2 * live * hidden + _nbytes(out["out"])
    raise ValueError(f"no byte count for stage {stage!r}")


def bench(
    problem: MoEProblem,
    engines: tuple[Engine, ...] = (Engine.TRITON, Engine.DEEPGEMM),
    repeats: int = 20,
    device: torch.device | str | None = None,
) -> list[StageTiming]:
    """Time every stage of rank 0 of `problem`; GEMM stages once per available engine."""
    from optimized.backend import OptimizedBackend
    from optimized.topology import ShardCache
    from reference.moe import ReferenceBackend

    inputs = make_inputs(problem, device)
    dev = inputs.hidden_states.device
    golden = ReferenceBackend().run(problem, inputs, 0)
    shards = ShardCache()
    bandwidth = copy_bandwidth(dev) if dev.type == "cuda" else float("nan")
    timings: list[StageTiming] = []
    for stage in progress.steps(problem.stages, f"bench {problem.id}", "stage", label=str):
        if stage in (Stage.ROUTE, Stage.ALIGN, Stage.DISPATCH):
            continue  # host bookkeeping or communication stand-ins, not kernels under test
        up = golden.upto(stage)
        for engine in engines if stage in _GEMM_STAGES else (Engine.TRITON,):
            backend = OptimizedBackend(engine=engine)
            ctx = StageContext(problem, inputs, up, 0, shard_of=shards)
            run = functools.partial(call_stage, backend, stage, ctx)
            try:
                run()
            except Exception as exc:  # noqa: BLE001 - an engine that cannot run here is reported
                timings.append(
                    StageTiming(
                        stage, f"{engine}: {exc}", float("nan"), 0, "-", float("nan"), float("nan")
                    )
                )
                continue
            seconds = median_seconds(run, repeats)
            out = run()
            if stage in _GEMM_STAGES:
                m_indices = up["permute"]["m_indices"]
                live = int((m_indices >= 0).sum())
                n = out[GEMM_OUTPUT[stage]].shape[1]
                k = (up["permute"]["a_perm"] if stage == "gemm1" else up["act_quant"]["a2q"]).shape[
                    1
                ]
                flops = 2.0 * live * n * k
                ceiling = (
                    matmul_rate(dev, max(live, 1), n, k) if dev.type == "cuda" else float("nan")
                )
                timings.append(
                    StageTiming(
                        stage,
                        str(out["engine"]),
                        seconds * 1e6,
                        flops,
                        "TFLOPS",
                        flops / seconds / 1e12,
                        ceiling / 1e12,
                        1 - live / max(m_indices.numel(), 1),
                    )
                )
            else:
                nbytes = _stage_bytes(stage, up, out)
                timings.append(
                    StageTiming(
                        stage,
                        "triton",
                        seconds * 1e6,
                        nbytes,
                        "GB/s",
                        nbytes / seconds / 1e9,
                        bandwidth / 1e9,
                    )
                )
    return timings


@dataclass(frozen=True)
class CompareTiming:
    """Seconds to compare one rank's traces, both modes, with the comparisons on `device`."""

    device: str
    seconds: float


def compare_cost(
    problem: MoEProblem, repeats: int = 3, device: torch.device | str | None = None
) -> list[CompareTiming]:
    """What verification itself costs: rank 0's golden and optimized traces (isolated and
    chained) compared on the golden's device and on the host, side by side on the same traces."""
    from moe_verify.run.runner import resolve_backend
    from moe_verify.run.verify import compare_rank, verify_rank

    inputs = make_inputs(problem, device)
    tested, golden = resolve_backend("optimized"), resolve_backend("golden")
    run = verify_rank(problem, inputs, tested, golden, 0, tuple(Mode)).run
    here = inputs.hidden_states.device
    places = [here] if here.type == "cpu" else [here, torch.device("cpu")]
    out = []
    for where in places:

        def both_modes(where: torch.device = where) -> None:
            for mode in Mode:
                compare_rank(problem, run, mode, where)

        # Comparisons end in host reads, so the stream is idle at both of the timer's events and
        # they span the whole call, host work included. No warm-up: a first comparison's cost is
        # part of what a run pays.
        out.append(CompareTiming(str(where), median_seconds(both_modes, repeats, warmup=0)))
    return out


def to_markdown(
    problem: MoEProblem, timings: list[StageTiming], compare: list[CompareTiming] | None = None
) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (interpreter)"
    lines = [
        f"### {problem.id} on {device}",
        "",
        "| stage | engine | median us | achieved | same-run ceiling | of ceiling | padding rows |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in timings:
        lines.append(
            f"| {t.stage} | {t.engine} | {t.median_us:.1f} | {t.achieved:.1f} {t.unit} | "
            f"{t.ceiling:.1f} {t.unit} | {t.of_ceiling:.0%} | {t.padded_fraction:.0%} |"
        )
    if compare:
        base = compare[0].seconds
        lines += ["", "| verification: compare rank 0, both modes, on | median s | vs first |"]
        lines.append("| --- | --- | --- |")
        for c in compare:
            lines.append(f"| {c.device} | {c.seconds:.3f} | {c.seconds / base:.2f}x |")
    return "\n".join(lines) + "\n"
