"""`moe-verify graph` on the CPU: everything but the capture itself.

Without a GPU each "replay" is an eager op call on the graph's static buffers (the report says
so), and the rest is what runs under a real capture (tests/gpu/test_sm90_graph.py): staging with
stale padding rows, workspace poison, stage taps, the golden of each replay's inputs, the guards.
The correct backend must pass every default replay; each wrong backend of
tests/tester/production_wrong.py (OptimizedBackend subclasses, the class `run` takes) must fail
at its stage or guard, on the replay it must, and pass
on the others (so the checks discriminate).

Problems are the smallest the kernels take: four experts, top-2, A = 32, one 128-column group.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moe_verify.cli import main
from moe_verify.production.graph import (
    STALE_IDS,
    GraphReport,
    GraphSession,
    Replay,
    _golden,
    _guards,
    default_replays,
    verify_graph,
)
from moe_verify.run.runner import production_backend
from moe_verify.spec import (
    Engine,
    GroupedLayout,
    MoEProblem,
    Recipe,
    Routing,
    ScaleFmt,
    Stage,
    StageContext,
    Trace,
)
from optimized import OptimizedBackend, op
from reference import formats
from tests.tester.production_wrong import CATCHES, Catch, ClampedStaleIds, StaleCounts
from tolerance.report import Report

pytestmark = pytest.mark.cpu

BASE = MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32)
BOUND = BASE.tokens
REPLAYS = {r.name: r for r in default_replays(BOUND, BASE.seed)}
TINY = ["-T", "8", "-H", "128", "-I", "128", "-E", "4", "-k", "2", "--alignment", "32"]
CLI = ["graph", *TINY, "--engine", "triton"]
# `graph` runs in a child by default and passes on its stdout, stderr and exit code verbatim
# (moe_verify/cli.py graph_contained): the CLI tests below that read only what is printed run
# in process, saving a child's start (torch's import) each; the child's path is read by
# test_cli_graph_passes_the_correct_backend (stdout), ..._writes_json (exit 1, --json) and
# test_a_backend_error_in_a_replay_names_it_with_rank_stage_and_type[ValueError-contained].
PRINTS = [*CLI, "--in-process"]
GUARDS = ("golden-not-degenerate", "replays-differ", "no-stale-writes")

CORRECT = [
    BASE,  # one rank, no expert map: stale ids past E are skipped by range alone
    # an expert map: stale positive ids must never index past it
    BASE.replace(topology="ep:2", grouped_layout=GroupedLayout.M_INDICES),
    BASE.replace(topology="ep:2", grouped_layout=GroupedLayout.PSUM),  # expert_ends, not m_indices
    BASE.replace(scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0),  # SM90's power-of-two fp32 scales
    BASE.replace(recipe=Recipe.MXFP8, scale_fmt=ScaleFmt.UE8M0_PACKED),  # 1x32 groups, packed
    BASE.replace(recipe=Recipe.MXFP4_W4A8, scale_fmt=ScaleFmt.FLOAT32_CEIL_UE8M0),  # E2M1 weights
    BASE.replace(topology="ep:2+ll"),  # the masked (batched) layout: its own capture
    # the masked layout on a plain EP rank, its batches packed UE8M0 (no DeepEP)
    BASE.replace(
        topology="ep:2", grouped_layout=GroupedLayout.MASKED, scale_fmt=ScaleFmt.UE8M0_PACKED
    ),
]


def _recorded(report: GraphReport, record_report: Callable[[Report], Report]) -> None:
    """Show every failing replay's stage table if the test fails."""
    for r in report.replays:
        if not r.passed:
            record_report(r.report)


@pytest.mark.parametrize("problem", CORRECT, ids=lambda p: p.id)
def test_correct_backend_passes_every_default_replay(
    problem: MoEProblem, record_report: Callable[[Report], Report]
) -> None:
    report = verify_graph(problem, engine=Engine.TRITON)
    _recorded(report, record_report)
    assert [r.replay.name for r in report.replays] == list(REPLAYS)
    assert report.passed, report.to_summary()
    assert report.exit_code == 0


