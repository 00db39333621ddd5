"""Real multi-process runs: one process per rank under torchrun, the real collective, one report.

This module is one rank; `launch.py` starts them. `moe-verify run --topology ep:2 --launcher
torchrun` starts torchrun in-process; on GPUs torchrun can also be run by hand with the flags of
`moe-verify run`:

    torchrun --standalone --nproc-per-node 8 -m moe_verify.distributed --topology ep:8 -T 512 ...

Each rank r (NCCL and cuda:LOCAL_RANK when a GPU is usable, else gloo and the CPU, with Triton
under its interpreter) builds the problem's inputs on its device (deterministic from the seed),
runs the tested backend on rank r (chained and/or isolated), compares that trace with the golden
of rank r, then all-reduces (SUM) its gather output (with shared experts, the runner's finish:
its shared partial added first, or all-reduced on its own where DeepEP's combine already reduced
the routed output: `reference.topology.rank_partial` and `finish`, the emulated reduce's own
definition). Rank 0 also runs the golden of every rank and
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
Rank r notes its stage in flight in MOE_VERIFY_DIST_DIR/rank<r>.json. Its local work runs under
the case timeout (--case-timeout): a stage still running then is an error of that rank's stage
(moe_verify/run/contain.py), and a rank stuck outside Python ends itself a grace period later. A
monitored barrier with a timeout (MOE_VERIFY_DIST_TIMEOUT_S) names a rank that hangs, torchrun
tears the group down when a rank dies, and `launch` names the rank(s) that failed from torchrun's
failures and those notes, and ends every rank once the case timeout and a startup grace ran out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from moe_verify.args import (
    EXIT_ERROR,
    EXIT_PASS,
    add_run_args,
    problem_from_args,
    run_options,
    write_output,
)
from moe_verify.common import progress
from moe_verify.distributed import (
    DEFAULT_TIMEOUT_S,
    EXCHANGE,
    NO_MULTICAST_ENV,
    SETUP_STAGE,
    STATUS_DIR_ENV,
    TIMEOUT_ENV,
)
from moe_verify.run.contain import CaseTimeout, deadline
from moe_verify.run.dump import dump_header, dump_rank_traces
from moe_verify.run.inputs import make_inputs
from moe_verify.run.options import RunOptions
from moe_verify.run.poison import poison_padding
from moe_verify.run.runner import resolve_backend, run_golden
from moe_verify.run.sm90_chain import check_gemm_recipe
from moe_verify.run.verify import verify_rank
from moe_verify.spec import (
    Backend,
    GemmRecipe,
    Mode,
    MoEInputs,
    MoEProblem,
    Stage,
    StageSkipped,
    Status,
    Trace,
)
from optimized.triton_compat import interpreter_mode
from reference.topology import REDUCE_INPUTS, Partial, finish, rank_partial, reduce_ranks
from tolerance.compare import StageResult, compare_stage
from tolerance.cross_rank import with_ranks_agree
from tolerance.report import Report

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
    partials       per mode, what it all-reduces (`reference.topology.Partial`), or why it
                   cannot (a reason)
    golden_reduce  rank 0 only: the golden's reduce_ranks output, bf16 [T, H]
    traces, inputs kept only for --dump-dir: this rank's golden and tested traces, its inputs
    """

    results: dict[Mode, list[StageResult]]
    partials: dict[Mode, Partial | str]
    golden_reduce: torch.Tensor | None = None
    traces: dict[str, Trace] = field(default_factory=dict)
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


def _partial(trace: Trace, problem: MoEProblem) -> Partial | str:
    """This rank's part of the reduce, or why there is none (the same rule as the emulated one)."""
    try:
        return rank_partial(trace, problem)
    except StageSkipped as exc:
        return str(exc)


def _goldens(
    problem: MoEProblem, inputs: MoEInputs, rank: int
) -> tuple[Trace, torch.Tensor | None]:
    """The golden trace of `rank`; on rank 0 also the golden's reduce over every rank (the other
    ranks' traces are dropped after their gather, so only one full trace is held at a time)."""
    golden = resolve_backend("golden")
    own = run_golden(golden, problem, inputs, rank)
    if rank != 0:
        return own, None
    kept = [own.only(REDUCE_INPUTS)]
    for q in range(1, problem.topology.size):
        kept.append(run_golden(golden, problem, inputs, q).only(REDUCE_INPUTS))
    return own, reduce_ranks(kept, problem)


