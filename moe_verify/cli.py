"""`moe-verify`: run one case, sweep a preset, calibrate tolerances, replay a dump, check DeepGEMM.

Exit codes: 0 every check passed, 1 a check failed, 2 an error (bad arguments, crash, missing
dependency).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_verify.args import (
    EXIT_ERROR,
    EXIT_FAIL,
    EXIT_PASS,
    add_backend_args,
    add_problem_args,
    add_run_args,
    problem_from_args,
)
from moe_verify.spec import Engine


def cmd_run(args: argparse.Namespace) -> int:
    if args.launcher == "torchrun":
        from moe_verify.distributed.launch import launch_from_args

        return launch_from_args(args)
    if args.nproc is not None:
        raise ValueError("--nproc needs --launcher torchrun")
    from moe_verify.verification import verify

    problem = problem_from_args(args)
    report = verify(
        problem,
        backend=args.backend,
        mode=args.mode,
        engine=args.engine,
        dump_dir=Path(args.dump_dir) if args.dump_dir else None,
        compare_device="cpu" if args.compare_on == "cpu" else None,
    )
    print(report.to_table() if args.verbose else report.to_summary())
    if args.json:
        Path(args.json).write_text(report.to_json())
    if args.markdown:
        Path(args.markdown).write_text(report.to_markdown())
    ok = report.passed_strict if args.strict else report.passed
    return EXIT_PASS if ok else EXIT_FAIL


def cmd_sweep(args: argparse.Namespace) -> int:
    from moe_verify.sweep import sweep

    summary = sweep(
        args.preset,
        backend=args.backend,
        mode=args.mode,
        engine=args.engine,
        out_dir=Path(args.out),
        isolate=args.isolate,
        filter_text=args.filter,
    )
    return EXIT_PASS if summary.passed else EXIT_FAIL


def cmd_replay(args: argparse.Namespace) -> int:
    from moe_verify.verification import replay

    report = replay(Path(args.dump), backend=args.backend, engine=args.engine, mode=args.mode)
    print(report.to_summary())
    return EXIT_PASS if report.passed else EXIT_FAIL


def cmd_calibrate(args: argparse.Namespace) -> int:
    from moe_verify.calibrate import calibrate

    cases = None
    if args.preset:
        from moe_verify.cases import preset

        cases = preset(args.preset)
    result = calibrate(
        seeds=args.seeds,
        out=Path(args.out) if args.out else None,
        cases=cases,
        backend=args.backend,
        engine=args.engine,
    )
    print(result.to_markdown())
    return EXIT_PASS


def cmd_bench(args: argparse.Namespace) -> int:
    from moe_verify.bench import bench, compare_cost, to_markdown

    problem = problem_from_args(args)
    engines = tuple(Engine(e) for e in args.engines.split(",") if e)
    timings = bench(problem, engines=engines, repeats=args.repeats)
    costs = compare_cost(problem) if args.compare_cost else None
    text = to_markdown(problem, timings, costs)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return EXIT_PASS


def cmd_audit_e8m0(args: argparse.Namespace) -> int:
    from moe_verify.audit import DEFAULT_MAX_RATIO, audit, write_report

    report = audit(
        args.checkpoint,
        experts_per_layer=args.experts_per_layer,
        tokens=args.tokens,
        seed=args.seed,
        device=args.device,
        max_ratio=DEFAULT_MAX_RATIO if args.max_ratio is None else args.max_ratio,
    )
    files = write_report(report, Path(args.out))
    print(f"verdict {report.verdict}: {report.reason}")
    print("wrote " + ", ".join(str(f) for f in files))
    return EXIT_FAIL if report.verdict == "at-risk" else EXIT_PASS


def cmd_doctor(args: argparse.Namespace) -> int:
    """What this machine can run: torch, triton mode, GPU arch, DeepGEMM and its first call."""
    import torch

    from optimized import deepgemm

    info: dict[str, object] = {
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    status = deepgemm.probe()
    info["deep_gemm"] = {
        "usable": status.usable,
        "version": status.version,
        "reason": status.reason,
    }
    if status.usable and args.first_call:
        ok, why = deepgemm.probe_first_call()
        info["deep_gemm_first_call"] = {"ok": ok, "detail": why}
    print(json.dumps(info, indent=2))
    return EXIT_PASS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-verify", description=__doc__)
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", help="verify one case stage by stage (the default command)")
    add_run_args(run)
    run.set_defaults(func=cmd_run)

    sw = sub.add_parser("sweep", help="run a preset case list; junit XML, JSON, markdown")
    sw.add_argument("--preset", default="smoke", help="smoke | nightly")
    sw.add_argument("--out", default="moe-verify-out", help="directory for the summaries")
    sw.add_argument(
        "--isolate",
        action="store_true",
        help="run each case in a subprocess (a crash/IMA takes down one case only)",
    )
    sw.add_argument("--filter", default=None, help="only cases whose id contains this text")
    add_backend_args(sw)
    sw.set_defaults(func=cmd_sweep)

    rp = sub.add_parser("replay", help="re-run a dumped failing case")
    rp.add_argument("dump")
    add_backend_args(rp)
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
    bn.set_defaults(func=cmd_bench)

    au = sub.add_parser(
        "audit-e8m0",
        help="what E8M0 (power-of-two) scales cost a checkpoint's FP8 block-scaled weights",
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
        "--max-ratio",
        type=float,
        default=None,
        help="at-risk when requantizing the weights multiplies E8M0's compounded output error "
        "by more than this (default 1.25, moe_verify/audit/measure.py says why)",
    )
    au.set_defaults(func=cmd_audit_e8m0)

    doc = sub.add_parser("doctor", help="what this machine can run")
    doc.add_argument(
        "--first-call", action="store_true", help="also run one DeepGEMM GEMM in a subprocess"
    )
    doc.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv = ["run", *argv]  # `moe-verify` alone runs the small default case
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError) as exc:  # bad input, or the golden itself failing
        print(f"moe-verify: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
