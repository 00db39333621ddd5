"""moe_verify.run.protect: a tested stage gets copies, the golden's upstream and the shared inputs
stay
as they were whatever it writes, and every write is named by the tensor it hit."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from moe_verify.production.host_reads import HostReads
from moe_verify.run.inputs import make_inputs
from moe_verify.run.protect import SANITIZER_TOOL_ENV, Guarded, guarded_inputs
from moe_verify.run.runner import run_chained, run_isolated, run_one_stage
from moe_verify.spec import MoEInputs, MoEProblem, ScaleFmt, StageContext, Trace
from optimized import OptimizedBackend
from reference import ReferenceBackend
from tolerance.contract import contract_violations

pytestmark = pytest.mark.cpu

# Packed act scales: the upstream of gemm2 holds an int32 [M_sum, 1] with strides (1, M_sum).
PROBLEM = MoEProblem(
    tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2, scale_fmt=ScaleFmt.UE8M0_PACKED
)


@functools.cache
def _golden() -> tuple[MoEInputs, Trace]:
    inputs = make_inputs(PROBLEM, "cpu")
    return inputs, ReferenceBackend().run(PROBLEM, inputs, 0)


def _snapshot(x: object) -> object:
    """Bitwise snapshot of every tensor reachable in a trace or inputs (for 'unchanged')."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), tuple(x.stride()), x.reshape(-1).view(torch.uint8).clone())
    if isinstance(x, Trace):
        return [(s, {k: _snapshot(v) for k, v in outs.items()}) for s, outs in x.items()]
    if isinstance(x, MoEInputs):
        return {k: _snapshot(v) for k, v in vars(x).items()}
    if hasattr(x, "q"):  # QuantizedWeight
        return (_snapshot(x.q), _snapshot(x.scale))
    return x


def _same(a: object, b: object) -> bool:
    if isinstance(a, tuple) and len(a) == 3 and isinstance(a[2], torch.Tensor):
        return a[:2] == b[:2] and torch.equal(a[2], b[2])
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _flip(t: torch.Tensor, n: int = 1) -> None:
    """Flip the lowest bit of the first n elements in place."""
    bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    bits.reshape(-1)[:n] ^= 1


Write = Callable[[Trace, MoEInputs], None]

WRITES: dict[str, tuple[str, Write, str]] = {
    # id: (stage whose upstream is handed, the backend-like write, the line writes() must give)
    "upstream-a1q": (
        "permute",
        lambda up, x: _flip(up["quant_input"]["a1q"], 3),
        "quant_input.a1q: 3 of 512 elements changed",
    ),
    "upstream-packed-scale": (
        "gemm2",
        lambda up, x: _flip(up["act_quant"]["a2q_scale"]),
        "act_quant.a2q_scale: 1 of 640 elements changed",
    ),
    "upstream-ids": (
        "align",
        lambda up, x: up["route"]["topk_ids"].fill_(0),
        "route.topk_ids: ",
    ),
    "weight": (
        "gemm1",
        lambda up, x: _flip(x.w13_q.q, 12),
        "inputs.w13_q.q: 12 of 131072 elements changed",
    ),
    "weight-scale": (
        "gemm2",
        lambda up, x: x.w2_q.scale.mul_(2),
        "inputs.w2_q.scale: 4 of 4 elements changed",
    ),
    "hidden-states": (
        "quant_input",
        lambda up, x: x.hidden_states[0].zero_(),
        "inputs.hidden_states: ",
    ),
    "mm2-sign": (
        "gather",
        lambda up, x: up["gemm2"]["mm2"][:2].neg_(),
        "gemm2.mm2: 256 of 81920 elements changed",
    ),
    "resize": (
        "gather",
        lambda up, x: up["permute"]["inv_perm"].resize_(2),
        "permute.inv_perm: resized or replaced in place: shape (4, 2) strides (2, 1) became "
        "shape (2,)",
    ),
}


@pytest.mark.parametrize("case", list(WRITES))
def test_a_write_is_named_and_the_golden_is_untouched(case: str) -> None:
    inputs, golden = _golden()
    stage, write, expect = WRITES[case]
    upstream = golden.upto(stage)
    before = (_snapshot(upstream), _snapshot(inputs))
    guard = Guarded(upstream, inputs)
    write(guard.upstream, guard.inputs)
    found = guard.writes()
    assert len(found) == 1 and found[0].startswith(expect), found
    assert _same(before, (_snapshot(upstream), _snapshot(inputs)))
    # the inputs copy is restored: the next stage of the case starts from the original
    assert _same(_snapshot(guarded_inputs(inputs)), _snapshot(inputs))
    assert Guarded(golden.upto(stage), inputs).writes() == []