def local_work(
    problem: MoEProblem,
    tested: Backend,
    modes: tuple[Mode, ...],
    ctx: RankContext,
    keep_traces: bool = False,
    *,
    padding_poison: bool = False,
    gemm_recipe: GemmRecipe | None = None,
) -> RankWork:
    """Rank r's inputs, golden and backend traces, and its per-stage results (no collective);
    the traces and inputs are kept for a dump when `keep_traces`. `padding_poison` and
    `gemm_recipe` as `verify`'s: the rank's golden with its padding rows poisoned (the reduce
    reads only gather outputs, which the poison leaves alone), what its GEMMs are held to."""
    inputs = make_inputs(problem, ctx.device)
    golden_trace, golden_reduce = _goldens(problem, inputs, ctx.rank)
    if padding_poison:
        golden_trace = poison_padding(golden_trace, problem)
    verdict = verify_rank(
        problem,
        inputs,
        tested,
        resolve_backend("golden"),
        ctx.rank,
        modes,
        golden_trace=golden_trace,
        gemm_recipe=gemm_recipe,
    )
    # verify_rank tags a single-rank problem's results without a rank; here every rank says its own
    results = {
        m: [r if r.rank is not None else dataclasses.replace(r, rank=ctx.rank) for r in rs]
        for m, rs in verdict.results.items()
    }
    work = RankWork(results, {m: _partial(t, problem) for m, t in verdict.run.tested.items()})
    work.golden_reduce = golden_reduce
    if keep_traces:
        work.traces = {"golden": golden_trace, **verdict.run.tested}
        work.inputs = inputs
    return work


def _failed_work(modes: tuple[Mode, ...], rank: int, exc: BaseException) -> RankWork:
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
    reason = f"rank {rank} failed before comparing: {type(exc).__name__}: {exc}{at}"
    result = StageResult(SETUP_STAGE, Status.ERROR, [], reason, rank=rank)
    missing = f"rank {rank} failed before comparing"
    return RankWork({m: [result] for m in modes}, dict.fromkeys(modes, missing))


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
    mode: Mode,
    backend: str,
) -> StageResult:
    """Rank 0's all-reduced output against the golden's reduce, plus every rank holding it."""
    golden, other = Trace("golden"), Trace(backend)
    golden.add(Stage.REDUCE, {"out": golden_reduce})
    other.add(Stage.REDUCE, {"out": reduced})
    return with_ranks_agree(compare_stage(Stage.REDUCE, golden, other, problem, mode=mode), digests)


def exchange(
    problem: MoEProblem, work: RankWork, modes: tuple[Mode, ...], ctx: RankContext, backend: str
) -> dict[Mode, list[StageResult]] | None:
    """The collectives, identical on every rank: barrier, the all-reduce of each mode's gather
    output, then every rank's results to rank 0. Returns the ordered results on rank 0."""
    _note(ctx.rank, stage=f"{EXCHANGE}: barrier after the local work")
    _barrier(ctx)
    _note(ctx.rank, stage=f"{EXCHANGE}: all-reduce")
    missing = _gather_objects(
        ctx, {m: p if isinstance(p, str) else None for m, p in work.partials.items()}
    )
    reduced: dict[Mode, StageResult] = {}
    for mode in modes:
        why = {q: m[mode] for q, m in enumerate(missing) if m[mode]}
        partial = work.partials[mode]
        if why or isinstance(partial, str):
            said = "; ".join(f"rank {q}: {text}" for q, text in why.items())
            reason = f"nothing to all-reduce on rank(s) {sorted(why)} ({said})"
            reduced[mode] = StageResult(Stage.REDUCE, Status.SKIP, [], reason)
            continue
        dist.all_reduce(partial.routed, op=dist.ReduceOp.SUM)
        if partial.shared is not None:
            dist.all_reduce(partial.shared, op=dist.ReduceOp.SUM)
        out = finish(partial.routed, partial.shared)
        digests = _gather_objects(ctx, _digest(out))
        if ctx.rank == 0:
            assert work.golden_reduce is not None
            reduced[mode] = _reduce_result(problem, work.golden_reduce, out, digests, mode, backend)
    _note(ctx.rank, stage=f"{EXCHANGE}: results to rank 0")
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


