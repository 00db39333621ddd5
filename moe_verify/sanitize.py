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
(KERNEL_STAGES), and the crumb picks among them (gemm1 or gemm2 for the grouped GEMM).

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
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from moe_verify.args import (
    EXIT_ERROR,
    EXIT_FAIL,
    EXIT_PASS,
    add_run_args,
    problem_from_args,
)
from moe_verify.args import SANITIZER_TOOLS as TOOLS
from moe_verify.contain import (
    KILL_GRACE_S,
    Completed,
    kill_group,
    read_until,
    terminate_as_exit,
)
from moe_verify.protect import SANITIZER_TOOL_ENV
from reference.tensor_core import FUSED_ENV

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
PREFIX = "========="
ERROR_PREFIX = "moe-verify: error:"
# Flags of `run` that write files: the unsanitized timing run leaves them to the sanitized one.
OUTPUT_FLAGS = ("--json", "--markdown", "--dump-dir", "--plot")

# Our kernels and the stages that launch them (optimized/backend.py); the breadcrumb picks among
# several. A kernel not listed (a backend's own, vLLM's, torch's) takes the breadcrumb's stage.
KERNEL_STAGES: dict[str, tuple[str, ...]] = {
    "_quantize_fp8_groups_kernel": ("quant_input", "shared"),
    "_quantize_mxfp8_kernel": ("quant_input", "shared"),
    "_pack_ue8m0_kernel": ("quant_input", "shared"),
    "_count_kernel": ("align",),
    "_segments_kernel": ("permute",),
    "_scatter_kernel": ("permute",),
    "_grouped_gemm_kernel": ("gemm1", "gemm2", "shared"),
    "_silu_mul_quant_kernel": ("act_quant", "shared"),
    "_ep_gather_kernel": ("gather",),
}
# Every DeepGEMM kernel is a grouped GEMM of ours (optimized/deepgemm.py).
DEEPGEMM_STAGES = ("gemm1", "gemm2", "shared")

# Lines of the sanitizer that are no error: its banner, summaries, and notes on how the target
# ended. Each is matched at the start of the text after the prefix.
_NOT_ERRORS = (
    "COMPUTE-SANITIZER",
    "ERROR SUMMARY",
    "RACECHECK SUMMARY",
    "LEAK SUMMARY",
    "Target application returned an error",
    "Error: process didn't terminate successfully",
    "Default timeout can be adjusted with --launch-timeout",
)
# The sanitizer itself could not do its job: no verdict on the kernels.
_SANITIZER_FAILURES = (
    "Error: No attachable process found",
    "Error: Target application terminated before first instrumented API call",
    "Internal Sanitizer Error",
    "Error: Unable to",
)
_SUMMARY = re.compile(r"ERROR SUMMARY: ([\d,]+) errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: .*\(([\d,]+) errors?")
# "at _scatter_kernel+0x1d0 in /x/scatter.py:240" (2022.x on), "at 0x1d0 in _scatter_kernel" and
# "at 0x00000060 in memcheck_demo.cu:6:unaligned_kernel(void)" (older releases).
_AT_OLD = re.compile(r"\bat 0x[0-9a-fA-F]+ in (?P<rest>.+?)(?: \[\d+ hazards?\])?$")
_AT_NEW = re.compile(
    r"\bat (?P<fn>.+?)\+0x[0-9a-fA-F]+(?: in (?P<loc>\S+))?(?: \[\d+ hazards?\])?$"
)
_OLD_LOC = re.compile(r"(?P<loc>[^\s:]+:\d+):(?P<fn>.+)")
_THREAD = re.compile(r"by thread \((?P<t>[\d, ]+)\) in block \((?P<b>[\d, ]+)\)")
_HAZARD_THREAD = re.compile(r"(?:Read|Write) Thread \((?P<t>[\d, ]+)\)")
_HAZARD_BLOCK = re.compile(r"in block \((?P<b>[\d, ]+)\)")
# "Address 0x7f.. is out of bounds" (CUDA 12); CUDA 13 writes "... to 0x7f.. is out of bounds".
_ADDRESS = re.compile(r"\b(?:Address|to) (?P<a>0x[0-9a-fA-F]+(?: .+)?)$")
_SHARED_ADDRESS = re.compile(r"at (?P<a>__shared__ 0x[0-9a-fA-F]+)")


