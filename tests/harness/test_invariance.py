"""Metamorphic invariance (`verify_invariance`, `run --invariance`): the tested side run twice with
only a hint or a capacity changed must agree bit for bit at every stage, a check named after the
setting and the pair (tolerance/invariance.py). CPU tier, Triton engine."""

from __future__ import annotations

import pytest
import torch

from moe_verify.cli import main
from moe_verify.spec import Mode, MoEProblem, Status
from moe_verify.verification import verify_invariance
from optimized import OptimizedBackend
from optimized.kernels import scatter

pytestmark = pytest.mark.cpu

BASE = dict(tokens=8, hidden=128, intermediate=128, num_experts=4, topk=2)


class CapacityDependentGemm1(OptimizedBackend):
    """Wrong on purpose: gemm1 moves one live element by one bf16 ulp when the permuted buffer
    holds more rows than the segments need (the upper-bound M_sum), the way DeepGEMM #331's output
    changed with buffer capacity alone. Well inside gemm1's tolerance of the golden, so only the
    m_sum invariance can catch it."""

    name = "capacity_dependent_gemm1"

    def gemm1(self, problem, inputs, upstream, rank):  # type: ignore[no-untyped-def]
        out = super().gemm1(problem, inputs, upstream, rank)
        align = upstream["align"]
        need = scatter.aligned_m_sum_exact(align["counts"], align["alignment"])
        if align["M_sum"] > need:
            mm1 = out["mm1"].clone()
            row = int(upstream["permute"]["inv_perm"][0, 0])
            mm1.view(torch.int16)[row, 0] += 1
            out = {**out, "mm1": mm1}
        return out


@pytest.mark.parametrize(
    "kind,topology,alignment",
    [
        ("alignment", "tp:1", 64),  # 64 vs 128: other segment starts, same rows
        ("alignment", "ep:2", 128),  # from 128 down to 64, expert_map in play
        ("m_sum", "tp:1", 32),  # upper bound vs exact: padding rows only
        ("m_sum", "ep:2", 64),  # the bound counts remote slots too
    ],
    ids=lambda v: str(v),
)
def test_the_optimized_path_is_invariant(kind: str, topology: str, alignment: int) -> None:
    problem = MoEProblem(**BASE, topology=topology, alignment=alignment)
    report = verify_invariance(problem, kind, engine="triton", mode="both")
    assert report.passed, report.to_summary()
    checked = [
        c for _, results in report.modes() for r in results for c in r.checks
        if c.name.startswith(f"invariance {kind}:")
    ]  # fmt: skip
    assert checked, "the invariance check must run"
    assert {
        r.stage
        for _, res in report.modes()
        for r in res
        if any(c.name.startswith("invariance") for c in r.checks)
    } >= {"permute", "gemm1", "gather"}


def test_a_capacity_dependent_gemm_fails_only_the_invariance() -> None:
    problem = MoEProblem(**BASE, alignment=32)
    report = verify_invariance(
        problem, "m_sum", backend="tests.harness.test_invariance:CapacityDependentGemm1",
        engine="triton", mode="chained",
    )  # fmt: skip
    # Chained: each run's gemm1 reads its own permute, so the capacity reaches it (isolated, both
    # runs' gemm1 read the golden's one layout: the m_sum pair then tests align and permute).
    assert not report.passed
    assert report.first_failure == "gemm1"
    gemm1 = next(r for r in report.results if r.stage == "gemm1")
    assert gemm1.status is Status.FAIL
    failed = [c for c in gemm1.checks if not c.passed]
    assert [c.name for c in failed] == ["invariance m_sum: upper bound vs exact"]
    assert failed[0].value == 1 and "1 of" in failed[0].detail
    assert failed[0].worst is not None and failed[0].worst.token == 0


@pytest.mark.parametrize(
    "kind,topology,alignment,engine,backend,match",
    [
        ("poison", "tp:1", 128, "triton", "optimized", "--poison A --poison B"),
        ("capacity", "tp:1", 128, "triton", "optimized", "expected one of"),
        ("alignment", "tp:1", 32, "triton", "optimized", "alignment is 32"),
        ("m_sum", "ep:2+ht", 128, "triton", "optimized", "no upper-bound M_sum"),
        ("expected_m", "ep:2+ll", 128, "triton", "optimized", "needs --engine deepgemm"),
        ("num_sms", "tp:1", 128, "auto", "optimized", "needs --engine deepgemm"),
        ("alignment", "tp:1", 128, "triton", "golden", "optimized backend"),
    ],
    ids=lambda v: str(v),
)
def test_settings_without_a_second_legal_value_are_refused(
    kind: str, topology: str, alignment: int, engine: str, backend: str, match: str
) -> None:
    problem = MoEProblem(**BASE, topology=topology, alignment=alignment)
    with pytest.raises(ValueError, match=match):
        verify_invariance(problem, kind, backend=backend, engine=engine, mode=Mode.ISOLATED)


def test_the_cli_runs_an_invariance(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "-T", "8", "-H", "128", "-I", "128", "-E", "4", "-k", "2", "--alignment", "64",
            "--engine", "triton", "--mode", "isolated", "--invariance", "alignment"]  # fmt: skip
    assert main(argv) == 0
    assert "invariance alignment: 64 vs 128" in capsys.readouterr().out
    assert main([*argv, "--poison", "0"]) == 2
    assert "not supported with --invariance" in capsys.readouterr().err
