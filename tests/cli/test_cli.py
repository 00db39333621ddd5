"""The CLI front door: the default run, every exit code (0 passed, 1 a check failed, 2 anything
else, 130 Ctrl-C), output paths checked before any work, --help, and the flags reaching verify."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moe_verify.cli import build_parser, main
from moe_verify.run import verify as verification
from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem, StageContext, StageSkipped
from optimized import deepgemm
from optimized.backend import OptimizedBackend
from tolerance.compare import StageResult, compare
from tolerance.report import Report

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]
TINY = ["-T", "4", "-H", "128", "-I", "128", "-E", "4", "-k", "2", "--alignment", "32"]
TINY_PROBLEM = MoEProblem(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2)


def test_default_run_prints_a_stage_table_and_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process: `moe-verify` alone runs as a user's process in tests/cli/test_readme.py."""
    out = tmp_path / "r.json"
    code = main(["-T", "8", "--json", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert "verdict PASS" in stdout and "gemm1 [triton]" in stdout
    report = json.loads(out.read_text())
    assert report["passed"] and report["first_failure"] is None
    assert out.read_text().endswith("}\n")  # a text file's last line ends, as doctor's output


def test_bad_argument_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--hidden", "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-verify: error: ") and "hidden" in err and "100" in err


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("-T", "-T/--tokens"),  # used to run every stage on empty tensors and PASS
        ("-E", "-E/--num-experts"),
        ("-k", "-k/--topk"),
        ("-H", "-H/--hidden"),
        ("-I", "-I/--intermediate"),
    ],
)
@pytest.mark.parametrize("command", ["run", "graph"])
def test_an_empty_problem_is_refused_naming_the_flag(
    command: str, flag: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, *TINY, flag, "0"]) == 2
    out, err = capsys.readouterr()
    assert err == f"moe-verify: error: {named}: expected an int in [1, " + err.split("[1, ")[1]
    assert "got 0 (an empty problem: nothing to verify)" in err and not out


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--router-weight", "input", "--no-renormalize"], "got topk=2"),  # TINY is top-2
        (["--router-weight", "input", "-k", "1"], "renormalization off (--no-renormalize)"),
    ],
    ids=["top2", "weights-all-one"],
)
def test_the_weight_on_the_input_is_refused_naming_the_flags(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-verify: error: --router-weight: 'input'") and named in err


def test_an_empty_problem_is_refused_from_python() -> None:
    with pytest.raises(ValueError, match=r"MoEProblem\.tokens: .* got 0 \(an empty problem"):
        MoEProblem(tokens=0)


@pytest.mark.parametrize(
    "module", ["tolerance", "tolerance.metrics", "reference", "optimized", "moe_verify.cli"]
)
def test_each_package_imports_first_in_a_fresh_interpreter(module: str) -> None:
    """The packages import one another (tolerance <-> moe_verify); none may need another to
    have been imported before it."""
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_compare_on_cpu_reaches_compare_and_torchrun_refuses_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    verify_module = sys.modules["moe_verify.run.verify"]
    devices = []

    def spy(*args, device=None, **kwargs):
        devices.append(device)
        return compare(*args, device=device, **kwargs)

    monkeypatch.setattr(verify_module, "compare", spy)
    assert main(["run", "-T", "8", "-H", "128", "-I", "128", "-E", "4", "--compare-on", "cpu"]) == 0
    assert "verdict PASS" in capsys.readouterr().out
    assert devices == ["cpu", "cpu"]  # isolated and chained
    devices.clear()
    assert main(["run", "-T", "8", "-H", "128", "-I", "128", "-E", "4"]) == 0
    assert devices == [None, None]  # the golden's device
    assert main(["run", "--launcher", "torchrun", "--topology", "ep:2", "--compare-on", "cpu"]) == 2
    assert "--compare-on cpu: not supported with --launcher torchrun" in capsys.readouterr().err


class DeclinesGemm2(OptimizedBackend):
    """A backend that skips a stage it should run."""

    name = "declines-gemm2"

    def gemm2(self, ctx: StageContext):
        raise StageSkipped("not implemented by this backend")


def test_skips_pass_by_default_but_fail_strict() -> None:
    report = verify(
        MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=2, topk=1, alignment=16),
        backend=DeclinesGemm2(engine="triton"),
        mode="both",
    )
    assert report.passed and not report.passed_strict
    assert report.counts("isolated")["skip"] == 1
    assert any(r.stage == "gemm2" and r.status == "skip" for r in report.isolated)


