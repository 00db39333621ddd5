"""Real multi-process runs: one process per rank under torchrun, the real collective, one report.

`moe-verify run --topology ep:2 --launcher torchrun` starts torchrun in-process (`launch`); on GPUs
torchrun can also be run by hand with the flags of `moe-verify run`:

    torchrun --standalone --nproc-per-node 8 -m moe_verify.distributed --topology ep:8 -T 512 ...

Each rank r (NCCL and cuda:LOCAL_RANK when a GPU is usable, else gloo and the CPU, with Triton
under its interpreter) builds the problem's inputs on its device (deterministic from the seed),
runs the tested backend on rank r (chained and/or isolated), compares that trace with the golden
of rank r, then all-reduces (SUM) its gather output (with shared experts, the runner's finish:
its shared partial added first, or all-reduced on its own where DeepEP's combine already reduced
the routed output, as `reduce_with_shared`). Rank 0 also runs the golden of every rank and
compares the reduced output with the golden's `reduce_ranks`; every rank's results are gathered
to rank 0, which prints one Report and writes --json/--markdown. Every rank exits with the
verdict, so a bare torchrun fails on a failing case.

Reduce semantics: each rank's bf16 partial is all-reduced as an fp32 copy and rounded to bf16
once, the semantics of `reduce_ranks` (vLLM's NCCL all-reduce sums bf16 and rounds per hop; this
checks the partials and the transport, not NCCL's bf16 arithmetic). Every rank must then hold the
same bits, which the reduce stage checks too. Under ep:N+ht every rank still builds all tokens and
keeps those dispatched to it; DeepEP's combine is emulated by scattering each rank's rows into
token space (index_add) before the all-reduce. DeepEP's dispatch/combine kernels are not run.

Failure handling: every rank makes the same collective calls in the same order whatever failed on
it (a stage that raised is a result, not an exit), so one bad rank never leaves the others waiting.
Rank r notes its stage in flight in MOE_VERIFY_DIST_DIR/rank<r>.json; a monitored barrier with a
timeout (MOE_VERIFY_DIST_TIMEOUT_S) names a rank that hangs, torchrun tears the group down when a
rank dies, and `launch` names the rank(s) that failed from torchrun's failures and those notes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
    record,
)

from moe_verify.spec import REDUCE_STAGE, Backend, MoEInputs, MoEProblem, Trace
from tolerance.compare import CheckResult, StageResult, Worst, compare, compare_stage
from tolerance.report import Report

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2  # as moe_verify.cli
STATUS_DIR_ENV = "MOE_VERIFY_DIST_DIR"
TIMEOUT_ENV = "MOE_VERIFY_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 900.0
# NVLink multicast stays off, also over a user's environment: it must on the shared multi-GPU
# hosts (ENVIRONMENT.md), and it is not what is verified here.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
_MODES = {"isolated": ("isolated",), "chained": ("chained",), "both": ("isolated", "chained")}
# A rank that fails before its stages run (inputs, the golden) reports under this stage name.
SETUP_STAGE = "setup"
_EXCHANGE = "exchange"
_AGREE_REASON = (
    "an all-reduce leaves every rank the same sum; a rank holding other bits has a broken "
    "collective (or reduces in another order)"
)


# Worker: one rank ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankContext:
    """Where this rank runs. `ctrl` is a gloo group for objects and barriers (None: the default
    group is gloo already); the default group carries the collective under test."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    ctrl: dist.ProcessGroup | None


@dataclass
class RankWork:
    """What rank r computed on its own before any collective.

    results        per mode, rank r's stage results against the golden of rank r
    partials       per mode, what it all-reduces (`Partials`)
    golden_reduce  rank 0 only: the golden's reduce_ranks output, bf16 [T, H]
    traces, inputs kept only for --dump-dir: this rank's golden and tested traces, its inputs
    """

    results: dict[str, list[StageResult]]
    partials: dict[str, Partials]
    golden_reduce: torch.Tensor | None = None
    traces: dict[str, Trace] = dataclasses.field(default_factory=dict)
    inputs: MoEInputs | None = None


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))


def _note(rank: int, **fields: object) -> None:
    """Record this rank's stage in flight (or its error) for the launcher; same file and keys as
    the runner's per-stage breadcrumb, which the worker points at it."""
    root = os.environ.get(STATUS_DIR_ENV)
    if root:
        (Path(root) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **fields}) + "\n")