# A stale layout leaves claimed rows of the poisoned workspace unwritten: NaN reaches act_quant.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("catch", CATCHES, ids=lambda c: c.id)
def test_wrong_backend_fails_where_it_must_and_passes_elsewhere(
    catch: Catch, record_report: Callable[[Report], Report]
) -> None:
    backend = op.register_backend(catch.backend())  # fresh state: no earlier test's calls
    replays = [REPLAYS[name] for name, _ in catch.replays]
    report = verify_graph(
        BASE.replace(topology=catch.topology),
        replays=replays,
        engine=Engine.TRITON,
        backend=backend,
    )
    _recorded(report, record_report)
    got = [(r.replay.name, r.first_failure) for r in report.replays]
    assert got == list(catch.replays), report.to_summary()
    assert report.exit_code == 1
    for r in report.replays:
        if r.first_failure in GUARDS:  # every value right: only the guard can see the bug
            assert r.report.passed, r.replay.name
    if catch.ranks is not None:
        for r in report.replays:
            failing = {x.rank for x in r.report.chained if x.status.failing}
            assert failing == (set(catch.ranks) if not r.passed else set()), r.replay.name


def test_a_failing_ranks_coordinates_name_it() -> None:
    backend = op.register_backend(ClampedStaleIds())
    replays = [REPLAYS["capture-softmax"], REPLAYS["half-live"]]
    report = verify_graph(
        BASE.replace(topology="ep:2"), replays=replays, engine=Engine.TRITON, backend=backend
    )
    culprit = report.replays[1].report.first_failing_result
    assert culprit is not None and culprit.rank == 1
    assert {c.worst.rank for c in culprit.failed_checks if c.worst is not None} == {1}


# -- staging -----------------------------------------------------------------------------------


def _staged(problem: MoEProblem, *names: str) -> tuple[GraphSession, torch.Tensor]:
    """A session with `names` staged in order; the hidden rows before the last one."""
    session = GraphSession(problem, BOUND, Engine.TRITON)
    before = session.hidden.clone()
    for name in names:
        before = session.hidden.clone()
        session.stage(REPLAYS[name])
    return session, before


def test_padding_rows_keep_the_previous_replays_hidden_rows() -> None:
    session, before = _staged(BASE, "capture-softmax", "half-live")
    live = REPLAYS["half-live"].live
    assert live < BOUND
    assert torch.equal(session.hidden[live:], before[live:])
    assert not torch.equal(session.hidden[:live], before[:live])


@pytest.mark.parametrize("topology", ["tp:1", "ep:2"])
def test_padding_rows_hold_stale_ids_the_op_must_skip(topology: str) -> None:
    session, _ = _staged(BASE.replace(topology=topology), "capture-softmax", "one-live")
    live, table = REPLAYS["one-live"].live, session.num_experts_table
    planted = set(session.ids[live:].flatten().tolist())
    assert planted == {*STALE_IDS, table - 1, 0}  # positive ids past the table, and in range
    ids, weights = session.effective_route()
    outside = session.ids >= table
    assert outside[live:].any() and not outside[:live].any()
    assert (ids[outside] == -1).all()
    assert torch.equal(ids[~outside], session.ids[~outside])
    assert torch.equal(weights, session.weights)


