"""`moe-verify`: run one case, sweep a preset, calibrate tolerances, replay a dump, check DeepGEMM.

Exit codes: 0 every check passed, 1 a check failed, 2 an error (bad arguments, crash, missing
dependency).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_verify.device import prepare_triton

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2


def _add_problem_args(p: argparse.ArgumentParser) -> None:
    from moe_verify.spec import MoEProblem, Recipe, Routing, ScaleFmt

    d = MoEProblem()
    p.add_argument("--tokens", "-T", type=int, default=d.tokens)
    p.add_argument("--hidden", "-H", type=int, default=d.hidden)
    p.add_argument("--intermediate", "-I", type=int, default=d.intermediate)
    p.add_argument("--num-experts", "-E", type=int, default=d.num_experts)
    p.add_argument("--topk", "-k", type=int, default=d.topk)
    p.add_argument("--recipe", choices=[r.value for r in Recipe], default=d.recipe.value)
    p.add_argument(
        "--scale-fmt",
        choices=[f.value for f in ScaleFmt],
        default=None,
        help="default: the recipe's first allowed format",
    )
    p.add_argument(
        "--activation", default="silu", help="silu | silu:L<limit> | swigluoai[:alpha:beta:limit]"
    )
    p.add_argument("--routing", choices=[r.value for r in Routing], default=d.routing.value)
    p.add_argument(
        "--topology", default="tp:1", help="tp:N | ep:N | ep:N:round_robin | ep:N+ht | ep:N+ll"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--alignment", type=int, default=d.alignment)
    p.add_argument("--provenance", action="store_true")
    p.add_argument("--no-renormalize", action="store_true")
    p.add_argument("--routed-scaling-factor", type=float, default=d.routed_scaling_factor)
    p.add_argument("--num-expert-group", type=int, default=d.num_expert_group)
    p.add_argument("--topk-group", type=int, default=d.topk_group)
    p.add_argument(
        "--shared-experts",
        type=int,
        default=d.shared_experts,
        help="DeepSeek-style shared experts added to the routed output",
    )


def problem_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from moe_verify.spec import MoEProblem, Recipe

    recipe = Recipe(args.recipe)
    return MoEProblem(
        tokens=args.tokens,
        hidden=args.hidden,
        intermediate=args.intermediate,
        num_experts=args.num_experts,
        topk=args.topk,
        recipe=recipe,
        scale_fmt=args.scale_fmt or recipe.allowed_scale_fmts[0],
        activation=args.activation,
        routing=args.routing,
        topology=args.topology,
        seed=args.seed,
        alignment=args.alignment,
        provenance=args.provenance,
        renormalize=not args.no_renormalize,
        routed_scaling_factor=args.routed_scaling_factor,
        num_expert_group=args.num_expert_group,
        topk_group=args.topk_group,
        shared_experts=args.shared_experts,
    )


def cmd_run(args: argparse.Namespace) -> int:
    if args.launcher == "torchrun":
        from moe_verify.distributed import launch_from_args

        return launch_from_args(args)
    if args.nproc is not None:
        raise ValueError("--nproc needs --launcher torchrun")
    prepare_triton()
    from moe_verify.verify import verify

    if args.problem_json:
        from moe_verify.spec import MoEProblem

        problem = MoEProblem.from_dict(json.loads(Path(args.problem_json).read_text()))
    else:
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
    prepare_triton()
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
    prepare_triton()
    from moe_verify.dump import replay

    report = replay(Path(args.dump), backend=args.backend, engine=args.engine, mode=args.mode)
    print(report.to_summary())
    return EXIT_PASS if report.passed else EXIT_FAIL


def cmd_calibrate(args: argparse.Namespace) -> int:
    prepare_triton()
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
    prepare_triton()
    from moe_verify.bench import bench, compare_cost, to_markdown

    problem = problem_from_args(args)
    engines = tuple(e for e in args.engines.split(",") if e)
    timings = bench(problem, engines=engines, repeats=args.repeats)
    costs = compare_cost(problem) if args.compare_cost else None
    text = to_markdown(problem, timings, costs)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return EXIT_PASS


def cmd_audit_e8m0(args: argparse.Namespace) -> int:
    from moe_verify.audit import DEFAULT_MAX_RATIO, audit
    from moe_verify.audit_report import write_report

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
    _add_problem_args(run)
    _add_backend_args(run)
    run.add_argument("--json", help="write the report as JSON here")
    run.add_argument("--markdown", help="write the report as markdown here")
    run.add_argument("--dump-dir", help="on failure, dump inputs and both traces here")
    run.add_argument(
        "--strict", action="store_true", help="a skipped stage fails the run too (exit 1)"
    )
    run.add_argument(
        "--verbose", "-v", action="store_true", help="every check of every stage, not a line each"
    )
    run.add_argument(
        "--problem-json",
        help="read the whole problem from this JSON file "
        "(MoEProblem.to_dict); the problem flags are then ignored",
    )
    run.add_argument(
        "--launcher",
        choices=["none", "torchrun"],
        default="none",
        help="none: emulate every rank in this process; torchrun: one process per rank, the real "
        "collective (NCCL on GPUs, gloo on the CPU), see moe_verify/distributed.py",
    )
    run.add_argument(
        "--nproc", type=int, default=None, help="torchrun processes (default and only value: ranks)"
    )
    run.add_argument(
        "--compare-on",
        choices=["golden", "cpu"],
        default="golden",
        help="where stages are compared: the golden's device (a GPU run is compared on the GPU), "
        "or the CPU, which spends no GPU memory on comparisons but copies every stage to the host",
    )
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
    _add_backend_args(sw)
    sw.set_defaults(func=cmd_sweep)

    rp = sub.add_parser("replay", help="re-run a dumped failing case")
    rp.add_argument("dump")
    _add_backend_args(rp)
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
    cal.add_argument("--backend", default="optimized", help="optimized | module:Class")
    cal.add_argument("--engine", default="auto", choices=["auto", "deepgemm", "triton"])
    cal.set_defaults(func=cmd_calibrate)

    bn = sub.add_parser("bench", help="time each optimized stage against same-run ceilings")
    _add_problem_args(bn)
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
        "by more than this (default 1.25, moe_verify/audit.py says why)",
    )
    au.set_defaults(func=cmd_audit_e8m0)

    doc = sub.add_parser("doctor", help="what this machine can run")
    doc.add_argument(
        "--first-call", action="store_true", help="also run one DeepGEMM GEMM in a subprocess"
    )
    doc.set_defaults(func=cmd_doctor)
    return parser


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        default="optimized",
        help="optimized | golden | module:Class (your own Backend)",
    )
    p.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "deepgemm", "triton"],
        help="GEMM engine of the optimized backend",
    )
    p.add_argument("--mode", default="both", choices=["isolated", "chained", "both"])


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
