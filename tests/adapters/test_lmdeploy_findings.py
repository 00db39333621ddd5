"""The registry's LMDeploy entries (findings 4-7, moe_verify/findings/registry.py) asserted on the
installed LMDeploy, and finding 6's standalone repro, from the finding and from a dump, run
against it.

Findings 4, 5 and 6 are read off one isolated run of a matrix row that shows all three
(test_lmdeploy_matrix.py: ceil-UE8M0 scales, two live slots a token), by the checks that row's
test names for each finding (FINDING_CHECKS): the permute's padding scales, act_quant's scale
flips, the gather's ulp. Finding 7's check calls ep_gather itself at the refused H = 1536 (the
adapter refuses that H before calling it, so only a direct call sees whether LMDeploy still does).

Each check must be able to fail: beside it in CHECKS is LMDeploy with that bug taken out, its
function wrapped or replaced on the module the adapter calls (never its source copied): scales
zeroed before ep_scatter_fp8 writes the live ones (4), the activations quantized with the input's
scale_fmt (5), ep_gather replaced by an fp32 sum rounded once, written in
tests/findings/correct_kernels.py (6, 7). Through the same check, the finding must no longer
reproduce.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from moe_verify.adapters import lmdeploy as adapter
from moe_verify.adapters.lmdeploy import LmdeployBackend
from moe_verify.cli import main
from moe_verify.findings import repro
from moe_verify.findings.registry import Finding
from moe_verify.findings.verdict import Observation
from moe_verify.run.verify import verify
from tests.adapters.test_lmdeploy_matrix import FINDING_CHECKS, MATRIX, REFUSED, expected
from tests.findings import correct_kernels
from tests.findings.standalone_env import run_script
from tests.findings.tier import assert_agrees, assert_turned, entries
from tolerance import Report

pytestmark = pytest.mark.lmdeploy

# The matrix's first row where findings 4, 5 and 6 all show (ceil-UE8M0, one rank, two live
# slots a token): fp8_block-tp1-T8-H1024-I512-E4-k2-empty_last-ceil-m_indices.
ROW = next(
    p
    for p in MATRIX
    if p.topology.size == 1
    and all(expected(p)[s] == "fail" for s in ("permute", "act_quant", "gather"))
)
# The refused row whose only refusal is ep_gather's (finding 7).
REFUSED_H = next(p.hidden for p, stages in REFUSED if stages == {"gather"})


@contextlib.contextmanager
def zeroed_padding_scales() -> Iterator[None]:
    """Finding 4 taken out: the permuted scales zeroed before ep_scatter_fp8 writes the live rows'
    (torch.zeros for torch.empty, as vLLM allocates them)."""
    ep_fp8 = adapter.load().ep_fp8
    original = ep_fp8.ep_scatter_fp8

    @functools.wraps(original)
    def zeroed(*args: Any) -> Any:
        args[6].zero_()  # a_scale_perm
        return original(*args)

    with mock.patch.object(ep_fp8, "ep_scatter_fp8", zeroed):
        yield


@contextlib.contextmanager
def activation_scale_fmt() -> Iterator[None]:
    """Finding 5 taken out: the activations quantized with the input's scale_fmt ('ue8m0', this
    row's), as fused_moe_v3_fp8 would if it passed its own on."""
    quant = adapter.load().quant
    original = quant.per_token_group_quant_fp8

    @functools.wraps(original)
    def with_fmt(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("scale_fmt", "ue8m0")  # quant_input passes its own
        return original(*args, **kwargs)

    with mock.patch.object(quant, "per_token_group_quant_fp8", with_fmt):
        yield


@contextlib.contextmanager
def fp32_gather() -> Iterator[None]:
    """Findings 6 and 7 taken out: ep_gather's sum in fp32, rounded once, any H."""
    with mock.patch.object(adapter.load().ep, "ep_gather", correct_kernels.ep_gather):
        yield


Fix = Callable[[], contextlib.AbstractContextManager[None]]


@functools.cache
def row_report(fix: Fix | None) -> Report:
    """ROW's isolated run, on the installed LMDeploy or with `fix` applied (once each)."""
    with fix() if fix else contextlib.nullcontext():
        return verify(ROW, backend=LmdeployBackend(), mode="isolated")


def failed_checks(report: Report, stage: str) -> set[str]:
    return {c.name for r in report.isolated or [] if r.stage == stage for c in r.failed_checks}


def failing(stage: str, check: str) -> Callable[[Fix | None], Observation]:
    """A finding seen as ROW's `stage` failing `check` (one of that stage's FINDING_CHECKS)."""
    assert check in FINDING_CHECKS[stage]

    def observe(fix: Fix | None) -> Observation:
        checks = failed_checks(row_report(fix), stage)
        return Observation(
            check in checks, f"{ROW.id}: {stage} failed {sorted(checks) or 'nothing'}"
        )

    return observe


def refuses_h(fix: Fix | None) -> Observation:
    """Finding 7: ep_gather called at H = REFUSED_H (2 tokens, 2 slots) raises AssertionError."""
    with fix() if fix else contextlib.nullcontext():
        gather = adapter.load().ep.ep_gather
        rows = torch.zeros(4, REFUSED_H, dtype=torch.bfloat16)
        ids = torch.tensor([[0, 1], [1, -1]])
        out = torch.empty(2, REFUSED_H, dtype=torch.bfloat16)
        try:
            gather(rows, ids, torch.ones(2, 2), torch.tensor([[0, 1], [2, -1]]), out)
        except AssertionError as exc:
            why = f": {exc}" if str(exc) else ""
            return Observation(True, f"ep_gather at H = {REFUSED_H} raised AssertionError{why}")
    return Observation(False, f"ep_gather ran at H = {REFUSED_H}")


# finding id -> (its check, the kernels without its bug)
CHECKS: dict[int, tuple[Callable[[Fix | None], Observation], Fix]] = {
    4: (failing("permute", "padding scales"), zeroed_padding_scales),
    5: (failing("act_quant", "scale flips"), activation_scale_fmt),
    6: (failing("gather", "ulp"), fp32_gather),
    7: (refuses_h, fp32_gather),
}


@pytest.mark.parametrize("finding", entries("lmdeploy"))
def test_finding_on_the_installed_release(finding: Finding) -> None:
    check, _ = CHECKS[finding.id]
    assert_agrees(finding, adapter.installed_version(), check(None))


@pytest.mark.parametrize("finding", entries("lmdeploy"))
def test_the_check_sees_a_kernel_without_the_bug(finding: Finding) -> None:
    check, fix = CHECKS[finding.id]
    assert_turned(finding, adapter.installed_version(), check(fix))


def test_the_repro_of_finding_6_fails_on_the_installed_kernel(tmp_path: Path) -> None:
    done = run_script(repro.write(repro.from_finding(6), tmp_path / "repro"))
    assert done.returncode == 1, done.stdout
    assert "beyond 1 bf16 ulp" in done.stdout and "WRONG: the sum" in done.stdout, done.stdout


# fp32 scales, one rank, two live slots a token: isolated mode fails at the gather alone
DUMPED = MATRIX[0]


def test_the_repro_of_a_dumped_gather(tmp_path: Path) -> None:
    """`run --backend lmdeploy --dump-dir` on a case failing at the gather, `repro --dump`, and
    the script: exit 1 on LMDeploy's ep_gather, 0 on an fp32 one."""
    assert expected(DUMPED)["gather"] == "fail" and expected(DUMPED)["permute"] == "pass"
    problem = tmp_path / "problem.json"
    problem.write_text(json.dumps(DUMPED.to_dict()))
    dump = tmp_path / "dump"
    run = ["run", "--problem-json", str(problem), "--backend", "lmdeploy", "--mode", "isolated"]
    assert main([*run, "--dump-dir", str(dump)]) == 1
    out = tmp_path / "repro"
    assert main(["repro", "--dump", str(dump), "--out", str(out)]) == 0
    real = run_script(out / repro.SCRIPT)
    assert real.returncode == 1 and "WRONG: the sum" in real.stdout, real.stdout
    fixed = run_script(out / repro.SCRIPT, kernel="ep_gather")
    assert fixed.returncode == 0 and "no bug seen" in fixed.stdout, fixed.stdout
