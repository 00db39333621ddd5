"""Start one torchrun process per rank (`moe-verify run --launcher torchrun`) and, when the ranks
end without a verdict, name the rank(s) that failed from torchrun's failures and each rank's note.

torchrun's agent runs in this process and starts each rank in a process group of its own; it is
bounded by the case timeout plus a startup grace (the ranks bound their own work by the case
timeout): when that runs out, or on SIGINT/SIGTERM, the agent kills every rank's process group
before the timeout or the signal goes on, and the ranks still working are named.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from moe_verify.args import EXIT_ERROR, run_flags
from moe_verify.distributed import EXCHANGE, NO_MULTICAST_ENV, STATUS_DIR_ENV
from moe_verify.run.contain import CaseTimeout, deadline
from moe_verify.run.options import RunOptions
from moe_verify.spec import MoEProblem

# Beyond the case timeout, what torchrun may take to start the ranks (each imports torch and
# Triton, joins the group) and to exchange and report once their local work is done.
STARTUP_GRACE_S = 120.0
# The signals torchrun's agent turns into its SignalException (TORCHELASTIC_SIGNALS_TO_HANDLE).
_AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


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
    root = str(Path(__file__).resolve().parents[2])  # moe_verify, reference, ... importable
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
    options: RunOptions,
    *,
    json_path: str | None = None,
    markdown_path: str | None = None,
    nproc: int | None = None,
    verbose: bool = False,
) -> int:
    """Run `problem` with one torchrun process per rank, each under `options` (what a rank
    cannot honour is refused first: RunOptions.check_launcher); the exit code of `moe-verify
    run`. Rank 0 prints the report's summary, or with `verbose` every check (`run -v`). The
    case timeout bounds each rank's work (None: no limit), and the whole launch with
    STARTUP_GRACE_S more."""
    options.check_launcher("torchrun")
    size = problem.topology.size
    if nproc is not None and nproc != size:
        raise ValueError(
            f"--nproc {nproc}: topology {problem.topology} has {size} ranks, one process each"
        )
    if options.dump_dir is not None:  # the same directory whatever directory a rank runs in
        options = dataclasses.replace(options, dump_dir=options.dump_dir.resolve())
    case_timeout_s = options.case_timeout_s
    with tempfile.TemporaryDirectory(prefix="moe-verify-dist-") as tmp:
        status = Path(tmp)
        (status / "problem.json").write_text(json.dumps(problem.to_dict()))
        worker = ["--problem-json", str(status / "problem.json"), *run_flags(options)]
        if json_path:
            worker += ["--json", str(Path(json_path).resolve())]
        if markdown_path:
            worker += ["--markdown", str(Path(markdown_path).resolve())]
        if verbose:
            worker.append("--verbose")
        torchrun = [
            "--standalone",
            f"--nproc-per-node={size}",
            "--monitor-interval=0.1",
            # torchrun's logs and error files in our directory, removed with it (its default is
            # a new /tmp/torchelastic_* it leaves behind)
            f"--log-dir={status / 'torchelastic'}",
            "-m",
            "moe_verify.distributed.worker",
            *worker,
        ]
        failures: dict[int, ProcessFailure] = {}
        limit = case_timeout_s + STARTUP_GRACE_S if case_timeout_s else None
        try:
            with _environ(_launch_env(status)):
                failures = _run_torchrun(torchrun, limit, problem)
        except CaseTimeout:
            assert limit is not None
            why = (
                f"the torchrun ranks did not finish within {limit:g} s (the case timeout of "
                f"{case_timeout_s:g} s plus {STARTUP_GRACE_S:g} s to start and exchange); "
                "every rank was killed; timed out rank(s)"
            )
            print(failure_summary(problem, status, {}, why), file=sys.stderr)
            return EXIT_ERROR
        verdict = status / "verdict.json"
        if verdict.exists():
            return int(json.loads(verdict.read_text())["exit"])
        print(failure_summary(problem, status, failures), file=sys.stderr)
        return EXIT_ERROR


def _run_torchrun(
    torchrun: list[str], limit: float | None, problem: MoEProblem
) -> dict[int, ProcessFailure]:
    """torchrun's agent in this process, bounded by `limit`; the ranks' failures. A timeout or a
    signal reaches the agent as an exception, and it kills every rank's process group before
    passing it on; a signal is then delivered again to the handlers that were ours."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import parse_args, run

    ours = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    try:
        with deadline(limit, lambda: f"torchrun of {problem.id}"):
            run(parse_args(torchrun))
    except ChildFailedError as exc:
        return dict(exc.failures)
    except SignalException as exc:
        for sig, handler in ours.items():
            signal.signal(sig, handler)
        signal.raise_signal(exc.sigval)
        raise
    finally:
        for sig, handler in ours.items():
            signal.signal(sig, handler)
    return {}


def failure_summary(
    problem: MoEProblem,
    status: Path,
    failures: dict[int, ProcessFailure],
    why: str = "the torchrun ranks ended without a verdict; failed rank(s)",
) -> str:
    """Which rank(s) failed and where, when the ranks ended without a verdict (or, `why`, did not
    end in time)."""
    notes = {}
    for rank in range(problem.topology.size):
        path = status / f"rank{rank}.json"
        notes[rank] = json.loads(path.read_text()) if path.exists() else {}
    lines = [f"moe-verify: error: {problem.id}: {why}: {failed_ranks(notes, failures)}"]
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
        if not str(n.get("stage", "")).startswith(EXCHANGE) and n.get("stage") != "done"
    ]
    if behind and len(behind) < len(notes):
        return behind
    own = {r for r, f in failures.items() if f.exitcode != -signal.SIGTERM}
    own |= {r for r, n in notes.items() if n.get("error")}
    return sorted(own or failures)