def test_a_stage_that_writes_nothing() -> None:
    inputs, golden = _golden()
    guard = Guarded(golden.upto("gemm1"), inputs)
    run_one_stage(
        OptimizedBackend(engine="triton"), "gemm1", PROBLEM, guard.inputs, guard.upstream, 0
    )
    assert guard.writes() == []


@pytest.mark.parametrize(
    ("held", "written"),
    [(0x7FC1, 0x7FC2), (0x0000, -0x8000)],
    ids=["nan-payload", "negative-zero"],
)
def test_bits_count_not_values(held: int, written: int) -> None:
    """A NaN with another payload, or -0.0 over +0.0, is a write (bf16 bit patterns)."""
    inputs, _ = _golden()
    upstream = Trace("golden")
    upstream.add("gemm1", {"mm1": torch.full((2, 3), held, dtype=torch.int16).view(torch.bfloat16)})
    guard = Guarded(upstream, inputs)
    guard.upstream["gemm1"]["mm1"].view(torch.int16)[1, 2] = written
    assert guard.writes() == ["gemm1.mm1: 1 of 6 elements changed"]


def test_a_stage_check_reads_the_host_once() -> None:
    """However many tensors a stage is handed, checking them costs one host read (a device sync
    under `sweep --jobs` waits for the GPU's other processes), and every write is still named:
    the upstream's, and the inputs' (restored)."""
    inputs, golden = _golden()
    guard = Guarded(golden.upto("gather"), inputs)
    handed = sum(
        isinstance(v, torch.Tensor)
        for _, outs in golden.upto("gather").items()
        for v in outs.values()
    )
    assert handed >= 10
    _flip(guard.upstream["gemm2"]["mm2"], 3)
    _flip(guard.upstream["permute"]["inv_perm"])
    _flip(guard.inputs.w2_q.scale, 2)
    with HostReads().counting() as reads:
        found = guard.writes()
    assert reads.reads == ["tolist"], reads.reads
    assert [w.split(":")[0] for w in found] == [
        "permute.inv_perm",
        "gemm2.mm2",
        "inputs.w2_q.scale",
    ]
    assert found[1].startswith("gemm2.mm2: 3 of ") and found[2].startswith(
        "inputs.w2_q.scale: 2 of "
    )
    assert _same(_snapshot(guarded_inputs(inputs)), _snapshot(inputs))


def test_what_the_stage_is_handed() -> None:
    """Copies with the original's shape, strides and bits; host values as they are; the same
    stages, backend and rank; the inputs copy the same object for every stage."""
    inputs, golden = _golden()
    upstream = golden.upto("gemm2")
    guard = Guarded(upstream, inputs)
    handed = guard.upstream
    assert (handed.backend, handed.rank, handed.stages) == (
        golden.backend,
        golden.rank,
        upstream.stages,
    )
    for stage, outs in upstream.items():
        for name, value in outs.items():
            got = handed[stage][name]
            if isinstance(value, torch.Tensor):
                assert got.data_ptr() != value.data_ptr()
                assert (got.shape, got.stride(), got.dtype) == (
                    value.shape,
                    value.stride(),
                    value.dtype,
                )
                assert _same(_snapshot(got), _snapshot(value))
            else:
                assert got is value
    assert handed["act_quant"]["a2q_scale"].stride() == (1, 640)  # TMA-aligned, one word column
    assert guard.inputs is Guarded(golden.upto("gather"), inputs).inputs is guarded_inputs(inputs)
    assert guard.inputs.w13_q.q.data_ptr() != inputs.w13_q.q.data_ptr()
    assert guard.writes() == []


def test_a_guard_left_unread_keeps_its_writes() -> None:
    """A stage whose writes() the runner never read is checked when the next guard is made: its
    write is its own, and the next stage is handed the original inputs."""
    inputs, golden = _golden()
    first = Guarded(golden.upto("gemm1"), inputs)
    _flip(first.inputs.w13_q.scale)
    second = Guarded(golden.upto("act_quant"), inputs)
    assert second.writes() == []
    assert first.writes() == ["inputs.w13_q.scale: 1 of 8 elements changed"]