def test_the_golden_runs_on_the_ops_inputs() -> None:
    """Its route is the effective route, its input the static buffer (padding rows too), and a
    padding token whose ids all lie past the expert map contributes nothing."""
    session, _ = _staged(BASE.replace(topology="ep:2"), "capture-softmax", "half-live")
    ids, weights = session.effective_route()
    golden = _golden(session, ids, weights)
    quantized, _ = formats.quantize_fp8_groups(session.hidden, 128, BASE.scale_fmt)
    for trace in golden:
        assert torch.equal(trace[Stage.ROUTE]["topk_ids"], ids)
        assert torch.equal(trace[Stage.QUANT_INPUT]["a1q"].view(torch.uint8),
                           quantized.view(torch.uint8))  # fmt: skip
    out = sum(trace[Stage.GATHER]["out"].float() for trace in golden)
    live = REPLAYS["half-live"].live
    # The plant repeats (STALE_IDS..., E-1, 0) over the k slots of the padding rows.
    assert session.ids[live].tolist() == list(STALE_IDS)
    assert not out[live].any() and out[live + 1].any()


def test_stage_refuses_a_live_count_outside_the_bound() -> None:
    session = GraphSession(BASE, BOUND, Engine.TRITON)
    with pytest.raises(ValueError, match=r"live must be in \[1, 8\]"):
        session.stage(Replay("none-live", Routing.SOFTMAX, 0, 1))


# -- guards ------------------------------------------------------------------------------------


def test_identical_inputs_twice_trip_replays_differ() -> None:
    first = REPLAYS["capture-softmax"]
    report = verify_graph(BASE, replays=[first, first], engine=Engine.TRITON)
    assert [r.first_failure for r in report.replays] == [None, "replays-differ"]
    assert report.replays[1].report.passed  # every stage right: only the guard can see it


def _golden_out(value: float) -> list[Trace]:
    trace = Trace("golden")
    trace.add(Stage.GATHER, {"out": torch.full((BOUND, BASE.hidden), value)})
    return [trace]


@pytest.mark.parametrize(
    ("value", "degenerate"),
    [(0.0, True), (float("nan"), True), (float("inf"), True), (0.5, False)],
    ids=["zero", "nan", "inf", "finite"],
)
def test_golden_not_degenerate_guard(value: float, degenerate: bool) -> None:
    session = GraphSession(BASE, BOUND, Engine.TRITON)
    out = torch.zeros(BOUND, BASE.hidden, dtype=torch.bfloat16)
    guards = {g.name: g for g in _guards(session, [out], _golden_out(value), None)}
    assert guards["golden-not-degenerate"].passed is not degenerate
    assert "replays-differ" not in guards  # the first replay has nothing to differ from


@pytest.mark.parametrize("same", [True, False], ids=["same", "changed"])
def test_replays_differ_guard_compares_bits(same: bool) -> None:
    session = GraphSession(BASE, BOUND, Engine.TRITON)
    previous = torch.full((BOUND, BASE.hidden), 1.0, dtype=torch.bfloat16)
    out = previous.clone()
    if not same:
        out[BOUND - 1, BASE.hidden - 1] = torch.nextafter(out[-1, -1], out.new_tensor(2.0))
    guards = {g.name: g for g in _guards(session, [out], _golden_out(0.5), [previous])}
    assert guards["replays-differ"].passed is not same


def test_no_stale_writes_guard_counts_written_elements() -> None:
    session = GraphSession(BASE, BOUND, Engine.TRITON)
    sentinel = torch.full((BOUND, BASE.hidden), float("nan"), dtype=torch.bfloat16)
    session.sentinels.append(sentinel)
    out = torch.zeros_like(sentinel)
    assert {g.name: g.passed for g in _guards(session, [out], _golden_out(0.5), None)}[
        "no-stale-writes"
    ]
    sentinel[0, :3] = 0
    (guard,) = [g for g in _guards(session, [out], _golden_out(0.5), None) if not g.passed]
    assert guard.name == "no-stale-writes" and guard.detail.startswith("3 elements")


# -- capture on a CPU --------------------------------------------------------------------------


