"""`moe-verify`: verify fused-MoE kernels stage by stage against an independent golden.

`moe-verify` alone runs `run` on the small default case (a CPU does it in seconds).

Exit codes: 0 every check passed; 1 a check failed; 2 an error (bad arguments or output paths, a
crash, a timeout, a missing dependency, or nothing verified: every stage skipped); 130
interrupted (Ctrl-C); 143 terminated (SIGTERM). An error is one line on stderr; -v or
MOE_VERIFY_DEBUG=1 adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from moe_verify.args import (
    EXIT_ERROR,
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_PASS,
    EXIT_TERMINATED,
    add_backend_args,
    add_case_timeout_arg,
    add_plot_arg,
    add_problem_args,
    add_run_args,
    check_output_dir,
    check_output_file,
    problem_from_args,
    run_options,
    write_output,
)
from moe_verify.run.contain import terminate_as_exit, terminated, user_interrupted, watch_interrupts
from moe_verify.spec import MODE_CHOICES, Engine, MoEProblem

if TYPE_CHECKING:  # the commands import what they run: a usage error never waits for torch
    from tolerance.report import Report


def require_engine(engine: str | None) -> None:
    """An engine asked for by name must be able to run here (`auto` picks one that can)."""
    if engine is None or Engine(engine) is not Engine.DEEPGEMM:
        return
    from optimized import deepgemm

    status = deepgemm.probe()
    if not status.usable:
        raise RuntimeError(
            f"--engine deepgemm cannot run here: {status.reason} "
            "(--engine auto runs the GEMMs on the Triton grouped GEMM instead)"
        )


def print_files(report: Report, args: argparse.Namespace) -> None:
    """Say where the run's dump and plots went, or why there are none."""
    if args.dump_dir:
        dumps = report.files.get("dump", [])
        for where in dumps:
            print(f"dumped to {where} (moe-verify replay {where} re-runs it)")
        if not dumps:
            print("nothing dumped: every check passed")
    if args.plot:
        plots = report.files.get("plots", [])
        print(
            f"plots in {args.plot} ({len(plots)} files)" if plots else "no plots: no stage failed"
        )


def print_report(report: Report, verbose: bool) -> None:
    """The report as `run` and `replay` print it: every check when `verbose`, else a line per
    failing stage and the verdict."""
    print(report.to_table() if verbose else report.to_summary())


def cmd_run(args: argparse.Namespace) -> int:
    check_output_file("--json", args.json)
    check_output_file("--markdown", args.markdown)
    check_output_dir("--dump-dir", args.dump_dir)
    check_output_dir("--plot", args.plot)
    options = run_options(args)  # every run option checked before any work
    if args.sanitize:  # the same flags, run again in a child under the sanitizer
        from moe_verify.sanitize.run import run_sanitized

        return run_sanitized(args.sanitize, args.argv[1:], options.case_timeout_s, args.launcher)
    require_engine(args.engine)
    problem = problem_from_args(args)
    if args.launcher == "torchrun":
        from moe_verify.distributed.launch import launch

        return launch(
            problem,
            options,
            json_path=args.json,
            markdown_path=args.markdown,
            nproc=args.nproc,
            verbose=args.verbose,
        )
    if args.nproc is not None:
        raise ValueError("--nproc needs --launcher torchrun")
    from moe_verify.run.verify import OutputNotWritten, verify

    try:
        report = verify(problem, options=options)
    except OutputNotWritten as exc:  # a full disk after the run: its report first, then why
        print_report(exc.report, args.verbose)
        raise
    print_report(report, args.verbose)
    if options.invariance is not None:
        print(f"invariance {report.files['invariance'][0]}: every stage compared bit for bit")
    print_files(report, args)
    write_output("--json", args.json, report.to_json)
    write_output("--markdown", args.markdown, report.to_markdown)
    if args.strict and report.exit_code == EXIT_PASS and not report.passed_strict:
        return EXIT_FAIL
    return report.exit_code


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.list:
        return list_cases(args)
    check_output_dir("--out", args.out)
    check_output_dir("--plot", args.plot)
    options = run_options(args)
    if args.in_process and (args.jobs or 1) > 1:
        raise ValueError(
            f"--jobs {args.jobs} needs workers: --in-process runs the cases one at a time in "
            "this process"
        )
    from moe_verify.sweep.cases import select_cases

    select_cases(args.preset, args.filter, args.shard)  # its errors before the heavy imports
    from moe_verify.common.jit_cache import shared_jit_caches
    from moe_verify.sweep.pool import default_jobs
    from moe_verify.sweep.sweep import sweep

    jobs = args.jobs or (1 if args.in_process else default_jobs())
    shared_jit_caches()  # before require_engine imports DeepGEMM
    require_engine(args.engine)
    summary = sweep(
        args.preset,
        options=options,
        out_dir=Path(args.out),
        isolate=not args.in_process,
        filter_text=args.filter,
        shard=args.shard,
        jobs=jobs,
    )
    return summary.exit_code