def _torchrun_ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the variables torchrun sets."""
    try:
        return (
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
        )
    except KeyError as exc:
        raise ValueError(
            f"moe_verify.distributed runs under torchrun ({exc.args[0]} is not set): "
            "torchrun --standalone --nproc-per-node N -m moe_verify.distributed <run flags>, "
            "or moe-verify run --launcher torchrun"
        ) from None


def init_rank(rank: int, world: int, local_rank: int) -> RankContext:
    """Join the group: NCCL on cuda:local_rank when a GPU runs the kernels, else gloo on the CPU."""
    from moe_verify.device import interpreter_mode

    os.environ.update(NO_MULTICAST_ENV)  # read by NCCL at communicator creation
    timeout = _timeout()
    if torch.cuda.is_available() and not interpreter_mode():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        ctrl = dist.new_group(backend="gloo", timeout=timeout)
        return RankContext(rank, world, local_rank, device, "nccl", ctrl)
    dist.init_process_group("gloo", timeout=timeout)
    return RankContext(rank, world, local_rank, torch.device("cpu"), "gloo", None)


def _tag(
    results: list[StageResult], trace: Trace, rank: int, problem: MoEProblem
) -> list[StageResult]:
    """Rank r's results as `verify` tags them: the rank, the GEMM engine, provenance checks."""
    from moe_verify.verify import engine_of, with_provenance

    tagged = [dataclasses.replace(r, rank=rank, engine=engine_of(trace, r.stage)) for r in results]
    if problem.provenance:
        tagged = [with_provenance(r, trace, rank) for r in tagged]
    return tagged


def _token_space(trace: Trace, problem: MoEProblem) -> torch.Tensor:
    """This rank's gather output (which ran) as an fp32 [T, H] partial (ep+ht rows scattered to
    their tokens, zeros elsewhere: the combine)."""
    out = trace["gather"]["out"]
    index = trace["route"].get("token_index") if "route" in trace else None
    if index is None:
        return out.to(torch.float32, copy=True)  # all-reduced in place: never the trace's own
    partial = torch.zeros(problem.tokens, out.shape[1], dtype=torch.float32, device=out.device)
    return partial.index_add_(0, index, out.float())


@dataclass
class Partials:
    """What one rank all-reduces in one mode: `reduce` (fp32 [T, H]) and, where DeepEP's combine
    already reduced the routed output, the shared experts' partial apart; or why it cannot."""

    reduce: torch.Tensor | None = None
    shared: torch.Tensor | None = None
    missing: str | None = None


def _partials(trace: Trace, problem: MoEProblem) -> Partials:
    """This rank's part of the runner's finish (reduce_with_shared): the routed partial alone
    without shared experts; with them, routed + shared in bf16 per rank, or the shared partial
    apart where the combine reduced the routed output. Shapes are checked first, so every rank
    all-reduces the same [T, H] or none does."""
    from moe_verify.runner import did_not_run
    from moe_verify.spec import TopologyKind

    if "gather" not in trace or did_not_run(trace["gather"]):
        return Partials(missing="gather did not run")
    out = trace["gather"]["out"]
    index = trace["route"].get("token_index") if "route" in trace else None
    rows = problem.tokens if index is None else index.shape[0]
    if tuple(out.shape) != (rows, problem.hidden):
        return Partials(missing=f"gather out is {tuple(out.shape)}, not ({rows}, {problem.hidden})")
    routed = _token_space(trace, problem)
    if not problem.shared_experts:
        return Partials(routed)
    if "shared" not in trace or did_not_run(trace["shared"]):
        return Partials(missing="shared did not run")
    shared = trace["shared"]["out"]
    if tuple(shared.shape) != (problem.tokens, problem.hidden):
        return Partials(
            missing=f"shared out is {tuple(shared.shape)}, not ({problem.tokens}, {problem.hidden})"
        )
    if problem.topology.kind in (TopologyKind.EP_HT, TopologyKind.EP_LL):
        return Partials(routed, shared.to(torch.float32, copy=True))
    return Partials((out.float() + shared.float()).to(torch.bfloat16).float())


def finish(total: torch.Tensor, shared_total: torch.Tensor | None) -> torch.Tensor:
    """bf16 [T, H] from the all-reduced fp32 sums: rounded once, plus the shared experts' sum
    (rounded on its own) where the combine had reduced the routed output."""
    out = total.to(torch.bfloat16)
    if shared_total is None:
        return out
    return (out.float() + shared_total.to(torch.bfloat16).float()).to(torch.bfloat16)


