"""SM90 tier: comparisons run where the golden lives (the GPU) and must say exactly what the host
says. For the correct backend on DeepGEMM-sized cases and for every wrong backend of
tests/tester, each rank's traces are compared three ways: on the GPU, on the host, and with the
tested trace moved to the host while the golden stays on the GPU. Every stage's status, reason and
checks (value, limit, worst coordinates, detail) must agree; only calc_diff, a float64 sum whose
order depends on the device, agrees to 1e-9 relative.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import resolve_backend, run_rank
from moe_verify.spec import Backend, Mode, MoEProblem, Recipe, ScaleFmt, Trace
from moe_verify.sweep.cases import DSV3_LOCAL, GPU_SHAPE
from optimized.backend import OptimizedBackend
from tests.tester.test_wrong_backends import CASES, Expect
from tolerance.compare import CheckResult, StageResult, compare
from tolerance.stages.context import comparison_device

pytestmark = pytest.mark.sm90
P = MoEProblem
QWEN3_E32 = dict(hidden=4096, intermediate=1536, num_experts=32, topk=8)

_FAILING = ("fail", "error")
CORRECT = [  # (case, GEMM engine)
    (P(tokens=1000, scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0, **DSV3_LOCAL), "auto"),
    # ^ DeepGEMM; act_quant scales flip between the paths (the fp8_value_distance branch)
    (P(tokens=512, recipe=Recipe.MXFP8, scale_fmt=ScaleFmt.UE8M0_PACKED, **QWEN3_E32), "triton"),
    # ^ packed UE8M0 scales, unpacked on the GPU
    (P(tokens=64, topk=2, topology="ep:2+ll", **GPU_SHAPE), "auto"),
    # ^ the batched layout, read through flatten_batched (its GEMMs on GPU_SHAPE: no compile of
    # their own where DeepGEMM runs them)
    (P(tokens=200, topk=2, topology="ep:4+ht", **{**GPU_SHAPE, "num_experts": 16}), "auto"),
    # ^ received tokens, keyed by route.token_index
]


def _on(trace: Trace, device: str) -> Trace:
    out = Trace(trace.backend, trace.rank)
    for stage, outs in trace.items():
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in outs.items()}
        out.add(stage, moved)
    return out


def _key(check: CheckResult) -> str:
    """What must agree across devices; repr so that a NaN value equals a NaN value."""
    if check.name == "calc_diff":
        return repr(dataclasses.replace(check, value=0.0, detail=""))
    return repr(check)


def _assert_same(got: list[StageResult], host: list[StageResult], where: str) -> None:
    assert [r.stage for r in got] == [r.stage for r in host], where
    for g, h in zip(got, host, strict=True):
        assert (g.status, g.reason) == (h.status, h.reason), f"{where} {g.stage}"
        assert [_key(c) for c in g.checks] == [_key(c) for c in h.checks], f"{where} {g.stage}"
        for c, d in zip(g.checks, h.checks, strict=True):
            if c.name == "calc_diff" and not (math.isnan(c.value) and math.isnan(d.value)):
                assert math.isclose(c.value, d.value, rel_tol=1e-9, abs_tol=1e-15), (c, d)


def _isolated_on_every_device(problem: MoEProblem, backend: Backend) -> list[StageResult]:
    """Each rank compared on the GPU, the host and mixed, asserted equal; the GPU's isolated
    results, tagged with their rank."""
    inputs = make_inputs(problem, "cuda")
    golden = resolve_backend("golden")
    isolated: list[StageResult] = []
    for rank in range(problem.topology.size):
        run = run_rank(problem, inputs, backend, golden, rank, tuple(Mode))
        for mode, other in run.tested.items():
            stages = list(problem.stages)
            assert comparison_device(run.golden, stages[-1]).type == "cuda"
            on_gpu = compare(run.golden, other, problem, stages, mode=mode)
            on_host = compare(run.golden, other, problem, stages, mode=mode, device="cpu")
            mixed = compare(run.golden, _on(other, "cpu"), problem, stages, mode=mode)
            where = f"{problem.id} rank {rank} {mode}"
            _assert_same(on_gpu, on_host, f"{where} (GPU vs host)")
            _assert_same(mixed, on_host, f"{where} (tested trace on the host vs host)")
            if mode is Mode.ISOLATED:
                isolated += [dataclasses.replace(r, rank=rank) for r in on_gpu]
    return isolated


@pytest.mark.parametrize(("problem", "engine"), CORRECT, ids=[p.id for p, _ in CORRECT])
def test_correct_backend_compares_alike_on_gpu_and_host(problem: MoEProblem, engine: str) -> None:
    isolated = _isolated_on_every_device(problem, OptimizedBackend(engine=engine))
    assert {r.status for r in isolated} == {"pass"}, [
        r.stage for r in isolated if r.status != "pass"
    ]


@pytest.mark.parametrize("expect", CASES, ids=lambda e: e.id)
def test_wrong_backend_compares_alike_on_gpu_and_host(expect: Expect) -> None:
    isolated = _isolated_on_every_device(expect.problem, expect.backend(engine="triton"))
    failing = {(r.stage, r.rank) for r in isolated if r.status in _FAILING}
    rank = expect.rank if expect.rank is not None else 0
    assert (expect.stage, rank) in failing, f"{expect.id}: the GPU comparison fails {failing}"