def test_capture_needs_cuda_and_a_cpu_replays_eagerly() -> None:
    """The capture itself is the GPU tier's (tests/gpu/test_sm90_graph.py); here it is refused
    with the reason, and the default runs eager replays and says so."""
    with pytest.raises(ValueError, match="capture needs a CUDA device"):
        GraphSession(BASE, BOUND, Engine.TRITON, capture=True)
    report = verify_graph(BASE, replays=[REPLAYS["capture-softmax"]], engine=Engine.TRITON)
    assert not report.captured and "eager" in report.capture_note
    assert "eager replays" in report.to_summary().splitlines()[0]


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("problem", "bound", "match"),
    [
        (BASE.replace(topology="ep:2+ht"), BOUND, "reads the per-expert counts on the host"),
        (BASE.replace(shared_experts=1), BOUND, "shared experts run outside the fused MoE op"),
        (BASE, 0, "bound must be >= 1 token, got 0"),
    ],
    ids=["ep2-ht", "shared-experts", "bound-0"],
)
def test_graph_refuses_what_it_cannot_capture(problem: MoEProblem, bound: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        verify_graph(problem, bound=bound, engine=Engine.TRITON)


def test_graph_refuses_no_replays() -> None:
    with pytest.raises(ValueError, match="at least one replay"):
        verify_graph(BASE, replays=[], engine=Engine.TRITON)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("nope", "expected 'optimized', 'golden', 'vllm', .* or 'module:Class', got 'nope'"),
        ("golden", "is the golden: production mode compares a backend under test with it"),
        ("reference.moe:ReferenceBackend", "has no production mode"),
        ("collections:OrderedDict", r"is not a backend: it lacks name \(a str\), route\(ctx\)"),
        ("tests.tester.production_wrong:Nope", "cannot load it"),
        (":StaleCounts", "expected 'module:Class', got ':StaleCounts'"),
    ],
    ids=["unknown", "golden", "golden-class", "not-a-backend", "missing-class", "no-module"],
)
def test_production_backend_refuses(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        production_backend(spec)


def test_production_backend_registers_the_class_run_takes() -> None:
    spec = "tests.tester.production_wrong:StaleCounts"
    name = production_backend(spec)
    assert name == spec and isinstance(op.registered_backend(name), StaleCounts)


class ReadsTheCounts(OptimizedBackend):
    """The optimized path, its align reading the per-expert counts back to the host: correct,
    and not graph-safe."""

    def align(self, ctx: StageContext) -> dict:
        out = super().align(ctx)
        if int(out["counts"].sum()) < 0:
            raise AssertionError("unreachable: counts are never negative")
        return out


def test_a_stage_that_reads_the_host_is_named_and_fails_the_graph() -> None:
    backend = op.register_backend(ReadsTheCounts(), "reads_the_counts")
    report = verify_graph(
        BASE, replays=[REPLAYS["capture-softmax"]], engine=Engine.TRITON, backend=backend
    )
    assert list(report.host_reads) == ["align"], report.to_summary()
    assert "__int__()" in report.host_reads["align"] and __file__ in report.host_reads["align"]
    assert all(r.passed for r in report.replays)  # every value right: only the read fails it
    assert not report.passed and report.exit_code == 1
    assert "NOT GRAPH-SAFE align" in report.to_summary()
    assert json.loads(report.to_json())["host_reads"] == report.host_reads


def test_the_correct_backend_reads_nothing_on_the_host() -> None:
    report = verify_graph(BASE, replays=[REPLAYS["capture-softmax"]], engine=Engine.TRITON)
    assert report.host_reads == {} and report.passed, report.to_summary()


# -- the CLI -----------------------------------------------------------------------------------


def test_cli_graph_passes_the_correct_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*CLI, "--replays", "skew"]) == 0
    out = capsys.readouterr().out
    assert "PASS: 2 of 2 replays agree with the golden" in out


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_cli_graph_fails_a_stale_counts_backend_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "graph.json"
    backend = "tests.tester.production_wrong:StaleCounts"
    assert main([*CLI, "--replays", "skew", "--backend", backend, "--json", str(path)]) == 1
    assert "FAIL at permute" in capsys.readouterr().out
    report = json.loads(path.read_text())
    assert not report["passed"] and report["backend"] == backend
    first, skew = report["replays"]
    assert first["passed"] and first["first_failure"] is None
    assert skew["name"] == "skew" and skew["first_failure"] == "permute"
    assert skew["stages"]["first_failure"] == "permute"