def verify_on_rank(
    problem: MoEProblem,
    tested: Backend,
    options: RunOptions,
    ctx: RankContext,
    *,
    json_path: str | None = None,
    markdown_path: str | None = None,
    verbose: bool = False,
) -> int:
    """Local work, exchange, and on rank 0 the report (its summary, or every check when
    `verbose`, as `moe-verify run` prints it; and its --json / --markdown files); the verdict is
    every rank's exit code."""
    modes = options.modes
    try:
        check_gemm_recipe(problem, options.gemm_recipe)
        with deadline(options.case_timeout_s, progress.where):
            work = local_work(
                problem,
                tested,
                modes,
                ctx,
                keep_traces=options.dump_dir is not None,
                padding_poison=options.padding_poison,
                gemm_recipe=options.gemm_recipe,
            )
    except (Exception, CaseTimeout) as exc:  # noqa: BLE001 - this rank's result; collectives go on
        work = _failed_work(modes, ctx.rank, exc)
    backend = f"{tested.name}@torchrun-{ctx.backend}"
    results = exchange(problem, work, modes, ctx, backend)
    verdict, report = None, None
    if results is not None:
        report = Report(
            problem,
            backend,
            modes[0],
            isolated=results.get(Mode.ISOLATED),
            chained=results.get(Mode.CHAINED),
            golden="golden",
        )
        print(report.to_table() if verbose else report.to_summary(), flush=True)
        write_output("--json", json_path, report.to_json)
        write_output("--markdown", markdown_path, report.to_markdown)
        verdict = report.exit_code
        root = os.environ.get(STATUS_DIR_ENV)
        if root:
            (Path(root) / "verdict.json").write_text(json.dumps({"exit": verdict}))
    verdict = int(_gather_objects(ctx, verdict)[0])  # rank 0's, once its files are written
    if options.dump_dir is not None and verdict != EXIT_PASS:
        _dump(options.dump_dir, problem, work, ctx, report, options)
    _note(ctx.rank, stage="done", exit=verdict)
    return verdict


def _dump(
    directory: Path,
    problem: MoEProblem,
    work: RankWork,
    ctx: RankContext,
    report: Report | None,
    options: RunOptions | None = None,
) -> None:
    """A failing case for `moe-verify replay`: rank 0 writes the problem, the report, the run
    `options` (so replay re-runs it) and the inputs (every rank builds the same ones from the
    seed), each rank its own traces; rank 0 then says which ranks' traces are missing, and
    why."""
    out = directory / problem.id
    problem_text = None
    try:
        if ctx.rank == 0 and report is not None:
            inputs = work.inputs
            if inputs is None:  # rank 0 failed before its inputs were kept: the seed rebuilds them
                inputs = make_inputs(problem, ctx.device)
            dump_header(directory, problem, inputs, report, options)
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
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    _note(rank, stage=SETUP_STAGE)
    try:
        rank, world, local_rank = _torchrun_ranks()
        if os.environ.get(STATUS_DIR_ENV):  # the runner's per-stage breadcrumb is this rank's note
            os.environ["MOE_VERIFY_BREADCRUMB"] = str(
                Path(os.environ[STATUS_DIR_ENV]) / f"rank{rank}.json"
            )
        parser = argparse.ArgumentParser(prog="moe_verify.distributed.worker")
        add_run_args(parser)
        args = parser.parse_args(argv)
        options = run_options(args)
        options.check_launcher("torchrun")  # also when torchrun is started by hand
        problem = problem_from_args(args)
        if problem.topology.size != world:
            raise ValueError(
                f"topology {problem.topology} has {problem.topology.size} ranks, torchrun started "
                f"{world} processes (--nproc-per-node must equal the topology's size)"
            )
        tested = resolve_backend(options.backend, options.engine)
    except ValueError as exc:
        print(f"moe-verify[rank {rank}]: error: {exc}", file=sys.stderr)
        _note(rank, stage=SETUP_STAGE, error=str(exc))
        return EXIT_ERROR
    ctx = init_rank(rank, world, local_rank)
    try:
        return verify_on_rank(
            problem,
            tested,
            options,
            ctx,
            json_path=args.json,
            markdown_path=args.markdown,
            verbose=args.verbose,
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
