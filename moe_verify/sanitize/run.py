"""`moe-verify run --sanitize TOOL`: one case under NVIDIA's compute-sanitizer, in a subprocess.

The case runs as `compute-sanitizer --tool TOOL ... python -m moe_verify.cli run <the same flags>`
in a process group of its own (killed whole on timeout), with PyTorch's caching allocator off
(PYTORCH_NO_CUDA_MEMORY_CACHING=1, as DeepGEMM's tests/test_sanitizer.py does: inside a cached 2
MiB segment an out-of-bounds access of a tensor still lands in memory the sanitizer counts as
allocated, so it would pass unseen). The runner's breadcrumb (MOE_VERIFY_BREADCRUMB, written before
each stage) goes to a file of ours, and the sanitizer's output shares one pipe with the child's, so
the crumb can be read the moment the first error line arrives: that is the stage in flight when the
error was found, even for tools whose errors do not stop the run (racecheck, initcheck,
synccheck). The kernel's name cross-checks it: each of our kernels belongs to known stages
(KERNEL_STAGES), and the crumb picks among them (gemm1 or gemm2 for the grouped GEMM). Reading
the output is moe_verify/sanitize/output.py's; the stage and the report, sanitize_report.py's.

The report names the tool, the error count, the first error (kind, kernel, stage, case, thread,
block, address), the child's own exit code and verdict line, and how much slower the sanitized run
was than the same case without the sanitizer (run first, so it pays any JIT compile the caches
lack and the sanitized run measures the sanitizer, not the compiler).

Exit codes: 0 no sanitizer error and the run passed; 1 a sanitizer error, or a failed check; 2 it
could not run (no sanitizer, no GPU, the sanitizer failed, the case timed out or crashed without a
sanitizer error to show for it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from moe_verify.args import SANITIZER_TOOLS as TOOLS
from moe_verify.args import add_run_args, problem_from_args
from moe_verify.run.contain import (
    KILL_GRACE_S,
    Completed,
    kill_group,
    read_until,
    terminate_as_exit,
)
from moe_verify.run.protect import SANITIZER_TOOL_ENV
from moe_verify.sanitize.output import (
    is_error_header,
    is_sanitizer_line,
    parse_output,
    verdict_line,
)
from moe_verify.sanitize.report import Crumb, SanitizeReport, attribute
from reference.hardware.tensor_core import FUSED_ENV

SANITIZER = "compute-sanitizer"
DEFAULT_CUDA_HOME = Path("/usr/local/cuda")
# Errors the sanitizer prints in full; the ERROR SUMMARY still counts every one. The first is what
# the report is about; a few more show whether it repeats across threads.
DEFAULT_PRINT_LIMIT = 20
# Beyond the case timeout: starting Python and torch under the sanitizer, its instrumentation of
# every module the case loads, and the child's own grace to end a case stuck outside Python.
SANITIZER_GRACE_S = 300.0
# cuBLAS's nvjet kernels are excluded as DeepGEMM's sanitizer test excludes them: the golden's
# matmuls are not ours to judge, and instrumenting them only costs time.
EXCLUDE_KERNELS = "kns=nvjet"
# Flags of `run` that write files: the unsanitized timing run leaves them to the sanitized one.
OUTPUT_FLAGS = ("--json", "--markdown", "--dump-dir", "--plot")


class SanitizerUnavailable(RuntimeError):
    """compute-sanitizer cannot run this case here: it is not installed, or there is no GPU."""


def find_sanitizer(
    env: Mapping[str, str] | None = None, default_cuda_home: Path = DEFAULT_CUDA_HOME
) -> Path:
    """compute-sanitizer from $CUDA_HOME/bin, then `default_cuda_home`/bin, then PATH;
    SanitizerUnavailable naming every place looked when none has it."""
    env = os.environ if env is None else env
    looked: list[str] = []
    homes = [env["CUDA_HOME"]] if env.get("CUDA_HOME") else []
    for home in [*homes, str(default_cuda_home)]:
        candidate = Path(home) / "bin" / SANITIZER
        looked.append(str(candidate))
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(SANITIZER, path=env.get("PATH", ""))
    looked.append(f"PATH ({env.get('PATH', '')})")
    if found:
        return Path(found)
    raise SanitizerUnavailable(
        f"--sanitize: {SANITIZER} not found; looked in {', '.join(looked)} (it ships with the "
        "CUDA toolkit: set CUDA_HOME to the toolkit's root)"
    )


def require_gpu(env: Mapping[str, str] | None = None) -> None:
    """The case must run its kernels on a CUDA GPU, the only place the sanitizer looks."""
    env = os.environ if env is None else env
    if env.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SanitizerUnavailable(
            "--sanitize: TRITON_INTERPRET is set, so the Triton kernels would run on the CPU, "
            "where compute-sanitizer sees nothing; unset it"
        )
    import torch

    if not torch.cuda.is_available():
        raise SanitizerUnavailable(
            "--sanitize: no CUDA GPU here (torch.cuda.is_available() is False); "
            "compute-sanitizer checks GPU kernels only"
        )


def child_flags(argv: list[str], drop: tuple[str, ...] = ("--sanitize",)) -> list[str]:
    """`argv` (run's flags) without the flags in `drop` and their values ('--flag value' or
    '--flag=value')."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _run_command(flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "moe_verify.cli", "run", *flags]


