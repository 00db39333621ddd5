"""Reading what a sanitized `moe-verify run` printed: compute-sanitizer's lines (each starts with
PREFIX) and the child's share one pipe. `parse_output` turns the sanitizer's lines into error
blocks (`SanitizerError`: kind, kernel, location, thread, block, address) and the counts of its
summaries (`SanitizerOutput`); `verdict_line` finds the child's own verdict among the rest.

Both output formats are read: the kernel as "at _scatter_kernel+0x1d0 in file.py:240" (2022.x on)
and as "at 0x1d0 in _scatter_kernel" (older releases); the address as CUDA 12 and CUDA 13 write it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "========="
# How the child prints a one-line error (moe_verify/cli.py): its verdict when it has no report.
ERROR_PREFIX = "moe-verify: error:"

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