def list_cases(args: argparse.Namespace) -> int:
    """`sweep --list`: the cases a sweep with these flags would run, one line each (id, and the
    edge it exercises: every preset names one), then their count and the distinct DeepGEMM GEMM
    shapes among them; nothing runs."""
    from moe_verify.sweep.cases import preset_edges, select_cases
    from moe_verify.sweep.nightly import gemm_shapes

    chosen = select_cases(args.preset, args.filter, args.shard)
    edges = preset_edges(args.preset)
    width = max(len(p.id) for p in chosen)
    for p in chosen:
        print(f"{p.id:<{width}}  {edges[p.id]}")
    shard = f" (shard {args.shard})" if args.shard else ""
    print(
        f"{len(chosen)} cases of {args.preset}{shard}; "
        f"{len(gemm_shapes(chosen))} distinct fp8_block GEMM shapes (N, K, local experts)"
    )
    return EXIT_PASS


def cmd_replay(args: argparse.Namespace) -> int:
    require_engine(args.engine)
    from moe_verify.run.verify import replay

    report = replay(Path(args.dump), backend=args.backend, engine=args.engine, mode=args.mode)
    print_report(report, args.verbose)
    return report.exit_code


def cmd_calibrate(args: argparse.Namespace) -> int:
    check_output_file("--out", args.out)
    require_engine(args.engine)
    from moe_verify.calibrate import calibrate

    cases = None
    if args.preset:
        from moe_verify.sweep.cases import preset

        cases = preset(args.preset)
    result = calibrate(
        seeds=args.seeds,
        out=Path(args.out) if args.out else None,
        cases=cases,
        backend=args.backend,
        engine=args.engine,
        case_timeout_s=args.case_timeout or None,
    )
    print(result.summary() if args.out else result.to_markdown())
    return EXIT_PASS


def cmd_bench(args: argparse.Namespace) -> int:
    check_output_file("--out", args.out)
    problem = problem_from_args(args)
    if args.production:
        if args.compare_cost:
            raise ValueError(
                "--compare-cost: times verification's comparisons, not with --production"
            )
        text = bench_production_tables(problem, args)
    else:
        given = {
            "--decode": args.decode or None,
            "--rank": args.rank,
            "--engine": args.engine,
            "--backend": args.backend,
        }
        unused = [flag for flag, value in given.items() if value is not None]
        if unused:
            raise ValueError(f"{', '.join(unused)}: needs --production")
        from moe_verify.production.bench import bench, compare_cost, to_markdown

        engines = tuple(Engine(e) for e in args.engines.split(",") if e)
        timings = bench(problem, engines=engines, repeats=args.repeats)
        costs = compare_cost(problem) if args.compare_cost else None
        text = to_markdown(problem, timings, costs)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
        print(f"appended the bench of {problem.id} ({len(text.splitlines())} lines) to {args.out}")
    else:
        print(text)
    return EXIT_PASS