def _goldens(
    problem: MoEProblem, inputs: MoEInputs, rank: int
) -> tuple[Trace, torch.Tensor | None]:
    """The golden trace of `rank`; on rank 0 also the golden's reduce over every rank (the other
    ranks' traces are dropped after their gather, so only one full trace is held at a time)."""
    from moe_verify.runner import did_not_run, reduce_ranks, run_chained
    from reference.moe import ReferenceBackend

    golden = ReferenceBackend()
    own: Trace | None = None
    kept: list[Trace] = []
    for q in range(problem.topology.size) if rank == 0 else [rank]:
        trace = run_chained(golden, problem, inputs, q)
        failed = [s for s in trace if did_not_run(trace[s])]
        if failed:
            raise RuntimeError(
                f"the golden itself failed on rank {q} at {failed[0]}: "
                f"{did_not_run(trace[failed[0]])}"
            )
        if q == rank:
            own = trace
        slim = Trace(trace.backend, q)
        slim.add("route", {k: v for k, v in trace["route"].items() if k == "token_index"})
        slim.add("gather", trace["gather"])
        if "shared" in trace:
            slim.add("shared", trace["shared"])
        kept.append(slim)
    assert own is not None
    if rank != 0:
        return own, None
    reduced = reduce_ranks(kept, problem)["out"]
    assert isinstance(reduced, torch.Tensor)
    return own, reduced


def local_work(
    problem: MoEProblem,
    tested: Backend,
    modes: tuple[str, ...],
    ctx: RankContext,
    keep_traces: bool = False,
) -> RankWork:
    """Rank r's inputs, golden and backend traces, and its per-stage results (no collective);
    the traces and inputs are kept for a dump when `keep_traces`."""
    from moe_verify.inputs import make_inputs
    from moe_verify.runner import run_chained, run_isolated

    inputs = make_inputs(problem, ctx.device)
    golden, golden_reduce = _goldens(problem, inputs, ctx.rank)
    work = RankWork({}, {}, golden_reduce)
    if keep_traces:
        work.traces["golden"], work.inputs = golden, inputs
    stages = list(problem.stages)
    for mode in modes:
        if mode == "chained":
            trace = run_chained(tested, problem, inputs, ctx.rank)
        else:
            trace = run_isolated(tested, problem, inputs, golden, ctx.rank)
        results = compare(golden, trace, problem, stages, mode=mode)
        work.results[mode] = _tag(results, trace, ctx.rank, problem)
        work.partials[mode] = _partials(trace, problem)
        if keep_traces:
            work.traces[mode] = trace
    return work


def _failed_work(modes: tuple[str, ...], rank: int, exc: BaseException) -> RankWork:
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
    reason = f"rank {rank} failed before comparing: {type(exc).__name__}: {exc}{at}"
    result = StageResult(SETUP_STAGE, "error", [], reason, rank=rank)
    missing = f"rank {rank} failed before comparing"
    return RankWork({m: [result] for m in modes}, {m: Partials(missing=missing) for m in modes})