class WritesIntoItsUpstream(OptimizedBackend):
    """The issue's culprit: act_quant negates rows of mm1 in place (a fused kernel reusing its
    input as scratch); -0.0 counts, so every element of those rows is a write."""

    def act_quant(self, ctx: StageContext) -> dict[str, object]:
        up = ctx.upstream
        up["gemm1"]["mm1"][:8].neg_()
        return super().act_quant(ctx)


def test_isolated_run_blames_the_write_on_the_stage_that_made_it() -> None:
    """The runner's loop, guarded: each stage on the golden's upstream, its writes and contract
    breaks reported at that stage, the golden's trace bitwise as it was."""
    inputs, golden = _golden()
    before = _snapshot(golden)
    backend = WritesIntoItsUpstream(engine="triton")
    blamed = {}
    for stage in PROBLEM.stages:
        guard = Guarded(golden.upto(stage), inputs)
        outputs = run_one_stage(backend, stage, PROBLEM, guard.inputs, guard.upstream, 0)
        found = guard.writes() + contract_violations(stage, PROBLEM, golden.upto(stage), outputs, 0)
        if found:
            blamed[stage] = found
    assert blamed == {"act_quant": ["gemm1.mm1: 2048 of 163840 elements changed"]}
    assert _same(before, _snapshot(golden))


def test_strides_with_gaps_are_kept() -> None:
    """Packed scales of 6 rows: word columns 8 int32 apart (TMA-aligned), 2 padding rows between
    them. clone() would hand the kernel row-major strides; the copy keeps (1, 8)."""
    inputs, _ = _golden()
    packed = torch.arange(16, dtype=torch.int32).view(2, 8).t()[:6]
    upstream = Trace("golden")
    upstream.add("act_quant", {"a2q_scale": packed})
    handed = Guarded(upstream, inputs).upstream["act_quant"]["a2q_scale"]
    assert handed.stride() == (1, 8) and handed.data_ptr() != packed.data_ptr()
    assert torch.equal(handed, packed)


def test_what_is_not_a_trace_or_inputs_is_refused() -> None:
    inputs, golden = _golden()
    with pytest.raises(TypeError, match="inputs: expected a MoEInputs, got NoneType"):
        Guarded(golden, None)
    with pytest.raises(TypeError, match="upstream: expected a Trace, got dict"):
        Guarded({}, inputs)


class WritesIntoItsInputs(OptimizedBackend):
    """act_quant flips a bit of the shared w2 scales in place."""

    def act_quant(self, ctx: StageContext) -> dict[str, object]:
        x = ctx.inputs
        _flip(x.w2_q.scale)
        return super().act_quant(ctx)


def _act_quant_failure(trace: Trace) -> str:
    failure = trace.failure("act_quant")
    return "" if failure is None else str(failure)


def test_under_initcheck_only_a_chained_stages_own_upstream_goes_unguarded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under `--sanitize initcheck` the guard would read the padding rows the backend's kernels
    never wrote (moe_verify/run/protect.py guards_own_upstream): a chained stage gets its own trace
    itself. The golden's upstream (isolated) and the inputs stay guarded; other tools guard all."""
    inputs, golden = _golden()
    upstream_writer = WritesIntoItsUpstream(engine="triton")
    input_writer = WritesIntoItsInputs(engine="triton")
    wrote = "wrote in place into gemm1.mm1"
    assert wrote in _act_quant_failure(run_chained(upstream_writer, PROBLEM, inputs, 0))
    monkeypatch.setenv(SANITIZER_TOOL_ENV, "memcheck")
    assert wrote in _act_quant_failure(run_chained(upstream_writer, PROBLEM, inputs, 0))
    monkeypatch.setenv(SANITIZER_TOOL_ENV, "initcheck")
    assert _act_quant_failure(run_chained(upstream_writer, PROBLEM, inputs, 0)) == ""
    isolated = run_isolated(upstream_writer, PROBLEM, inputs, golden, 0)
    assert wrote in _act_quant_failure(isolated)
    chained = _act_quant_failure(run_chained(input_writer, PROBLEM, inputs, 0))
    assert "wrote in place into inputs.w2_q.scale: 1 of" in chained