def bench_production_tables(problem: MoEProblem, args: argparse.Namespace) -> str:
    """The production-mode tables of `moe-verify bench --production [--decode]`."""
    from moe_verify.production.bench_production import bench_decode, bench_production
    from moe_verify.run.runner import production_backend

    engine = args.engine or Engine.AUTO.value
    require_engine(engine)
    rank = 0 if args.rank is None else args.rank
    backend = production_backend(args.backend or "optimized", engine)
    bench = bench_production(problem, rank=rank, engine=engine, repeats=args.repeats,
                             backend=backend)  # fmt: skip
    text = bench.to_markdown()
    if args.decode:
        decode = bench_decode(problem, rank=rank, engine=engine, repeats=args.repeats,
                              backend=backend)  # fmt: skip
        text += "\n" + decode.to_markdown()
    return text


def cmd_graph(args: argparse.Namespace) -> int:
    check_output_file("--json", args.json)
    if args.forward is not None:
        raise ValueError(
            "graph --forward is gone: pass --backend module:Class, the same class `run` takes "
            "(a subclass of optimized.OptimizedBackend, its stage methods written once)"
        )
    problem = problem_from_args(args)
    require_engine(args.engine)
    from moe_verify.production.graph import (
        default_replays,
        describe_fault,
        is_kernel_fault,
        verify_graph,
    )
    from moe_verify.run.runner import production_backend

    if not args.in_process:
        return graph_contained(args, problem)
    bound = args.bound if args.bound is not None else problem.tokens
    replays = default_replays(bound, problem.seed)
    if args.replays:
        known = {r.name: r for r in replays}
        wanted = [name.strip() for name in args.replays.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in known]
        if unknown:
            raise ValueError(f"--replays: unknown {unknown}; known: {list(known)}")
        replays = [replays[0]] + [known[n] for n in wanted if n != replays[0].name]
    try:
        report = verify_graph(
            problem,
            bound=bound,
            replays=replays,
            engine=args.engine,
            backend=production_backend(args.backend, args.engine),
            capture=False if args.no_capture else None,
        )
    except Exception as exc:
        if not is_kernel_fault(exc):
            raise
        line, fault_json = describe_fault(problem.id, exc)
        print(line)
        write_output("--json", args.json, lambda: fault_json)
        return EXIT_FAIL
    print(report.to_summary(verbose=args.verbose))
    write_output("--json", args.json, report.to_json)
    return report.exit_code


def graph_contained(args: argparse.Namespace, problem: MoEProblem) -> int:
    """`graph` in a child process: its output and exit status, or, when a kernel fault or the
    case timeout ended it, one line naming the replay, rank and stage in flight (exit 1)."""
    from moe_verify.production.graph import run_graph_contained

    child = run_graph_contained(args.argv, args.case_timeout)
    sys.stdout.write(child.done.stdout)
    if not child.crashed:
        sys.stderr.write(child.done.stderr)
        return child.done.rc
    if os.environ.get("MOE_VERIFY_DEBUG") == "1":
        sys.stderr.write(child.done.stderr)
    print(child.describe(problem.id))
    write_output("--json", args.json, lambda: child.to_json(problem.id))
    return EXIT_FAIL


def cmd_audit_e8m0(args: argparse.Namespace) -> int:
    check_output_dir("--out", args.out)
    from moe_verify.audit import DEFAULT_MAX_RATIO, audit, write_report

    report = audit(
        args.checkpoint,
        experts_per_layer=args.experts_per_layer,
        tokens=args.tokens,
        seed=args.seed,
        device=args.device,
        max_ratio=DEFAULT_MAX_RATIO if args.max_ratio is None else args.max_ratio,
        activations=args.activations,
    )
    print(f"verdict {report.verdict}: {report.reason}")  # before the files: a full disk loses none
    files = write_report(report, Path(args.out))
    print("wrote " + ", ".join(str(f) for f in files))
    return EXIT_FAIL if report.verdict == "at-risk" else EXIT_PASS


def cmd_doctor(args: argparse.Namespace) -> int:
    """What this machine can run (moe_verify/doctor.py): torch, triton, GPU arch, DeepGEMM and
    its first call, and each engine adapter."""
    from moe_verify.doctor import doctor

    print(json.dumps(doctor(first_call=args.first_call), indent=2))
    return EXIT_PASS