def sanitizer_command(
    sanitizer: Path, tool: str, flags: list[str], print_limit: int, timeout_s: float | None
) -> list[str]:
    """compute-sanitizer's command line around `moe-verify run <flags>`."""
    # The sanitizer gives up on a target that has not initialized CUDA within its launch timeout
    # (10 s by default; importing torch and the backends under it can take longer); ours bounds
    # the whole run, so it bounds that too.
    launch = str(int(timeout_s)) if timeout_s else "0"
    return [
        str(sanitizer),
        "--tool",
        tool,
        "--print-limit",
        str(print_limit),
        "--launch-timeout",
        launch,
        "--kernel-name-exclude",
        EXCLUDE_KERNELS,
        *_run_command(flags),
    ]


def _child_env(
    base: Mapping[str, str], crumb: Path | None, tool: str | None = None
) -> dict[str, str]:
    # Progress bars would only interleave with the sanitizer's lines in the shared pipe. The
    # golden's tensor-core model runs eager (unless the caller asked otherwise), in the baseline
    # too: compiling it would put torch.compile's Triton kernels and their compile under the
    # sanitizer, and make the slowdown a compile's.
    env = dict(base, MOE_VERIFY_PROGRESS="0", PYTHONFAULTHANDLER="1")
    env.setdefault(FUSED_ENV, "0")
    if crumb is not None:
        env.update(
            PYTORCH_NO_CUDA_MEMORY_CACHING="1",
            # each launch returns when its kernel is done, so its errors come while its stage is
            # the breadcrumb's (DeepGEMM's sanitizer test sets it too)
            CUDA_LAUNCH_BLOCKING="1",
            MOE_VERIFY_BREADCRUMB=str(crumb),
        )
    env.pop(SANITIZER_TOOL_ENV, None)
    if tool is not None:  # the sanitized child: initcheck turns one harness check off
        env[SANITIZER_TOOL_ENV] = tool
    return env


def _stream(
    cmd: list[str],
    env: dict[str, str],
    timeout_s: float | None,
    cwd: Path | None,
    on_line: Callable[[str], None],
) -> Completed:
    """Run `cmd` in its own session with stdout and stderr in one pipe, calling `on_line` with
    each line as it arrives; after `timeout_s` the whole group is killed (also if we are
    interrupted or terminated meanwhile)."""
    lines: list[str] = []

    def take(raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip("\r")
        lines.append(line)
        on_line(line)

    with terminate_as_exit():
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        end = time.monotonic() + timeout_s if timeout_s else None
        pending = b""

        def lines_of(chunk: bytes) -> bool:
            nonlocal pending
            *done, pending = (pending + chunk).split(b"\n")
            for raw in done:
                take(raw)
            return False  # to the end of the output

        try:
            timed_out = read_until(proc.stdout.fileno(), end, lines_of) == "deadline"
            if timed_out:
                kill_group(proc)
            else:
                try:
                    proc.wait(KILL_GRACE_S)
                except subprocess.TimeoutExpired:  # it closed its output but lingers
                    kill_group(proc)
        except BaseException:
            kill_group(proc)
            raise
        finally:
            proc.stdout.close()
        proc.wait()
    if pending:
        take(pending)
    rc = proc.returncode
    sig = signal.Signals(-rc).name if rc < 0 and -rc in signal.valid_signals() else None
    return Completed(rc, "\n".join(lines), "", timed_out, sig)


class _FlagParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"run flags: {message}")