class SanitizerUnavailable(RuntimeError):
    """compute-sanitizer cannot run this case here: it is not installed, or there is no GPU."""


@dataclass(frozen=True)
class SanitizerError:
    """One error block of the sanitizer's output: its first line (`kind`) and what it names."""

    kind: str  # "Invalid __global__ write of size 4 bytes", "Race reported between ..."
    kernel: str | None  # as the sanitizer names it: "_scatter_kernel", "void deep_gemm::...(...)"
    location: str | None  # "file.py:123" when the kernel has line info
    thread: str | None  # "(0,0,0)"
    block: str | None
    address: str | None  # "0x7f... is out of bounds"
    lines: tuple[str, ...]  # the block without the prefix, up to its host backtrace

    @property
    def kernel_base(self) -> str | None:
        """The kernel's name without 'void ', template and call arguments, or a Triton
        specialization suffix: '_scatter_kernel', 'deep_gemm::sm90_fp8_gemm_1d2d_impl'."""
        if self.kernel is None:
            return None
        name = self.kernel.strip()
        name = name.removeprefix("void ").strip()
        for stop in ("(", "<"):
            name = name.split(stop, 1)[0]
        return name.strip() or None

    @property
    def warning(self) -> bool:
        return self.kind.lower().startswith("warning")


@dataclass(frozen=True)
class SanitizerOutput:
    """What the sanitizer printed: its error blocks in order, the counts of its summaries, and a
    message when it failed to run at all."""

    errors: tuple[SanitizerError, ...]
    summary_count: int | None  # the largest count of ERROR / RACECHECK SUMMARY; None: neither
    failure: str | None

    @property
    def count(self) -> int:
        """Errors found: the summary's count, or the blocks seen when no summary came (the run
        was killed before the sanitizer could print one)."""
        if self.summary_count is not None:
            return self.summary_count
        return sum(1 for e in self.errors if not e.warning)

    @property
    def first(self) -> SanitizerError | None:
        """The first error that names a kernel (an API error such as 'Program hit
        cudaErrorLaunchFailure' is the consequence of a kernel's, reported at the next call),
        else the first error, else the first warning."""
        real = [e for e in self.errors if not e.warning]
        for candidates in ([e for e in real if e.kernel], real, list(self.errors)):
            if candidates:
                return candidates[0]
        return None


def is_sanitizer_line(line: str) -> bool:
    return line.startswith(PREFIX)


def _body(line: str) -> str:
    return line[len(PREFIX) :]


def is_error_header(line: str) -> bool:
    """A sanitizer line that starts an error block: unindented after the prefix, and neither a
    banner, a summary, a note on the target's exit nor a failure of the sanitizer itself."""
    if not is_sanitizer_line(line):
        return False
    body = _body(line)
    if not body.startswith(" ") or body.startswith("  "):
        return False
    text = body.strip()
    return bool(text) and not text.startswith(_NOT_ERRORS + _SANITIZER_FAILURES)


def _kernel_at(text: str) -> tuple[str | None, str | None]:
    """(kernel, location) of an 'at ...' clause, in the old or the new format."""
    old = _AT_OLD.search(text)
    if old:
        rest = old.group("rest").strip()
        split = _OLD_LOC.fullmatch(rest)
        return (split.group("fn"), split.group("loc")) if split else (rest, None)
    new = _AT_NEW.search(text)
    if new:
        return new.group("fn").strip(), new.group("loc")
    return None, None


