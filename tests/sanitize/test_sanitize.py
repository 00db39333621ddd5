"""`moe-verify run --sanitize`: finding compute-sanitizer, its command line and environment,
reading each tool's report, the stage an error belongs to, timeouts and exit codes.

A stand-in `compute-sanitizer` (a Python script this file writes) plays a scenario: it records
how it was called, writes breadcrumbs as the runner would, prints canned sanitizer text in the
formats NVIDIA's Compute Sanitizer guide shows, and runs or skips the child command. The texts
below are the guide's shapes with our kernels' names in them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest

from moe_verify.run.protect import SANITIZER_TOOL_ENV
from moe_verify.sanitize import run as sanitize
from moe_verify.sanitize.output import SanitizerError, parse_output
from moe_verify.sanitize.report import Crumb, attribute
from moe_verify.sanitize.run import (
    SanitizerUnavailable,
    child_flags,
    find_sanitizer,
    require_gpu,
    run_sanitized,
    sanitize_run,
)
from moe_verify.spec import MoEProblem
from reference.hardware.tensor_core import FUSED_ENV

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = MoEProblem(tokens=8, hidden=128, intermediate=128, num_experts=4, topk=2)
FLAGS = ["-T", "8", "-H", "128", "-I", "128", "-E", "4", "-k", "2"]

# -- canned compute-sanitizer output -------------------------------------------------------------

# memcheck (2022.x and later): a Triton kernel with line info, one byte past a 64-byte tensor,
# then the API error the dead context gives the next synchronize.
MEMCHECK = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at _scatter_kernel+0x1d0 in /work/main/optimized/kernels/scatter.py:262
=========     by thread (3,0,0) in block (1,0,0)
=========     Address 0x7f3a1e000040 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f3a1e000000 of size 64 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2f2a47] in /lib/x86_64-linux-gnu/libcuda.so.1
=========         Host Frame: _launch in __triton_launcher.so
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on \
CUDA API call to cudaStreamSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: [0x4b9b35] in /lib/x86_64-linux-gnu/libcuda.so.1
=========
========= ERROR SUMMARY: 2 errors
"""
# memcheck, older releases' "at 0xPC in file:line:function" form, in DeepGEMM's GEMM; the API
# error comes first, so the first kernel error must still be the one reported.
MEMCHECK_OLD_DEEPGEMM = """\
========= COMPUTE-SANITIZER
========= Program hit cudaErrorIllegalAddress (error 700) due to "an illegal memory access was \
encountered" on CUDA API call to cudaLaunchKernel.
=========
========= Invalid __global__ read of size 16 bytes
=========     at 0x00001a30 in /opt/deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh:212:\
void deep_gemm::sm90_fp8_gemm_1d2d_impl<(unsigned int)0, (unsigned int)4096>(float *, int *, \
unsigned int)
=========     by thread (128,0,0) in block (3,0,0)
=========     Address 0x7f10c0200000 is out of bounds
=========
========= ERROR SUMMARY: 1,234 errors
========= ERROR SUMMARY: 1,214 errors were not printed. Use --print-limit option to adjust the \
number of printed errors
"""
# racecheck, analysis mode (the default report).
RACECHECK = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at _racy_kernel+0x90 in /x/racy.py:13
=========     and Read access at _racy_kernel+0xb0 in /x/racy.py:14 [248 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""
# racecheck, --racecheck-report hazard: one hazard with both threads, in our grouped GEMM.
RACECHECK_HAZARD = """\
========= COMPUTE-SANITIZER
========= Error: Potential WAW hazard detected at __shared__ 0x0 in block (2,0,0) :
=========     Write Thread (31,0,0) at _grouped_gemm_kernel+0x170 in /x/grouped_gemm.py:300
=========     Write Thread (0,0,0) at _grouped_gemm_kernel+0x170 in /x/grouped_gemm.py:300
=========     Current Value : 0, Incoming Value : 31
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""
INITCHECK = """\
========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at _ep_gather_kernel+0x2b0 in /work/main/optimized/kernels/gather.py:61
=========     by thread (64,0,0) in block (2,0,0)
=========     Address 0x7f55a8e00100
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2f2a47] in /lib/x86_64-linux-gnu/libcuda.so.1
=========
========= ERROR SUMMARY: 48 errors
"""
SYNCCHECK = """\
========= COMPUTE-SANITIZER
========= Barrier error detected. Divergent thread(s) in warp
=========     at _silu_mul_quant_kernel+0x4f0 in /work/main/optimized/kernels/act_quant.py:131
=========     by thread (32,0,0) in block (0,0,0)
=========
========= ERROR SUMMARY: 2 errors
"""
CLEAN = """\
========= COMPUTE-SANITIZER
========= ERROR SUMMARY: 0 errors
"""
NO_ATTACH = """\
========= COMPUTE-SANITIZER
========= Error: No attachable process found. compute-sanitizer timed-out.
========= Default timeout can be adjusted with --launch-timeout. Awaiting target completion.
"""


def _lines(text: str) -> list[str]:
    return text.splitlines()


# (text, kind, kernel as named, kernel base, location, thread, block, address start, count)
PARSED = {
    "memcheck-triton": (
        MEMCHECK,
        "Invalid __global__ write of size 4 bytes",
        "_scatter_kernel",
        "_scatter_kernel",
        "/work/main/optimized/kernels/scatter.py:262",
        "(3,0,0)",
        "(1,0,0)",
        "0x7f3a1e000040 is out of bounds",
        2,
    ),
    "memcheck-old-format-deepgemm-after-an-api-error": (
        MEMCHECK_OLD_DEEPGEMM,
        "Invalid __global__ read of size 16 bytes",
        "void deep_gemm::sm90_fp8_gemm_1d2d_impl<(unsigned int)0, (unsigned int)4096>(float *, "
        "int *, unsigned int)",
        "deep_gemm::sm90_fp8_gemm_1d2d_impl",
        "/opt/deep_gemm/include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh:212",
        "(128,0,0)",
        "(3,0,0)",
        "0x7f10c0200000 is out of bounds",
        1234,
    ),
    "racecheck-analysis": (
        RACECHECK,
        "Race reported between Write access and Read access",
        "_racy_kernel",
        "_racy_kernel",
        "/x/racy.py:13",
        None,
        None,
        None,
        1,
    ),
    "racecheck-hazard": (
        RACECHECK_HAZARD,
        "Potential WAW hazard detected",
        "_grouped_gemm_kernel",
        "_grouped_gemm_kernel",
        "/x/grouped_gemm.py:300",
        "(31,0,0)",
        "(2,0,0)",
        "__shared__ 0x0",
        1,
    ),
    "initcheck": (
        INITCHECK,
        "Uninitialized __global__ memory read of size 4 bytes",
        "_ep_gather_kernel",
        "_ep_gather_kernel",
        "/work/main/optimized/kernels/gather.py:61",
        "(64,0,0)",
        "(2,0,0)",
        "0x7f55a8e00100",
        48,
    ),
    "synccheck": (
        SYNCCHECK,
        "Barrier error detected. Divergent thread(s) in warp",
        "_silu_mul_quant_kernel",
        "_silu_mul_quant_kernel",
        "/work/main/optimized/kernels/act_quant.py:131",
        "(32,0,0)",
        "(0,0,0)",
        None,
        2,
    ),
}


@pytest.mark.parametrize("name", list(PARSED))
def test_the_first_error_of_each_tool_is_read(name: str) -> None:
    text, kind, kernel, base, location, thread, block, address, count = PARSED[name]
    out = parse_output(_lines(text))
    first = out.first
    assert first is not None
    assert (first.kind, first.kernel, first.kernel_base, first.location) == (
        kind,
        kernel,
        base,
        location,
    )
    assert (first.thread, first.block) == (thread, block)
    assert first.address == address
    assert out.count == count and out.failure is None
    assert not any("Host Frame" in line for line in first.lines)


def test_a_clean_run_has_no_error_and_a_zero_count() -> None:
    out = parse_output(_lines(CLEAN))
    assert (out.count, out.first, out.summary_count, out.failure) == (0, None, 0, None)


def test_the_child_output_between_sanitizer_lines_is_not_an_error() -> None:
    mixed = ["PASS case [optimized, both] 14 pass", *_lines(SYNCCHECK), "moe-verify: done"]
    out = parse_output(mixed)
    assert len(out.errors) == 1 and out.count == 2


def test_the_sanitizer_failing_to_attach_is_a_failure_not_an_error() -> None:
    out = parse_output(_lines(NO_ATTACH))
    assert out.errors == () and out.failure is not None and "No attachable process" in out.failure


# -- the stage an error belongs to ---------------------------------------------------------------


def _crumb(stage: str, mode: str = "isolated") -> Crumb:
    return Crumb(PROBLEM.id, 0, stage, mode)


def _first(text: str) -> SanitizerError:
    first = parse_output(_lines(text)).first
    assert first is not None
    return first


# (canned output, breadcrumb stage or None, expected stage); the comment names the rule.
ATTRIBUTION = {
    # the breadcrumb picks among the grouped GEMM's stages
    "gemm-kernel-crumb-gemm2": (RACECHECK_HAZARD, "gemm2", "gemm2"),
    "deepgemm-crumb-gemm1": (MEMCHECK_OLD_DEEPGEMM, "gemm1", "gemm1"),
    # a kernel of one stage overrides a breadcrumb that disagrees
    "scatter-kernel-crumb-align": (MEMCHECK, "align", "permute"),
    # not our kernel: the breadcrumb says where
    "unknown-kernel-crumb-act_quant": (RACECHECK, "act_quant", "act_quant"),
    # a kernel of one stage needs no breadcrumb
    "gather-kernel-no-crumb": (INITCHECK, None, "gather"),
    # the grouped GEMM without a breadcrumb: no single stage
    "gemm-kernel-no-crumb": (RACECHECK_HAZARD, None, None),
}


@pytest.mark.parametrize("name", list(ATTRIBUTION))
def test_the_error_is_mapped_to_its_stage(name: str) -> None:
    text, crumb_stage, expected = ATTRIBUTION[name]
    where = attribute(_first(text), _crumb(crumb_stage) if crumb_stage else None)
    assert where.stage == expected, where
    if expected is None:
        assert "gemm1 or gemm2" in where.how


# -- finding the sanitizer -----------------------------------------------------------------------


def _executable(folder: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "compute-sanitizer"
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_cuda_home_comes_first(tmp_path: Path) -> None:
    home = _executable(tmp_path / "home" / "bin")
    default = _executable(tmp_path / "default" / "bin")
    on_path = _executable(tmp_path / "path")
    env = {"CUDA_HOME": str(tmp_path / "home"), "PATH": str(on_path.parent)}
    assert find_sanitizer(env, default.parents[1]) == home


def test_the_default_cuda_root_comes_before_path(tmp_path: Path) -> None:
    default = _executable(tmp_path / "default" / "bin")
    on_path = _executable(tmp_path / "path")
    env = {"CUDA_HOME": str(tmp_path / "empty"), "PATH": str(on_path.parent)}
    assert find_sanitizer(env, default.parents[1]) == default


def test_path_is_searched_last(tmp_path: Path) -> None:
    on_path = _executable(tmp_path / "path")
    assert find_sanitizer({"PATH": str(on_path.parent)}, tmp_path / "none") == on_path


def test_a_missing_sanitizer_names_every_place_looked(tmp_path: Path) -> None:
    env = {"CUDA_HOME": str(tmp_path / "home"), "PATH": str(tmp_path / "path")}
    with pytest.raises(SanitizerUnavailable) as info:
        find_sanitizer(env, tmp_path / "default")
    text = str(info.value)
    for place in ("home/bin/compute-sanitizer", "default/bin/compute-sanitizer", "PATH"):
        assert place in text, text


def test_no_gpu_is_a_clear_error() -> None:
    with pytest.raises(SanitizerUnavailable, match="no CUDA GPU"):
        require_gpu({})


def test_kernels_under_the_triton_interpreter_are_refused() -> None:
    with pytest.raises(SanitizerUnavailable, match="TRITON_INTERPRET"):
        require_gpu({"TRITON_INTERPRET": "1"})


# -- running it under a stand-in sanitizer -------------------------------------------------------

FAKE = """\
#!{python}
import json, os, subprocess, sys, time
scenario = json.load(open(os.environ["FAKE_SANITIZER_SCENARIO"]))
args = sys.argv[1:]
options = {{}}
while args and args[0].startswith("--"):
    options[args[0]] = args[1]
    args = args[2:]