class _CommandHelp(argparse.RawDescriptionHelpFormatter):
    """argparse measures the subcommands one indent short of where it prints them, so a name
    longer than eight characters pushes its help to a line of its own; this counts the indent."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):
            names = [len(choice.dest) for choice in action._get_subactions()]
            width = max(names, default=0) + self._current_indent + 2 * self._indent_increment
            self._action_max_length = max(self._action_max_length, width)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-verify",
        description=__doc__,
        formatter_class=_CommandHelp,
        epilog="`moe-verify COMMAND --help` lists a command's flags.",
    )
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    run = sub.add_parser("run", help="verify one case stage by stage (the default command)")
    add_run_args(run)
    run.set_defaults(func=cmd_run)

    sw = sub.add_parser("sweep", help="run a preset's cases; junit XML, JSON, markdown")
    sw.add_argument(
        "--preset",
        default="smoke",
        help="smoke | topology | nightly | pipeline | dsv3-ep8 | engine-vllm | engine-sglang | "
        "engine-lmdeploy (moe-verify engines --run's checks)",
    )
    sw.add_argument("--out", default="moe-verify-out", help="directory for the summaries")
    containment = sw.add_mutually_exclusive_group()
    containment.add_argument(
        "--isolate",
        action="store_true",
        help="cases in contained worker processes (--jobs of them), so a crash, an exit or a "
        "hang ends that case only (the default)",
    )
    containment.add_argument(
        "--in-process",
        action="store_true",
        help="every case in this process: faster to start, but a segfault or an illegal memory "
        "access ends the whole sweep",
    )
    from moe_verify.sweep.pool import CPU_JOBS, GIB_PER_WORKER, GPU_JOBS, jobs_arg

    sw.add_argument(
        "--jobs",
        type=jobs_arg,
        default=None,
        metavar="N",
        help="N contained workers run cases at once, sharing the GPUs (pinned round robin when "
        "there are several) and the JIT caches; a case waits while its memory estimate does not "
        f"fit beside those running. Default with GPUs: one per {GIB_PER_WORKER} GiB of each GPU's "
        f"memory, at most {GPU_JOBS} per GPU (an H200 gets 8; while one worker compiles or runs "
        "the golden, the others keep the GPU busy), at least one per GPU, at most one per two "
        f"cores; without: one per core up to {CPU_JOBS} (the Triton interpreter is CPU-bound); 1 "
        "with --in-process",
    )
    sw.add_argument("--filter", default=None, help="only cases whose id contains this text")
    sw.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="run the I-th of N interleaved shards of the cases (CI splits a preset over jobs)",
    )
    sw.add_argument(
        "--list",
        action="store_true",
        help="print the cases (id and the edge each exercises), their count and distinct GEMM "
        "shapes, and exit without running",
    )
    add_case_timeout_arg(sw)
    add_plot_arg(sw)
    add_backend_args(sw)
    sw.set_defaults(func=cmd_sweep)

    rp = sub.add_parser("replay", help="re-run a dumped failing case on its dumped inputs")
    rp.add_argument("dump", help="the dump directory (--dump-dir) or one case directory in it")
    rp.add_argument(
        "--backend",
        default=None,
        help="default: the backend the dump recorded (with its workspace and poison options)",
    )
    rp.add_argument(
        "--engine",
        default=None,
        choices=[e.value for e in Engine],
        help="default: the engine the dump recorded",
    )
    rp.add_argument(
        "--mode", default=None, choices=MODE_CHOICES, help="default: the mode the dump recorded"
    )
    rp.add_argument("--verbose", "-v", action="store_true", help="every check of every stage")
    rp.set_defaults(func=cmd_replay)

    cal = sub.add_parser("calibrate", help="measure the noise floor per stage and recipe")
    cal.add_argument("--seeds", type=int, default=5)
    cal.add_argument("--out", default=None, help="write the markdown table here")
    cal.add_argument(
        "--preset",
        default=None,
        help="calibrate on a preset's cases (e.g. nightly on the GPU) instead of the "
        "built-in CPU-sized calibration list",
    )
    add_case_timeout_arg(cal)
    add_backend_args(cal, modes=False)
    cal.set_defaults(func=cmd_calibrate)

    bn = sub.add_parser("bench", help="time each optimized stage against same-run ceilings")
    add_problem_args(bn)
    bn.add_argument("--engines", default="triton,deepgemm", help="GEMM engines to time")
    bn.add_argument("--repeats", type=int, default=20)
    bn.add_argument("--out", default=None, help="append the markdown table to this file")
    bn.add_argument(
        "--compare-cost",
        action="store_true",
        help="also time the suite's comparisons of rank 0 on the golden's device vs the host",
    )
    bn.add_argument(
        "--production",
        action="store_true",
        help="time production mode instead: each stage and the whole forward graph-replayed "
        "(no validation) beside DeepGEMM alone on the same operands and the byte floor at the "
        "same-run copy bandwidth, with the launch count; verification mode's times apart",
    )
    bn.add_argument(
        "--decode",
        action="store_true",
        help="with --production: also the decode sizes T = 1, 8, 32, 128 (latency, the two "
        "GEMMs alone, launches, per-stage latency)",
    )
    bn.add_argument("--rank", type=int, default=None, help="with --production: the rank (0)")
    bn.add_argument(
        "--backend",
        default=None,
        help="with --production: the backend whose stage methods the op runs (optimized | vllm "
        "| module:Class, the class `run --backend` takes; default optimized)",
    )
    bn.add_argument(
        "--engine",
        default=None,
        choices=[e.value for e in Engine],
        help="with --production: the GEMM engine (default auto; deepgemm puts DeepGEMM under "
        "the GEMM stages, so they compare with it alone)",
    )
    bn.set_defaults(func=cmd_bench)

    gr = sub.add_parser(
        "graph",
        help="replay the op's CUDA graph under new routings, vs the golden",
    )
    add_problem_args(gr)
    gr.add_argument(
        "--bound", type=int, default=None, help="token bound of the capture (default: --tokens)"
    )
    gr.add_argument(
        "--engine",
        default=Engine.AUTO.value,
        choices=[e.value for e in Engine],
        help="GEMM engine of the production forward",
    )
    gr.add_argument(
        "--backend",
        default="optimized",
        help="the backend whose stage methods the op runs graph-safe: optimized | vllm | "
        "module:Class (the class `run --backend` takes: optimized.OptimizedBackend or a subclass)",
    )
    # Gone with ProductionForward: a clear error, not argparse's "unrecognized arguments".
    gr.add_argument("--forward", default=None, help=argparse.SUPPRESS)
    gr.add_argument(
        "--replays",
        default=None,
        help="comma-separated replay names to run after the capture's (default: all; "
        "moe_verify/production/graph.py default_replays lists them)",
    )
    gr.add_argument(
        "--no-capture",
        action="store_true",
        help="call the op eagerly on the static buffers even on a GPU (what a CPU does)",
    )
    gr.add_argument("--json", help="write the per-replay report as JSON here")
    gr.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="every check of every rank of every replay, with the limits' reasons (as run -v)",
    )
    gr.add_argument(
        "--in-process",
        action="store_true",
        help="run in this process: faster to start, but a segfault or an illegal memory access "
        "in a kernel ends the command (default: a child process, whose crash is reported with "
        "the replay, rank and stage in flight)",
    )
    add_case_timeout_arg(gr)
    gr.set_defaults(func=cmd_graph)

    au = sub.add_parser(
        "audit-e8m0",
        help="what E8M0 scales cost an FP8 block-scaled checkpoint",
    )
    au.add_argument("checkpoint", help="a directory of *.safetensors (with config.json) or a file")
    au.add_argument("--out", default="audit-e8m0-out", help="directory for report.md/.json, plots")
    au.add_argument(
        "--experts-per-layer",
        type=int,
        default=4,
        help="experts per layer whose GEMMs are measured (non-expert weights always are)",
    )
    au.add_argument("--tokens", type=int, default=64, help="synthetic activation rows per GEMM")
    au.add_argument("--seed", type=int, default=0)
    au.add_argument("--device", default=None, help="default: the GPU when there is one")
    au.add_argument(
        "--activations",
        default=None,
        metavar="PATH",
        help="activation dumps (a .safetensors file or a directory of them, one [T, K] input per "
        "linear layer) used in place of the synthetic probes; docs/audit-e8m0.md gives the naming",
    )
    au.add_argument(
        "--max-ratio",
        type=float,
        default=None,
        help="at-risk when requantizing the weights multiplies E8M0's compounded output error "
        "by more than this (default 1.25, moe_verify/audit/measure.py says why)",
    )
    au.set_defaults(func=cmd_audit_e8m0)

    doc = sub.add_parser("doctor", help="what this machine can run (GPU, DeepGEMM, adapters)")
    doc.add_argument(
        "--first-call", action="store_true", help="also run one DeepGEMM GEMM in a subprocess"
    )
    doc.set_defaults(func=cmd_doctor)

    from moe_verify.engines.command import add_arguments, cmd_engines

    eng = sub.add_parser("engines", help="engine release windows; --run checks each release")
    add_arguments(eng)
    eng.set_defaults(func=cmd_engines)

    from moe_verify.findings.commands import add_parsers

    add_parsers(sub)  # findings, repro
    for command in sub.choices.values():
        show_defaults(command)
    return parser


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Each flag's default in its help ("default: both"), where it has one worth showing and
    its help does not already say it."""
    for action in parser._actions:
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS, [], ()):
            continue
        if action.help is argparse.SUPPRESS or "default" in (action.help or ""):
            continue
        shown = "default: %(default)s"
        action.help = f"{action.help} ({shown})" if action.help else shown