def _gather_objects(ctx: RankContext, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (over gloo, also when NCCL carries the data)."""
    out: list[Any] = [None] * ctx.world
    dist.all_gather_object(out, obj, group=ctx.ctrl)
    return out


def _digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()


def _reduce_result(
    problem: MoEProblem,
    golden_reduce: torch.Tensor,
    reduced: torch.Tensor,
    digests: list[str],
    mode: str,
    backend: str,
) -> StageResult:
    """Rank 0's all-reduced output against the golden's reduce, plus every rank holding it."""
    golden, other = Trace("golden"), Trace(backend)
    golden.add(REDUCE_STAGE, {"out": golden_reduce})
    other.add(REDUCE_STAGE, {"out": reduced})
    result = compare_stage(REDUCE_STAGE, golden, other, problem, mode=mode)
    differ = [q for q, d in enumerate(digests) if d != digests[0]]
    agree = CheckResult(
        "ranks agree",
        not differ,
        len(differ),
        0,
        _AGREE_REASON,
        Worst(rank=differ[0]) if differ else None,
        f"rank(s) {differ} hold other bits than rank 0" if differ else "every rank holds rank 0's",
    )
    checks = [*result.checks, agree]
    status = result.status
    if differ and status == "pass":
        status = "fail"
    return dataclasses.replace(result, checks=checks, status=status)


def exchange(
    problem: MoEProblem, work: RankWork, modes: tuple[str, ...], ctx: RankContext, backend: str
) -> dict[str, list[StageResult]] | None:
    """The collectives, identical on every rank: barrier, the all-reduce of each mode's gather
    output, then every rank's results to rank 0. Returns the ordered results on rank 0."""
    _note(ctx.rank, stage=f"{_EXCHANGE}: barrier after the local work")
    _barrier(ctx)
    _note(ctx.rank, stage=f"{_EXCHANGE}: all-reduce")
    missing = _gather_objects(ctx, {m: work.partials[m].missing for m in modes})
    reduced: dict[str, StageResult] = {}
    for mode in modes:
        why = {q: m[mode] for q, m in enumerate(missing) if m[mode]}
        if why:
            said = "; ".join(f"rank {q}: {text}" for q, text in why.items())
            reason = f"nothing to all-reduce on rank(s) {sorted(why)} ({said})"
            reduced[mode] = StageResult(REDUCE_STAGE, "skip", [], reason)
            continue
        partial, shared = work.partials[mode].reduce, work.partials[mode].shared
        assert partial is not None
        dist.all_reduce(partial, op=dist.ReduceOp.SUM)
        if shared is not None:
            dist.all_reduce(shared, op=dist.ReduceOp.SUM)
        out = finish(partial, shared)
        digests = _gather_objects(ctx, _digest(out))
        if ctx.rank == 0:
            assert work.golden_reduce is not None
            reduced[mode] = _reduce_result(problem, work.golden_reduce, out, digests, mode, backend)
    _note(ctx.rank, stage=f"{_EXCHANGE}: results to rank 0")
    everyone = _gather_objects(ctx, work.results)
    if ctx.rank != 0:
        return None
    return {
        m: [*_ordered(problem, [r for results in everyone for r in results[m]]), reduced[m]]
        for m in modes
    }


def _ordered(problem: MoEProblem, results: list[StageResult]) -> list[StageResult]:
    """Stage by stage in the topology's order, ranks ascending within a stage (as `verify`)."""
    position = {SETUP_STAGE: -1, **{s: i for i, s in enumerate(problem.stages)}}
    return sorted(results, key=lambda r: (position.get(r.stage, len(position)), r.rank or 0))


def _barrier(ctx: RankContext) -> None:
    """A gloo barrier with the group timeout; monitored, so a hung or dead rank is named."""
    try:
        dist.monitored_barrier(group=ctx.ctrl, timeout=_timeout(), wait_all_ranks=True)
    except RuntimeError as exc:
        raise RuntimeError(
            f"rank {ctx.rank}: a peer hung in its local work past {_timeout().total_seconds():g} s "
            f"({TIMEOUT_ENV}) or died: {exc}"
        ) from exc


def run_rank(
    problem: MoEProblem, tested: Backend, args: argparse.Namespace, ctx: RankContext
) -> int:
    """Local work, exchange, and on rank 0 the report; the verdict is every rank's exit code."""
    modes = _MODES[args.mode]
    dump_dir = getattr(args, "dump_dir", None)
    try:
        work = local_work(problem, tested, modes, ctx, keep_traces=bool(dump_dir))
    except Exception as exc:  # noqa: BLE001 - reported as this rank's result; the collectives go on
        work = _failed_work(modes, ctx.rank, exc)
    backend = f"{tested.name}@torchrun-{ctx.backend}"
    results = exchange(problem, work, modes, ctx, backend)
    verdict, report = None, None
    if results is not None:
        report = Report(
            problem,
            backend,
            modes[0],
            isolated=results.get("isolated"),
            chained=results.get("chained"),
            golden="golden",
        )
        print(report.to_table(), flush=True)
        if args.json:
            Path(args.json).write_text(report.to_json())
        if args.markdown:
            Path(args.markdown).write_text(report.to_markdown())
        verdict = EXIT_PASS if report.passed else EXIT_FAIL
        root = os.environ.get(STATUS_DIR_ENV)
        if root:
            (Path(root) / "verdict.json").write_text(json.dumps({"exit": verdict}))
    verdict = int(_gather_objects(ctx, verdict)[0])  # rank 0's, once its files are written
    if dump_dir and verdict != EXIT_PASS:
        _dump(Path(dump_dir), problem, work, ctx, report)
    _note(ctx.rank, stage="done", exit=verdict)
    return verdict


def _dump(
    directory: Path, problem: MoEProblem, work: RankWork, ctx: RankContext, report: Report | None
) -> None:
    """A failing case for `moe-verify replay`: rank 0 writes the problem, the report and the
    inputs (every rank builds the same ones from the seed), each rank its own traces; rank 0
    then says which ranks' traces are missing, and why."""
    from moe_verify.dump import dump_header, dump_rank_traces

    out = directory / problem.id
    problem_text = None
    try:
        if ctx.rank == 0 and report is not None:
            inputs = work.inputs
            if inputs is None:  # rank 0 failed before its inputs were kept: the seed rebuilds them
                from moe_verify.inputs import make_inputs

                inputs = make_inputs(problem, ctx.device)
            dump_header(directory, problem, inputs, report)
        if not work.traces:
            problem_text = "no traces (it failed before comparing)"
        dump_rank_traces(out, ctx.rank, dict(work.traces))
    except Exception as exc:  # noqa: BLE001 - reported by rank 0; the gather below must happen
        problem_text = f"{type(exc).__name__}: {exc}"
    problems = _gather_objects(ctx, problem_text)  # also: the dump is whole once all wrote
    if ctx.rank == 0:
        gaps = [f"rank {q}: {text}" for q, text in enumerate(problems) if text]
        print(f"dump: {out}" + (f" (incomplete: {'; '.join(gaps)})" if gaps else ""), flush=True)


@record
def main(argv: list[str] | None = None) -> int:
    """torchrun entry point: the flags of `moe-verify run` (--launcher is ignored here)."""
    from moe_verify.cli import build_parser, prepare_triton
    from moe_verify.runner import resolve_backend

    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    _note(rank, stage=SETUP_STAGE)
    try:
        rank, world, local_rank = _torchrun_ranks()
        if os.environ.get(STATUS_DIR_ENV):  # the runner's per-stage breadcrumb is this rank's note
            os.environ["MOE_VERIFY_BREADCRUMB"] = str(
                Path(os.environ[STATUS_DIR_ENV]) / f"rank{rank}.json"
            )
        args = build_parser().parse_args(["run", *argv])
        prepare_triton()
        problem = rank_problem(args)
        if problem.topology.size != world:
            raise ValueError(
                f"topology {problem.topology} has {problem.topology.size} ranks, torchrun started "
                f"{world} processes (--nproc-per-node must equal the topology's size)"
            )
        tested = resolve_backend(args.backend, args.engine)
    except ValueError as exc:
        print(f"moe-verify[rank {rank}]: error: {exc}", file=sys.stderr)
        _note(rank, stage=SETUP_STAGE, error=str(exc))
        return EXIT_ERROR
    ctx = init_rank(rank, world, local_rank)
    try:
        return run_rank(problem, tested, args, ctx)
    finally:
        dist.destroy_process_group()


def rank_problem(args: argparse.Namespace) -> MoEProblem:
    """The problem of `moe-verify run`'s flags (or --problem-json); flags that torchrun ranks do not
    honour yet are refused rather than ignored."""
    from moe_verify.cli import problem_from_args

    if getattr(args, "compare_on", "golden") != "golden":
        raise ValueError("--compare-on cpu is not supported with --launcher torchrun yet")
    if args.problem_json:
        return MoEProblem.from_dict(json.loads(Path(args.problem_json).read_text()))
    return problem_from_args(args)


# Launcher -----------------------------------------------------------------------------------------


@contextmanager
def _environ(updates: dict[str, str]) -> Iterator[None]:
    """os.environ with `updates` for the duration (torchrun's workers inherit it)."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _launch_env(status_dir: Path) -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)  # moe_verify, reference, ... importable
    path = os.environ.get("PYTHONPATH")
    env = {
        STATUS_DIR_ENV: str(status_dir),
        "PYTHONPATH": f"{root}{os.pathsep}{path}" if path else root,
    }
    env.update(NO_MULTICAST_ENV)
    # torchrun's own default for several processes on one node, set here to keep its banner out.
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "1")
    return env


def launch(
    problem: MoEProblem,
    *,
    backend: str = "optimized",
    engine: str = "auto",
    mode: str = "both",
    json_path: str | None = None,
    markdown_path: str | None = None,
    nproc: int | None = None,
    dump_dir: str | None = None,
) -> int:
    """Run `problem` with one torchrun process per rank; the exit code of `moe-verify run`."""
    from torch.distributed.run import parse_args, run

    size = problem.topology.size
    if nproc is not None and nproc != size:
        raise ValueError(
            f"--nproc {nproc}: topology {problem.topology} has {size} ranks, one process each"
        )
    if mode not in _MODES:
        raise ValueError(f"mode: expected one of {sorted(_MODES)}, got {mode!r}")
    with tempfile.TemporaryDirectory(prefix="moe-verify-dist-") as tmp:
        status = Path(tmp)
        (status / "problem.json").write_text(json.dumps(problem.to_dict()))
        worker = ["--problem-json", str(status / "problem.json")]
        worker += ["--backend", backend, "--engine", engine, "--mode", mode]
        if json_path:
            worker += ["--json", str(Path(json_path).resolve())]
        if markdown_path:
            worker += ["--markdown", str(Path(markdown_path).resolve())]
        if dump_dir:
            worker += ["--dump-dir", str(Path(dump_dir).resolve())]
        torchrun = [
            "--standalone",
            f"--nproc-per-node={size}",
            "--monitor-interval=0.1",
            "-m",
            "moe_verify.distributed",
            *worker,
        ]
        failures: dict[int, ProcessFailure] = {}
        with _environ(_launch_env(status)):
            try:
                run(parse_args(torchrun))
            except ChildFailedError as exc:
                failures = dict(exc.failures)
        verdict = status / "verdict.json"
        if verdict.exists():
            return int(json.loads(verdict.read_text())["exit"])
        print(failure_summary(problem, status, failures), file=sys.stderr)
        return EXIT_ERROR


def failure_summary(problem: MoEProblem, status: Path, failures: dict[int, ProcessFailure]) -> str:
    """Which rank(s) failed and where, when the ranks ended without a verdict."""
    notes = {}
    for rank in range(problem.topology.size):
        path = status / f"rank{rank}.json"
        notes[rank] = json.loads(path.read_text()) if path.exists() else {}
    lines = [
        f"moe-verify: error: {problem.id}: the torchrun ranks ended without a verdict; "
        f"failed rank(s): {failed_ranks(notes, failures)}"
    ]
    for rank in range(problem.topology.size):
        note = notes[rank]
        where = f"last in {note.get('stage', 'startup')}"
        if note.get("mode"):
            where += f" ({note['mode']})"
        what = _exit_text(failures.get(rank), note.get("error"))
        lines.append(f"  rank {rank}: {what}; {where}")
    return "\n".join(lines)


def _exit_text(failure: ProcessFailure | None, noted_error: str | None) -> str:
    if noted_error:  # the rank said why before it exited
        code = "" if failure is None else f" (exit {failure.exitcode})"
        return f"error{code}: {noted_error}"
    if failure is None:
        return "exited 0"
    if failure.exitcode == -signal.SIGTERM:
        return "terminated by torchrun after a peer failed"
    message = failure.error_file_data.get("message", "")
    if isinstance(message, dict):  # @record's error file: {"message": text, "extraInfo": ...}
        message = message.get("message", "")
    message = str(message).strip()
    if not message or message == "<NONE>":  # torchrun's placeholder: no error file was written
        return f"exit {failure.exitcode} with no Python error (a crash: segfault, IMA, abort?)"
    return f"exit {failure.exitcode}: {message.splitlines()[0]}"


def failed_ranks(notes: dict[int, dict], failures: dict[int, ProcessFailure]) -> list[int]:
    """The ranks to blame: those that never reached the exchange while others did (crashed or
    hung in their local work); else those that noted an error or exited on their own rather than
    being terminated."""
    behind = [
        r
        for r, n in notes.items()
        if not str(n.get("stage", "")).startswith(_EXCHANGE) and n.get("stage") != "done"
    ]
    if behind and len(behind) < len(notes):
        return behind
    own = {r for r, f in failures.items() if f.exitcode != -signal.SIGTERM}
    own |= {r for r, n in notes.items() if n.get("error")}
    return sorted(own or failures)


def launch_from_args(args: argparse.Namespace) -> int:
    """`moe-verify run --launcher torchrun`: the run flags, one process per rank."""
    return launch(
        rank_problem(args),
        backend=args.backend,
        engine=args.engine,
        mode=args.mode,
        json_path=args.json,
        markdown_path=args.markdown,
        nproc=args.nproc,
        dump_dir=args.dump_dir,
    )


if __name__ == "__main__":
    sys.exit(main())