def test_rank_dependent_failure_names_the_rank_and_its_experts() -> None:
    from tests.tester.wrong_backends import ExpertMapIgnoredOnRank1
    from tolerance.report import Report

    problem = MoEProblem(
        tokens=16,
        hidden=128,
        intermediate=128,
        num_experts=6,
        topk=2,
        alignment=32,
        topology="ep:2",
    )
    report = verify(problem, backend=ExpertMapIgnoredOnRank1(engine="triton"), mode="isolated")
    assert report.failed_ranks == [1]
    assert "rank 1 hosts experts [3, 4, 5]" in report.to_table()
    again = Report.from_dict(json.loads(report.to_json()))
    assert again.rank_experts == {0: [0, 1, 2], 1: [3, 4, 5]}


class SharedTwice(OptimizedBackend):
    """The shared experts' output added twice (vLLM runner bug class: shared reduced twice)."""

    name = "shared-twice"

    def shared(self, ctx: StageContext):
        out = super().shared(ctx)["out"]
        return {"out": (out.float() * 2).to(out.dtype), "engine": "triton"}


def test_shared_expert_bug_is_named_at_the_shared_stage() -> None:
    problem = MoEProblem(
        tokens=8,
        hidden=128,
        intermediate=256,
        num_experts=4,
        topk=2,
        alignment=32,
        topology="ep:2",
        shared_experts=1,
    )
    report = verify(problem, backend=SharedTwice(engine="triton"), mode="isolated")
    assert report.first_failure == "shared"
    assert {r.stage for r in report.isolated if r.status == "fail"} == {"shared", "reduce"}


def test_summary_puts_modes_side_by_side_one_line_per_stage() -> None:
    from tests.tester.wrong_backends import SwappedExpertRows

    problem = MoEProblem(
        tokens=16, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32
    )
    text = verify(problem, backend=SwappedExpertRows(engine="triton"), mode="both").to_summary()
    permute = next(line for line in text.splitlines() if line.startswith("permute "))
    assert permute.split()[1:3] == ["fail", "fail"] and "a_perm rows" in permute
    gemm1 = next(line for line in text.splitlines() if line.startswith("gemm1 [triton]"))
    assert gemm1.split()[2:4] == ["pass", "fail"]  # isolated clean, chained inherits the swap