watched = ("PYTORCH_NO_CUDA_MEMORY_CACHING", "MOE_VERIFY_BREADCRUMB", "CUDA_LAUNCH_BLOCKING",
           "MOE_VERIFY_FUSED_TENSOR_CORE", "MOE_VERIFY_SANITIZER_TOOL")
record = {{"argv": sys.argv[1:], "options": options, "child": args, "pid": os.getpid(),
          "env": {{k: os.environ.get(k) for k in watched}}}}
json.dump(record, open(scenario["record"], "w"))
rc = scenario.get("exit", 0)
for step in scenario["steps"]:
    if "crumb" in step:
        open(os.environ["MOE_VERIFY_BREADCRUMB"], "w").write(json.dumps(step["crumb"]))
    elif "print" in step:
        sys.stdout.write(step["print"])
        sys.stdout.flush()
    elif "sleep" in step:
        time.sleep(step["sleep"])
    elif "run_child" in step:
        rc = subprocess.call(args)
sys.exit(rc)
"""


class Fake:
    """The stand-in sanitizer on PATH and the scenario it plays."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "bin"
        _executable(self.dir, FAKE.format(python=sys.executable))
        self.scenario = tmp_path / "scenario.json"
        self.record_path = tmp_path / "record.json"
        env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
        env["PATH"] = f"{self.dir}{os.pathsep}{env.get('PATH', '')}"
        env["FAKE_SANITIZER_SCENARIO"] = str(self.scenario)
        self.env = env
        self.no_cuda = tmp_path / "no-cuda"  # the default root, so a real toolkit stays out

    def play(self, steps: list[dict], exit: int = 0) -> None:
        self.scenario.write_text(
            json.dumps({"record": str(self.record_path), "steps": steps, "exit": exit})
        )

    @property
    def record(self) -> dict:
        return json.loads(self.record_path.read_text())

    def run(self, tool: str = "memcheck", timeout_s: float | None = 60.0, **kw):
        kw.setdefault("baseline", False)
        return sanitize_run(
            kw.pop("argv", FLAGS),
            tool,
            timeout_s,
            env=self.env,
            check_gpu=False,
            default_cuda_home=self.no_cuda,
            cwd=ROOT,
            **kw,
        )


