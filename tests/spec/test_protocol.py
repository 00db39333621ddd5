"""The stage protocol: any class with a name and the stage methods serves every command.

`moe_verify.examples.wrapped.HalvesOneToken` wraps OptimizedBackend (it is no subclass of it) and
halves token 0 in gather: `run` and `graph` must fail it at gather, naming token 0, and
`bench --production` must time it. The same wrapper without the bug must pass both, so the
failures are the bug's, not the wrapping's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_verify.cli import main
from moe_verify.examples.wrapped import HalvesOneToken
from moe_verify.spec import (
    Backend,
    MoEProblem,
    Outputs,
    StageContext,
    StageDelegate,
    Trace,
    call_stage,
    check_backend_object,
)
from optimized import OptimizedBackend

pytestmark = pytest.mark.cpu

WRAPPED = "moe_verify.examples.wrapped:HalvesOneToken"
CLEAN = "tests.spec.test_protocol:CleanWrapper"
TINY = ["-T", "8", "-H", "128", "-I", "128", "-E", "4", "-k", "2", "--alignment", "32"]
# graph in this process: what is read here is the wrapper's verdict, not the child that contains
# a crash (tests/production/test_graph.py reads that), whose start is torch's import again
IN_PROCESS = {"run": [], "graph": ["--in-process"]}


class CleanWrapper(StageDelegate):
    """The optimized path wrapped, every stage delegated: must pass wherever it does."""

    name = "clean-wrapper"

    def __init__(self) -> None:
        super().__init__(OptimizedBackend(), self.name)


def test_the_wrapper_is_a_backend_and_no_subclass() -> None:
    backend = HalvesOneToken()
    assert not isinstance(backend, OptimizedBackend)
    assert isinstance(backend, Backend)
    check_backend_object(backend)


def test_a_class_missing_a_stage_is_named() -> None:
    class NoGather:
        name = "no-gather"

        def route(self, ctx: StageContext) -> Outputs:
            return {}

    with pytest.raises(TypeError, match=r"lacks quant_input\(ctx\).*gather\(ctx\)"):
        check_backend_object(NoGather())
    with pytest.raises(ValueError, match="has no method gather"):
        call_stage(NoGather(), "gather", StageContext(MoEProblem(), None, Trace("x")))  # type: ignore[arg-type]


@pytest.mark.parametrize("command", ["run", "graph"])
def test_run_and_graph_fail_the_wrapper_at_gather(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    args = [command, *TINY, *IN_PROCESS[command], "--backend", WRAPPED, "--json", str(out)]
    assert main(args) == 1
    report = json.loads(out.read_text())
    text = json.dumps(report)
    assert "gather" in (report.get("first_failure") or text)
    if command == "run":
        assert report["first_failure"].startswith("gather")


@pytest.mark.parametrize("command", ["run", "graph"])
def test_run_and_graph_pass_the_clean_wrapper(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, *TINY, *IN_PROCESS[command], "--backend", CLEAN]) == 0


def test_bench_production_runs_the_wrapper(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.md"
    args = ["bench", "--production", *TINY, "--backend", WRAPPED, "--repeats", "1"]
    assert main([*args, "--out", str(out)]) == 0
    table = out.read_text()
    assert "| gemm1 |" in table and "| gather |" in table and "whole forward" in table


def test_the_wrapper_halves_token_0_only() -> None:
    from moe_verify.run.inputs import make_inputs

    problem = MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=4, topk=2)
    inputs = make_inputs(problem, "cpu")
    clean = OptimizedBackend().run(problem, inputs)
    halved = HalvesOneToken().inner.run(problem, inputs)  # type: ignore[attr-defined]
    assert torch.equal(clean["gather"]["out"], halved["gather"]["out"])