def _error(block: list[str]) -> SanitizerError:
    """One error block (header first, prefix stripped) as what it names."""
    kernel = location = thread = block_id = address = None
    kept: list[str] = []
    for text in block:
        if text.startswith("Saved host backtrace"):
            break
        kept.append(text)
        if kernel is None:
            kernel, location = _kernel_at(text)
        if thread is None and (m := _THREAD.search(text) or _HAZARD_THREAD.search(text)):
            thread = f"({m.group('t').replace(' ', '')})"
        if block_id is None and (m := _THREAD.search(text) or _HAZARD_BLOCK.search(text)):
            block_id = f"({m.group('b').replace(' ', '')})"
        if address is None and (m := _ADDRESS.search(text) or _SHARED_ADDRESS.search(text)):
            address = m.group("a")
    # A header's location clause ("Race reported between Write access at <kernel>+0x90 ...")
    # is not its kind; a race's second access is on the next line ("and Read access at ...").
    short = block[0].split(" at ", 1)[0].rstrip(" :")
    if len(block) > 1 and block[1].startswith("and ") and " access" in block[1]:
        short += " " + block[1].split(" at ", 1)[0]
    for word in ("Error: ", "ERROR: "):
        short = short.removeprefix(word)
    return SanitizerError(short, kernel, location, thread, block_id, address, tuple(kept))


def parse_output(lines: list[str]) -> SanitizerOutput:
    """The sanitizer's lines (any others are the child's and are skipped) as error blocks and
    counts. A block is its unindented header line and the indented lines after it, up to a bare
    prefix line, the next header or a summary."""
    errors: list[SanitizerError] = []
    counts: list[int] = []
    failure: str | None = None
    block: list[str] | None = None

    def close() -> None:
        nonlocal block
        if block:
            errors.append(_error(block))
        block = None

    for line in lines:
        if not is_sanitizer_line(line):
            continue
        text = _body(line).strip()
        if is_error_header(line):
            close()
            block = [text]
            continue
        if not text:
            close()
            continue
        for pattern in (_SUMMARY, _RACE_SUMMARY):
            if m := pattern.search(text):
                close()
                counts.append(int(m.group(1).replace(",", "")))
        if text.startswith(_SANITIZER_FAILURES):
            close()
            failure = failure or text
        elif block is not None and _body(line).startswith("  "):
            block.append(text)
    close()
    return SanitizerOutput(tuple(errors), max(counts) if counts else None, failure)


# -- where the error was ----------------------------------------------------------------------


@dataclass(frozen=True)
class Crumb:
    """The runner's breadcrumb: the case and stage in flight (moe_verify/runner.py)."""

    case: str
    rank: int
    stage: str
    mode: str

    @staticmethod
    def read(path: Path) -> Crumb | None:
        try:
            data = json.loads(path.read_text())
            return Crumb(
                str(data["case"]), int(data["rank"]), str(data["stage"]), str(data["mode"])
            )
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or caught mid-write
            return None


def kernel_stages(kernel_base: str | None) -> tuple[str, ...]:
    """The stages that launch `kernel_base` (KERNEL_STAGES, DeepGEMM's), () when not ours."""
    if not kernel_base:
        return ()
    if kernel_base.startswith("deep_gemm::"):
        return DEEPGEMM_STAGES
    name = kernel_base.rsplit("::", 1)[-1]
    for kernel, stages in KERNEL_STAGES.items():
        # Triton 2.x named a kernel by its signature too (_scatter_kernel_0d1d2d)
        if re.fullmatch(rf"{re.escape(kernel)}(?:_\d\w*)?", name):
            return stages
    return ()


@dataclass(frozen=True)
class Attribution:
    """The stage an error belongs to, and how that was found."""

    stage: str | None
    rank: int | None
    side: str | None  # golden, isolated or chained
    how: str


def attribute(error: SanitizerError | None, crumb: Crumb | None) -> Attribution:
    """The stage of `error`: the breadcrumb's when the kernel is one of that stage's (or not one
    of ours); the kernel's own when the breadcrumb disagrees or is missing."""
    if error is None:
        return Attribution(None, None, None, "no error")
    stages = kernel_stages(error.kernel_base)
    rank = crumb.rank if crumb else None
    side = crumb.mode if crumb else None
    if crumb is not None and (not stages or crumb.stage in stages):
        how = (
            "from the breadcrumb; the kernel is one of this stage's"
            if stages
            else "from the breadcrumb (the kernel is not one of the suite's)"
        )
        return Attribution(crumb.stage, rank, side, how)
    if len(stages) == 1:
        why = f"the breadcrumb said {crumb.stage}" if crumb else "no breadcrumb"
        return Attribution(stages[0], rank, side, f"from the kernel's name ({why})")
    if stages:
        why = f"the breadcrumb said {crumb.stage}" if crumb else "no breadcrumb to pick one"
        return Attribution(None, rank, side, f"the kernel runs in {' or '.join(stages)} ({why})")
    return Attribution(
        None, None, None, "no breadcrumb (before the first stage) and not our kernel"
    )