def test_mode_both_says_both_and_counts_each_mode_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong permute fails there alone in isolated mode, and in chained mode every stage after
    it inherits the swap: the header, the verdict line, the JSON and the exit code say both
    modes ran, and count each mode's failures apart (isolated's permute is the culprit)."""
    out = tmp_path / "r.json"
    backend = "moe_verify.examples:SwappedExpertRows"
    argv = ["run", *TINY, "-T", "16", "--mode", "both", "--backend", backend, "--json", str(out)]
    assert main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("  mode both  verdict FAIL  first failure: permute (isolated)")
    verdict = lines[-1]
    assert verdict.startswith("FAIL fp8_block-tp1-T16-H128-I128-E4-k2-softmax-A32 ")
    assert "[swapped_expert_rows, both] first failure: permute [isolated] (a_perm rows" in verdict
    assert "; isolated: 7 pass, 1 fail; chained: 3 pass, 5 fail;" in verdict
    report = json.loads(out.read_text())
    assert report["mode"] == "both" and report["verdict"] == "fail"
    assert (report["first_failure"], report["first_failure_mode"]) == ("permute", "isolated")
    counts = report["counts"]
    assert (counts["isolated"]["fail"], counts["chained"]["fail"]) == (1, 5)
    chained_failing = [r["stage"] for r in report["chained"] if r["status"] == "fail"]
    assert chained_failing == ["permute", "gemm1", "act_quant", "gemm2", "gather"]


def test_python_api_runs_on_a_cpu_without_setup() -> None:
    """README's Python example: no TRITON_INTERPRET set by hand, `verify` is the function."""
    code = (
        "from moe_verify import MoEProblem, verify\n"
        "r = verify(MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=4, topk=2,"
        " alignment=32), mode='both')\n"
        "print(r.passed, r.first_failure)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("True None")


def test_a_backend_module_in_the_current_directory_loads_without_pythonpath(tmp_path: Path) -> None:
    """The README's `--backend module:Class` examples run from the directory holding the module."""
    (tmp_path / "my_kernels.py").write_text(
        "import optimized\n\n\nclass MyKernels(optimized.OptimizedBackend):\n    name = 'mine'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # the project itself, as an installed package would be found
    # -P: no current directory on sys.path, as for the `moe-verify` console script
    cmd = [sys.executable, "-P", "-m", "moe_verify.cli", "run", "--backend", "my_kernels:MyKernels"]
    cmd += ["-T", "8", "-H", "128", "-I", "128", "-E", "4", "--alignment", "32"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "backend mine" in proc.stdout


# -- exit codes ----------------------------------------------------------------------------------


class SkipsEverything(OptimizedBackend):
    """A backend that declines every stage: nothing is verified."""

    name = "skips-everything"

    def route(self, ctx):
        raise StageSkipped("this backend runs nothing")

    quant_input = align = permute = dispatch = gemm1 = act_quant = gemm2 = gather = shared = route


class ExitsInRoute(OptimizedBackend):
    """A backend that ends the process from inside a stage, with the success code."""

    name = "exits-in-route"

    def route(self, ctx: StageContext):
        sys.exit(0)


def test_a_failed_check_exits_1_and_the_dump_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    backend = "tests.tester.wrong_backends:SwappedExpertRows"
    argv = ["run", *TINY, "--mode", "isolated", "--backend", backend, "--dump-dir", str(tmp_path)]
    assert main(argv) == 1
    out = capsys.readouterr().out
    dumped = [line for line in out.splitlines() if line.startswith("dumped to ")]
    assert len(dumped) == 1, out
    where = Path(dumped[0].split()[2])
    assert where.is_dir() and where.is_relative_to(tmp_path) and (where / "problem.json").exists()
    assert out.splitlines()[-2].startswith("FAIL ")  # the summary line, then the dump's line


def test_a_passing_run_with_dump_dir_says_nothing_was_dumped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *TINY, "--mode", "isolated", "--dump-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "nothing dumped: every check passed"
    assert not any(tmp_path.iterdir())


def test_every_stage_skipped_exits_2_with_a_skip_verdict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend = "tests.cli.test_cli:SkipsEverything"
    assert main(["run", *TINY, "--mode", "isolated", "--backend", backend]) == 2
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("SKIP ") and "every tested stage was skipped" in last
    assert "this backend runs nothing" in last


def test_a_skipped_stage_is_named_and_fails_only_strict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["run", *TINY, "--mode", "isolated", "--backend", "tests.cli.test_cli:DeclinesGemm2"]
    assert main(argv) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("PASS ") and "(gemm2 skipped: " in last
    assert "not implemented by this backend" in last
    assert main([*argv, "--strict"]) == 1


def test_a_backend_calling_sys_exit_0_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", *TINY, "--mode", "isolated", "--backend", "tests.cli.test_cli:ExitsInRoute"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "exit" in (captured.out + captured.err).lower()


def test_a_missing_problem_json_is_an_error_not_a_failed_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.json"
    assert main(["run", "--problem-json", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"moe-verify: error: --problem-json {missing}: No such file or directory\n"


@pytest.mark.parametrize(
    "content",
    ['{"tokens": 4}', "[1, 2]", "{not json"],
    ids=["missing-fields", "not-an-object", "not-json"],
)
def test_a_malformed_problem_json_exits_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str
) -> None:
    path = tmp_path / "problem.json"
    path.write_text(content)
    assert main(["run", "--problem-json", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-verify: error: ") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("raised", "shown"),
    [
        (KeyError("tokens"), "KeyError: 'tokens'"),
        (TypeError("bad operand"), "TypeError: bad operand"),
        (OSError(28, "No space left on device"), "No space left on device"),
        (SystemExit(0), "sys.exit(0)"),
        (KeyboardInterrupt(), "KeyboardInterrupt raised during the run, not by Ctrl-C"),
    ],
    ids=["KeyError", "TypeError", "OSError", "SystemExit-0", "KeyboardInterrupt-not-ctrl-c"],
)
def test_any_exception_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    raised: BaseException,
    shown: str,
) -> None:
    def boom(*args, **kwargs):
        raise raised

    monkeypatch.setattr(verification, "verify", boom)
    monkeypatch.delenv("MOE_VERIFY_DEBUG", raising=False)
    assert main(["run", *TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-verify: error: ") and shown in err, err
    assert len(err.strip().splitlines()) == 1
    monkeypatch.setenv("MOE_VERIFY_DEBUG", "1")
    assert main(["run", *TINY]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_ctrl_c_exits_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, as the terminal sends it
        pytest.fail("SIGINT did not interrupt the run")

    monkeypatch.setattr(verification, "verify", interrupted)
    assert main(["run", *TINY]) == 130
    assert capsys.readouterr().err.strip() == "moe-verify: interrupted"


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--tokens", "many"],
        ["run", "--case-timeout", "-1"],
        ["run", "--case-timeout", "inf"],
        ["run", "--case-timeout", "nan"],
        ["run", "--poison", "256"],
        ["run", "--poison", "0x1FF"],
        ["sweep", "--isolate", "--in-process"],
        ["frobnicate"],
    ],
    ids=lambda a: "-".join(a),
)
def test_argparse_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


# -- output paths are checked before any work ----------------------------------------------------


def _file(tmp_path: Path) -> str:
    (tmp_path / "a-file").write_text("")
    return str(tmp_path / "a-file")


# (argv builder, flag): each names a path that cannot be written as the flag needs.
OUTPUT_PATHS = {
    "json-missing-dir": (lambda t: ["run", "--json", str(t / "nowhere" / "r.json")], "--json"),
    "markdown-is-dir": (lambda t: ["run", "--markdown", str(t)], "--markdown"),
    "dump-dir-is-file": (lambda t: ["run", "--dump-dir", _file(t)], "--dump-dir"),
    "plot-is-file": (lambda t: ["run", "--plot", _file(t)], "--plot"),
    "plot-under-file": (lambda t: ["run", "--plot", _file(t) + "/plots"], "--plot"),
    "sweep-out-is-file": (lambda t: ["sweep", "--out", _file(t)], "--out"),
    "audit-out-is-file": (lambda t: ["audit-e8m0", str(t), "--out", _file(t)], "--out"),
    "calibrate-out-is-dir": (lambda t: ["calibrate", "--out", str(t)], "--out"),
    "bench-out-missing-dir": (lambda t: ["bench", "--out", str(t / "no" / "perf.md")], "--out"),
}


@pytest.mark.parametrize("case", list(OUTPUT_PATHS))
def test_an_unwritable_output_path_exits_2_before_any_work(
    case: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import moe_verify.audit
    import moe_verify.calibrate
    import moe_verify.production.bench
    import moe_verify.sweep.sweep

    def no_work(*args, **kwargs):
        pytest.fail("the work started before the output path was checked")

    for module, name in [
        (verification, "verify"),
        (moe_verify.sweep.sweep, "sweep"),
        (moe_verify.audit, "audit"),
        (moe_verify.calibrate, "calibrate"),
        (moe_verify.production.bench, "bench"),
    ]:
        monkeypatch.setattr(module, name, no_work)
    build, flag = OUTPUT_PATHS[case]
    argv = build(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-verify: error: {flag} {argv[argv.index(flag) + 1]}: "), err


# -- help ----------------------------------------------------------------------------------------

COMMANDS = [
    "run", "sweep", "replay", "calibrate", "bench", "graph", "audit-e8m0", "doctor", "engines",
    "findings", "repro",
]  # fmt: skip


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "`moe-verify` alone runs `run` on the small default case" in out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ")]
    assert listed == COMMANDS  # one line each: the command and its help


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_its_own_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: moe-verify {command}")


# -- engines -------------------------------------------------------------------------------------


def test_engine_deepgemm_where_it_cannot_run_exits_2_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    status = deepgemm.probe()
    if status.usable:
        pytest.skip(f"DeepGEMM can run here ({status.reason})")

    def no_work(*args, **kwargs):
        pytest.fail("the run started with an engine that cannot run")

    monkeypatch.setattr(verification, "verify", no_work)
    assert main(["run", *TINY, "--engine", "deepgemm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-verify: error: RuntimeError: --engine deepgemm cannot run here: ")
    assert status.reason in err


# -- flags reach verify, sweep and replay --------------------------------------------------------


def _passing_report() -> Report:
    return Report(TINY_PROBLEM, "stand-in", isolated=[StageResult("route", "pass", [])])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            [],
            {
                "workspace": False,
                "poison": (),
                "case_timeout_s": 900.0,
                "plot_dir": None,
                "padding_poison": False,
            },
        ),
        (["--workspace", "--poison", "0xFF"], {"workspace": True, "poison": (0xFF,)}),
        (["--poison", "255", "--poison", "0"], {"poison": (255, 0)}),
        (["--case-timeout", "0"], {"case_timeout_s": None}),  # no limit
        (["--case-timeout", "2.5"], {"case_timeout_s": 2.5}),
        (["--poison-padding"], {"padding_poison": True}),
    ],
    ids=[
        "defaults",
        "workspace-poison-0xFF",
        "two-poisons",
        "no-timeout",
        "timeout",
        "poison-padding",
    ],
)
def test_run_flags_reach_verify(
    flags: list[str], expected: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: dict = {}

    def stand_in(problem, **kwargs):
        seen.update(kwargs)
        return _passing_report()

    monkeypatch.setattr(verification, "verify", stand_in)
    assert main(["run", *TINY, *flags]) == 0
    assert {k: getattr(seen["options"], k) for k in expected} == expected


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], {"ll_capacity": 0, "tiny_tokens": 0, "router_weight": "gather"}),
        (["--tiny-tokens", "2"], {"tiny_tokens": 2}),
        (["--topology", "ep:2+ll", "--ll-capacity", "256"], {"ll_capacity": 256}),
        (["-k", "1", "--no-renormalize", "--router-weight", "input"], {"router_weight": "input"}),
    ],
    ids=["defaults", "tiny-tokens", "ll-capacity", "router-weight"],
)
def test_run_problem_flags_reach_the_problem(
    flags: list[str], expected: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[MoEProblem] = []

    def stand_in(problem, **kwargs):
        seen.append(problem)
        return _passing_report()

    monkeypatch.setattr(verification, "verify", stand_in)
    assert main(["run", *TINY, *flags]) == 0
    assert {k: getattr(seen[0], k) for k in expected} == expected


def test_plot_dir_reaches_verify_and_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def stand_in(problem, options):
        report = _passing_report()
        report.files["plots"] = [str(options.plot_dir / "gemm1.png")]
        return report

    monkeypatch.setattr(verification, "verify", stand_in)
    assert main(["run", *TINY, "--plot", str(tmp_path / "plots")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"plots in {tmp_path / 'plots'} (1 files)"


@pytest.mark.parametrize(
    ("flags", "isolate"), [([], True), (["--isolate"], True), (["--in-process"], False)]
)
def test_sweep_contains_crashes_unless_in_process(
    flags: list[str], isolate: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import moe_verify.sweep.sweep

    seen: dict = {}

    class Summary:
        exit_code = 1

    def stand_in(preset, **kwargs):
        seen.update(kwargs)
        return Summary()

    monkeypatch.setattr(moe_verify.sweep.sweep, "sweep", stand_in)
    assert main(["sweep", "--out", str(tmp_path), *flags]) == 1  # the summary's exit code
    assert seen["isolate"] is isolate and seen["options"].case_timeout_s == 900.0


def test_replay_defaults_to_what_the_dump_recorded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: dict = {}

    def stand_in(directory, **kwargs):
        seen.update(kwargs, directory=directory)
        return _passing_report()

    monkeypatch.setattr(verification, "replay", stand_in)
    assert main(["replay", str(tmp_path)]) == 0
    assert seen == {"directory": tmp_path, "backend": None, "engine": None, "mode": None}


@pytest.mark.parametrize("flags", [["--poison", "0xFF"], ["--workspace"]], ids=lambda f: f[0])
def test_torchrun_refuses_the_flags_its_ranks_do_not_take(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--launcher", "torchrun", "--topology", "ep:2", *flags]
    assert main(argv) == 2
    assert f"{flags[0]}: not supported with --launcher torchrun" in capsys.readouterr().err


def test_the_parser_has_one_case_timeout_default() -> None:
    from moe_verify.run.contain import DEFAULT_CASE_TIMEOUT_S

    for command in ("run", "sweep", "calibrate"):
        args = build_parser().parse_args([command] + (["x"] if command == "replay" else []))
        assert args.case_timeout == DEFAULT_CASE_TIMEOUT_S