def _case_id(flags: list[str]) -> str:
    """The id of the case `flags` describe (what the report names before any breadcrumb);
    ValueError naming a flag `run` would refuse."""
    parser = _FlagParser(prog="moe-verify run", add_help=False)
    add_run_args(parser)
    return problem_from_args(parser.parse_args(flags)).id


def sanitize_run(
    argv: list[str],
    tool: str,
    timeout_s: float | None,
    *,
    print_limit: int = DEFAULT_PRINT_LIMIT,
    baseline: bool = True,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    check_gpu: bool = True,
    default_cuda_home: Path = DEFAULT_CUDA_HOME,
) -> SanitizeReport:
    """Run `moe-verify run argv` (its flags; a --sanitize among them is dropped) under
    compute-sanitizer's `tool`, bounded by `timeout_s` (None: no limit), and report it. With
    `baseline`, the same case first runs without the sanitizer (and without its output flags)
    to measure the slowdown. `env` is the environment the sanitizer is found in and the child
    starts from (default os.environ); `check_gpu` False skips the GPU check (for a stand-in
    sanitizer). SanitizerUnavailable when it cannot run; ValueError for a bad argument."""
    if tool not in TOOLS:
        raise ValueError(f"--sanitize: expected one of {', '.join(TOOLS)}, got {tool!r}")
    if print_limit < 1:
        raise ValueError(f"print_limit: expected >= 1, got {print_limit!r}")
    base = dict(os.environ if env is None else env)
    flags = child_flags(argv)
    case = _case_id(flags)
    sanitizer = find_sanitizer(base, default_cuda_home)
    if check_gpu:
        require_gpu(base)
    baseline_s = baseline_rc = None
    if baseline:
        start = time.perf_counter()
        plain = _stream(
            _run_command(child_flags(flags, OUTPUT_FLAGS)),
            _child_env(base, None),
            timeout_s,
            cwd,
            lambda line: None,
        )
        baseline_s, baseline_rc = time.perf_counter() - start, plain.rc
    with tempfile.TemporaryDirectory(prefix="moe-verify-sanitize-") as tmp:
        crumb_path = Path(tmp) / "breadcrumb.json"
        cmd = sanitizer_command(sanitizer, tool, flags, print_limit, timeout_s)
        at_error: list[Crumb | None] = []

        def on_line(line: str) -> None:
            # the stage in flight when the first error is printed (see the module docstring)
            if not at_error and is_error_header(line):
                at_error.append(Crumb.read(crumb_path))

        start = time.perf_counter()
        done = _stream(cmd, _child_env(base, crumb_path, tool), timeout_s, cwd, on_line)
        wall = time.perf_counter() - start
        final = Crumb.read(crumb_path)
    lines = done.stdout.split("\n") if done.stdout else []
    parsed = parse_output(lines)
    crumb = (at_error[0] if at_error else None) or final
    first = parsed.first
    failure = parsed.failure
    if failure is None and parsed.summary_count is None and not done.timed_out:
        failure = f"it printed no ERROR SUMMARY ({done.exit_text})"
    return SanitizeReport(
        tool=tool,
        case=crumb.case if crumb else case,
        command=cmd,
        errors=parsed.count,
        first=first,
        where=attribute(first, crumb),
        child_rc=done.rc,
        verdict=verdict_line(lines),
        wall_s=wall,
        timed_out=done.timed_out,
        failure=failure,
        crumb=crumb,
        baseline_s=baseline_s,
        baseline_rc=baseline_rc,
        child_output=[line for line in lines if not is_sanitizer_line(line)],
    )


def run_sanitized(
    tool: str, flags: list[str], case_timeout_s: float | None, launcher: str = "none"
) -> int:
    """`moe-verify run --sanitize TOOL <flags>`: the child's own output, the sanitizer's first
    error block, then the report's paragraph; returns the report's exit code. The run is bounded
    by the case timeout plus SANITIZER_GRACE_S (no bound when the case has none)."""
    if launcher != "none":
        raise ValueError(
            f"--sanitize: runs one process under the sanitizer, so --launcher none (every rank "
            f"emulated in it), got --launcher {launcher}"
        )
    timeout = case_timeout_s + SANITIZER_GRACE_S if case_timeout_s else None
    report = sanitize_run(flags, tool, timeout)
    for line in report.child_output:
        if line.strip():
            print(line)
    if report.first is not None and report.errors:
        print(f"first {tool} error:")
        for line in report.first.lines:
            print(f"  {line}")
    print(report.to_summary())
    return report.exit_code