# -- running it -------------------------------------------------------------------------------


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


def verdict_line(lines: list[str]) -> str | None:
    """The child's verdict: its report's summary line ('PASS <case> ...', 'FAIL ...') or its
    one-line error, the last one it printed."""
    found = None
    for line in lines:
        if is_sanitizer_line(line):
            continue
        if line.startswith(("PASS ", "FAIL ", "SKIP ", "ERROR ", ERROR_PREFIX)):
            found = line
    return found


@dataclass
class SanitizeReport:
    """One sanitized case: what the sanitizer found, where, and what the run itself said."""

    tool: str
    case: str
    command: list[str]
    errors: int
    first: SanitizerError | None
    where: Attribution
    child_rc: int
    verdict: str | None
    wall_s: float
    timed_out: bool
    failure: str | None  # the sanitizer could not run
    crumb: Crumb | None = None  # the breadcrumb the stage came from
    baseline_s: float | None = None
    baseline_rc: int | None = None
    child_output: list[str] = field(default_factory=list)

    @property
    def slowdown(self) -> float | None:
        if not self.baseline_s:
            return None
        return self.wall_s / self.baseline_s

    @property
    def exit_code(self) -> int:
        if self.errors:
            return EXIT_FAIL
        if self.failure or self.timed_out:
            return EXIT_ERROR
        if self.child_rc == EXIT_PASS:
            return EXIT_PASS
        return EXIT_FAIL if self.child_rc == EXIT_FAIL else EXIT_ERROR

    def _where_text(self) -> str:
        w = self.where
        stage = f"stage {w.stage}" if w.stage else "stage unknown"
        extra = [f"rank {w.rank}"] if w.rank is not None else []
        extra += [f"{w.side} side"] if w.side else []
        return f"{stage} ({', '.join([*extra, w.how])})"

    def _timing(self) -> str:
        ratio = self.slowdown
        if ratio is None:
            return f"The sanitized run took {self.wall_s:.1f} s."
        runs = f"{self.wall_s:.1f} s vs {self.baseline_s:.1f} s without it"
        if self.baseline_rc not in (None, self.child_rc):
            # The sanitized run stopped at the fault, so the two runs did different work.
            return (
                f"Under {self.tool} the case ended at the fault after {self.wall_s:.1f} s; without "
                f"it the case ran to exit {self.baseline_rc} in {self.baseline_s:.1f} s (no "
                "slowdown measured)."
            )
        return f"Under {self.tool} the case ran {ratio:.1f}x slower ({runs})."

    def to_summary(self) -> str:
        """One paragraph: the verdict, the first error with its kernel, stage and case, the run's
        own exit and verdict, and the slowdown."""
        head = (
            f"{self.tool}: {self.errors} error{'s' if self.errors != 1 else ''} in case {self.case}"
        )
        parts = []
        if self.failure:
            why = self.failure.rstrip(".")
            parts.append(f"{head}; the sanitizer could not check it: {why}.")
        elif self.timed_out:
            parts.append(f"{head} before the run was killed at its timeout.")
        elif not self.errors:
            parts.append(f"{head}.")
        if self.first is not None and self.errors:
            e = self.first
            kernel = f"kernel {e.kernel_base or e.kernel}" if e.kernel else "no kernel named"
            at = f" at {e.location}" if e.location else ""
            detail = []
            if e.thread:
                detail.append(f"thread {e.thread} in block {e.block}")
            if e.address:
                detail.append(f"address {e.address}")
            tail = f"; {', '.join(detail)}" if detail else ""
            lead = f"{head} before the run was killed at its timeout" if self.timed_out else head
            parts.append(
                f"{lead}; the first: {e.kind} in {kernel}{at}, {self._where_text()}{tail}."
            )
        run = f"exit {self.child_rc}" + (f", {self.verdict!r}" if self.verdict else "")
        parts.append(f"The run itself: {run}.")
        parts.append(self._timing())
        parts.append(f"Exit {self.exit_code}.")
        return " ".join(parts)


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