def test_cli_graph_v_prints_every_check_of_a_failing_replay(
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend = "tests.tester.production_wrong:StaleCounts"
    assert main([*PRINTS, "--replays", "skew", "--backend", backend, "-v"]) == 1
    out = capsys.readouterr().out
    assert "FAIL at permute" in out
    assert "docs/tolerance.md#" in out  # the limits' reasons, which only -v prints
    assert main([*PRINTS, "--replays", "skew", "--backend", backend]) == 1
    assert "docs/tolerance.md#" not in capsys.readouterr().out.split("FAIL at permute")[0]


def test_cli_graph_v_prints_every_check_of_every_replay(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`graph -v` means what `run -v` does: every check of every rank, passing replays too."""
    assert main([*PRINTS, "--topology", "ep:2", "--replays", "skew", "-v"]) == 0
    out = capsys.readouterr().out
    blocks = out.split("\n      case ")[1:]  # each replay's table, under its replay's line
    tables = {b.split("(graph replay ")[1].split(")")[0]: b for b in blocks}
    assert list(tables) == ["capture-softmax", "skew"], out
    for table in tables.values():
        for rank in (0, 1):  # each rank's own rows, the limits' reasons beside them
            assert f"gemm1@r{rank} [triton]" in table and f"gather@r{rank}" in table, out
        assert "elementwise" in table and "reason" in table, out


def test_cli_graph_refuses_unknown_replay_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PRINTS, "--replays", "skew,nope"]) == 2
    err = capsys.readouterr().err
    assert "--replays: unknown ['nope']" in err and "half-live" in err


def test_cli_graph_forward_is_gone_with_the_migration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*CLI, "--forward", "tests.tester.production_wrong:StaleCounts"]) == 2
    assert "graph --forward is gone: pass --backend module:Class" in capsys.readouterr().err


def test_one_class_fails_run_and_graph_at_the_same_stage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A kernel written once in the documented surface (an OptimizedBackend subclass) that
    breaks gather: `run` and `graph` both name gather."""
    spec = "tests.tester.wrong_backends:TopkWeightsIgnored"
    assert main(["run", *TINY, "--engine", "triton", "--backend", spec]) == 1
    assert "first failure: gather" in capsys.readouterr().out
    assert main([*PRINTS, "--replays", "skew", "--backend", spec]) == 1
    out = capsys.readouterr().out
    assert "FAIL at gather" in out and "0 of 2 replays agree" in out


class RaisesInGemm2(OptimizedBackend):
    """A backend's own error (not a kernel fault): gemm2 raises on the first call."""

    def gemm2(self, ctx: StageContext) -> dict:
        raise RuntimeError("my gemm2: workspace too small")


def test_a_backend_error_says_the_replay_rank_and_stage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend = op.register_backend(RaisesInGemm2(), "raises_in_gemm2")
    with pytest.raises(RuntimeError, match="workspace too small") as raised:
        verify_graph(
            BASE, replays=[REPLAYS["capture-softmax"]], engine=Engine.TRITON, backend=backend
        )
    where = f"raised in graph {BASE.id}: replay warm-up, rank 0, stage gemm2"
    assert raised.value.__notes__ == [where]
    # the CLI prints it on the error line, exit 2 (an error, not a failed check)
    assert main([*CLI, "--backend", f"{__name__}:RaisesInGemm2", "--in-process"]) == 2
    err = capsys.readouterr().err
    assert "RuntimeError: my gemm2: workspace too small; raised in graph" in err, err
    assert "replay warm-up, rank 0, stage gemm2" in err, err


class RaisesOnHalfLive(OptimizedBackend):
    """A backend's own ordinary error in one stage of one replay: gemm1 of rank 1 raises on its
    third call (the warm-up, capture-softmax, then half-live under `--replays half-live`)."""

    error: type[Exception] = ValueError

    def __init__(self, engine: Engine | str = Engine.AUTO) -> None:
        super().__init__(engine=engine)
        self.calls = {0: 0, 1: 0}

    def gemm1(self, ctx: StageContext) -> dict:
        self.calls[ctx.rank] += 1
        if ctx.rank == 1 and self.calls[1] == 3:
            raise self.error("my gemm1: no tile config for this M")
        return super().gemm1(ctx)


class KeyErrorOnHalfLive(RaisesOnHalfLive):
    error = KeyError


@pytest.mark.parametrize(
    ("backend", "where"),
    [
        (RaisesOnHalfLive, "--in-process"),
        (RaisesOnHalfLive, "contained"),  # the default: the child's error line, passed on
        (KeyErrorOnHalfLive, "--in-process"),
    ],
    ids=["ValueError-in-process", "ValueError-contained", "KeyError-in-process"],
)
def test_a_backend_error_in_a_replay_names_it_with_rank_stage_and_type(
    backend: type[RaisesOnHalfLive],
    where: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ValueError raised by a backend is not bad input: its type is printed as any other's."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the child imports this module
    spec = f"{__name__}:{backend.__name__}"
    flags = ["--topology", "ep:2", "--replays", "half-live", "--backend", spec]
    assert main([*CLI, *flags, *([where] if where != "contained" else [])]) == 2
    err = capsys.readouterr().err
    raised = backend.error("my gemm1: no tile config for this M")
    case = BASE.replace(topology="ep:2").id
    said = f"moe-verify: error: {type(raised).__name__}: {raised}; raised in graph {case}"
    assert said in err, err
    assert f"raised in graph {case}: replay half-live, rank 1, stage gemm1" in err, err


class FaultsOnHalfLive(RaisesOnHalfLive):
    """What torch raises at the sync after a kernel faulted on the GPU (older torch: a
    RuntimeError whose message starts "CUDA error"), here from gemm1 of rank 1 in half-live."""

    @staticmethod
    def error(message: str) -> Exception:
        return RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("where", ["--in-process", "contained"])
def test_a_kernel_fault_in_a_replay_is_a_finding_naming_the_replay(
    where: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA error in a replay is the backend's kernel faulting (exit 1, "FAULT"), not an error
    of the run (exit 2): on a GPU finding 1 surfaces so, inside the captured graph, where the
    stage is unknown; here the replay is eager, so the stage is named too."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the child imports this module
    spec = f"{__name__}:FaultsOnHalfLive"
    report = tmp_path / "graph.json"
    flags = ["--topology", "ep:2", "--replays", "half-live", "--backend", spec]
    flags += ["--json", str(report)]
    assert main([*CLI, *flags, *([where] if where != "contained" else [])]) == 1
    out = capsys.readouterr().out
    case = BASE.replace(topology="ep:2").id
    assert f"FAULT graph {case}: RuntimeError: CUDA error: an illegal memory access" in out, out
    assert "(replay half-live, rank 1, stage gemm1)" in out, out
    saved = json.loads(report.read_text())
    assert saved["passed"] is False and saved["faulted"].startswith("RuntimeError: CUDA error")
    assert saved["at"] == {"case": case, "replay": "half-live", "rank": 1, "stage": "gemm1"}


def test_an_ordinary_runtime_error_is_not_taken_for_a_kernel_fault() -> None:
    from moe_verify.production.graph import is_kernel_fault

    assert is_kernel_fault(RuntimeError("CUDA error: operation not supported"))
    assert not is_kernel_fault(RuntimeError("my gemm2: workspace too small"))
    assert not is_kernel_fault(ValueError("CUDA error: a ValueError is the backend's own"))