def main(argv: list[str] | None = None) -> int:
    """The exit code of `moe-verify argv`. Every exception becomes one line on stderr (with the
    traceback under -v or MOE_VERIFY_DEBUG=1) and exit 2, never 1, which only a failed check
    earns: a backend's sys.exit() or KeyboardInterrupt included. The user's Ctrl-C exits 130 and
    SIGTERM 143, as shells report those signals; argparse's own errors exit 2."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]  # `moe-verify` alone runs the small default case
    args = parser.parse_args(argv)
    args.argv = argv  # `run --sanitize` passes the run's own flags on to its child
    debug = getattr(args, "verbose", False) or os.environ.get("MOE_VERIFY_DEBUG") == "1"
    # Inside the watchers: whose interrupt or exit it was is known only while they are active.
    with watch_interrupts(), terminate_as_exit():
        try:
            return int(args.func(args))
        except KeyboardInterrupt as exc:
            if user_interrupted():
                print("moe-verify: interrupted", file=sys.stderr)
                return EXIT_INTERRUPTED
            return _error(exc, debug)
        except SystemExit as exc:
            if terminated():
                print("moe-verify: terminated", file=sys.stderr)
                return EXIT_TERMINATED
            return _error(exc, debug)
        except BaseException as exc:  # noqa: BLE001 - a crash of any kind is an error, exit 2
            return _error(exc, debug)


def _error(exc: BaseException, debug: bool) -> int:
    """One stderr line for `exc` (after its traceback when debugging); EXIT_ERROR."""
    if debug:
        traceback.print_exception(exc)
    hint = ""
    if isinstance(exc, SystemExit):
        text = f"sys.exit({exc.code!r}) during the run (a backend must not exit the process)"
    elif isinstance(exc, KeyboardInterrupt):
        text = "KeyboardInterrupt raised during the run, not by Ctrl-C (a backend raised it)"
    elif type(exc) is ValueError and not getattr(exc, "__notes__", None):
        # bad input: its message names the argument and the value (a backend's own ValueError,
        # noted with where it was raised, keeps its type as any other exception does)
        text = str(exc)
    else:  # 'KeyError: 3' means nothing without its type
        text = f"{type(exc).__name__}: {exc}"
        hint = "" if debug else " (-v or MOE_VERIFY_DEBUG=1 shows the traceback)"
    # where it was raised, when the run knows it (graph: the replay, rank and stage)
    text += "".join(f"; {note}" for note in getattr(exc, "__notes__", ())) + hint
    print(f"moe-verify: error: {text}", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