@pytest.fixture
def fake(tmp_path: Path) -> Fake:
    return Fake(tmp_path)


def _crumb_dict(stage: str) -> dict:
    return {"case": PROBLEM.id, "rank": 0, "stage": stage, "mode": "isolated"}


def test_the_command_line_and_environment(fake: Fake) -> None:
    fake.play([{"print": CLEAN}])
    report = fake.run("racecheck", argv=[*FLAGS, "--sanitize", "racecheck", "--mode", "isolated"])
    rec = fake.record
    assert rec["options"]["--tool"] == "racecheck"
    assert rec["options"]["--print-limit"] == str(sanitize.DEFAULT_PRINT_LIMIT)
    assert rec["options"]["--launch-timeout"] == "60"
    assert rec["options"]["--kernel-name-exclude"] == "kns=nvjet"
    assert rec["child"] == [
        sys.executable,
        "-m",
        "moe_verify.cli",
        "run",
        *FLAGS,
        "--mode",
        "isolated",
    ]
    assert rec["env"]["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1"
    assert rec["env"]["CUDA_LAUNCH_BLOCKING"] == "1"
    assert rec["env"]["MOE_VERIFY_BREADCRUMB"]
    assert rec["env"][FUSED_ENV] == "0", "the golden's tensor-core model is compiled under it"
    assert rec["env"][SANITIZER_TOOL_ENV] == "racecheck"
    assert report.command[-len(rec["child"]) :] == rec["child"]


@pytest.mark.parametrize(
    ("argv", "kept"),
    [
        (["-T", "8", "--sanitize", "memcheck", "-v"], ["-T", "8", "-v"]),
        (["--sanitize=initcheck", "-T", "8"], ["-T", "8"]),
        (["-T", "8"], ["-T", "8"]),
    ],
    ids=["spaced", "equals", "absent"],
)
def test_sanitize_is_dropped_from_the_child_flags(argv: list[str], kept: list[str]) -> None:
    assert child_flags(argv) == kept


def test_the_timing_run_leaves_the_output_files_to_the_sanitized_one() -> None:
    argv = ["-T", "8", "--json", "a.json", "--dump-dir=d", "--plot", "p", "--markdown", "m.md"]
    assert child_flags(argv, sanitize.OUTPUT_FLAGS) == ["-T", "8"]


def test_the_breadcrumb_when_the_error_came_names_the_stage(fake: Fake) -> None:
    # act_quant is in flight when the race is printed; the run then goes on to gather, so the
    # breadcrumb left at the end would blame the wrong stage.
    fake.play(
        [
            {"crumb": _crumb_dict("act_quant")},
            {"print": RACECHECK.split("=========\n")[0]},
            {"sleep": 1.0},
            {"crumb": _crumb_dict("gather")},
            {"print": "=========\n" + RACECHECK.split("=========\n")[-1]},
        ]
    )
    report = fake.run("racecheck")
    assert report.where.stage == "act_quant", report.to_summary()
    assert report.case == PROBLEM.id and report.where.side == "isolated"
    assert report.errors == 1 and report.exit_code == 1


def test_an_error_with_no_breadcrumb_yet_names_the_case_from_the_flags(fake: Fake) -> None:
    fake.play([{"print": INITCHECK}])
    report = fake.run("initcheck")
    assert report.case == PROBLEM.id and report.where.stage == "gather"


def test_the_summary_names_kernel_stage_case_thread_and_address(fake: Fake) -> None:
    fake.play([{"crumb": _crumb_dict("permute")}, {"print": MEMCHECK}], exit=2)
    text = fake.run().to_summary()
    for part in (
        "memcheck: 2 errors",
        PROBLEM.id,
        "Invalid __global__ write of size 4 bytes",
        "kernel _scatter_kernel",
        "scatter.py:262",
        "stage permute",
        "thread (3,0,0) in block (1,0,0)",
        "0x7f3a1e000040 is out of bounds",
        "The run itself: exit 2",
        "Exit 1.",
    ):
        assert part in text, (part, text)


# (canned output, the child's exit, expected exit code); the comment names the rule.
EXITS = {
    "clean-and-passed": (CLEAN, 0, 0),
    "clean-but-a-check-failed": (CLEAN, 1, 1),
    "clean-but-the-run-crashed": (CLEAN, 2, 2),
    "errors-and-the-run-passed": (INITCHECK, 0, 1),  # the sanitizer's verdict stands
    "errors-and-the-run-crashed": (MEMCHECK, 2, 1),  # the crash is explained: exit 1
    "the-sanitizer-could-not-attach": (NO_ATTACH, 0, 2),
    "no-summary-printed": ("========= COMPUTE-SANITIZER\n", 0, 2),
}


@pytest.mark.parametrize("name", list(EXITS))
def test_exit_codes(name: str, fake: Fake) -> None:
    text, child_rc, expected = EXITS[name]
    fake.play([{"print": text}], exit=child_rc)
    report = fake.run()
    assert report.child_rc == child_rc
    assert report.exit_code == expected, report.to_summary()


def test_a_hung_run_is_killed_at_the_timeout(fake: Fake) -> None:
    fake.play([{"crumb": _crumb_dict("gemm1")}, {"sleep": 60}, {"print": CLEAN}])
    start = time.perf_counter()
    report = fake.run(timeout_s=1.5)
    assert time.perf_counter() - start < 15
    assert report.timed_out and report.exit_code == 2
    with pytest.raises(ProcessLookupError):
        os.kill(fake.record["pid"], 0)
    assert "timeout" in report.to_summary()


def test_an_error_before_the_timeout_is_still_reported(fake: Fake) -> None:
    fake.play(
        [
            {"crumb": _crumb_dict("gemm1")},
            {"print": RACECHECK_HAZARD.split("=========\n")[0]},
            {"sleep": 60},
        ]
    )
    report = fake.run("racecheck", timeout_s=1.5)
    assert report.timed_out and report.errors == 1 and report.exit_code == 1
    assert report.where.stage == "gemm1"


def test_a_real_child_runs_under_it_and_leaves_its_breadcrumb(fake: Fake) -> None:
    fake.play([{"run_child": True}, {"print": CLEAN}])
    report = fake.run(argv=[*FLAGS, "--backend", "golden", "--mode", "isolated"])
    assert report.child_rc == 0, report.child_output[-20:]
    assert report.verdict is not None and report.verdict.startswith(f"PASS {PROBLEM.id}")
    # the runner wrote its breadcrumb where the sanitizer's child was told to: the last stage
    assert report.crumb == Crumb(PROBLEM.id, 0, "gather", "isolated")
    assert report.exit_code == 0


def test_the_same_case_without_the_sanitizer_measures_the_slowdown(fake: Fake) -> None:
    fake.play([{"sleep": 0.5}, {"print": CLEAN}])
    report = fake.run(argv=[*FLAGS, "--backend", "golden", "--mode", "isolated"], baseline=True)
    assert report.baseline_rc == 0 and report.baseline_s is not None and report.baseline_s > 0
    assert report.slowdown == pytest.approx(report.wall_s / report.baseline_s)
    assert "x slower" in report.to_summary() and f"{report.baseline_s:.1f} s" in report.to_summary()


def test_a_run_stopped_by_its_fault_gives_no_slowdown(fake: Fake) -> None:
    """Seen on the H200: the sanitized run ended at the planted fault (exit 2) and the clean one
    ran to exit 0, so a ratio of the two ("0.9x slower") would compare different work."""
    fake.play([{"sleep": 0.2}, {"print": CLEAN}])
    clean = fake.run(argv=[*FLAGS, "--backend", "golden", "--mode", "isolated"], baseline=True)
    stopped = dataclasses.replace(clean, child_rc=2)
    summary = stopped.to_summary()
    assert "ended at the fault" in summary and "x slower" not in summary, summary
    assert f"{clean.baseline_s:.1f} s" in summary and "exit 0" in summary


def test_sanitize_run_without_a_gpu_says_so(fake: Fake) -> None:
    fake.play([{"print": CLEAN}])
    with pytest.raises(SanitizerUnavailable, match="GPU|TRITON_INTERPRET"):
        sanitize_run(FLAGS, "memcheck", 10, env=fake.env, default_cuda_home=fake.no_cuda)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda f: f.run("valgrind"), "memcheck, racecheck, initcheck, synccheck"),
        (lambda f: f.run(argv=["--tokens", "many"]), "--tokens"),
        (lambda f: f.run(print_limit=0), "print_limit"),
        (lambda f: run_sanitized("memcheck", FLAGS, 10, launcher="torchrun"), "--launcher"),
    ],
    ids=["unknown-tool", "bad-flag", "print-limit", "torchrun"],
)
def test_bad_input_is_a_value_error_naming_it(call, words: str, fake: Fake) -> None:
    fake.play([{"print": CLEAN}])
    with pytest.raises(ValueError, match=words):
        call(fake)
