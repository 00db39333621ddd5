"""The child side of an isolated sweep (moe_verify/sweep/pool.py): `python -m
moe_verify.sweep.worker DIR` imports the harness once, then runs the cases its parent sends, one
after another.

Protocol, JSON only: the parent writes one line per case to our stdin, {"name", "problem"
(MoEProblem.to_dict), "options" (RunOptions.to_dict, moe_verify/run/options.py)}; we run it in
process under its deadline, write its outcome to DIR/<name>.json (atomically) and answer one line
{"done": name} on the stdout we started with. Everything the case prints, faulthandler's report of
a crash and the deadline's last words included, goes to DIR/<name>.log, so the parent keeps the
log of the case that killed us. EOF on stdin ends the worker.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from moe_verify.sweep.pool import log_path, outcome_path
from moe_verify.sweep.sweep import run_in_process, write_atomic


def _log_to(path: Path) -> None:
    """Our stdout and stderr (file descriptors 1 and 2, which faulthandler writes to) to `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str] | None = None) -> int:
    (folder,) = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    # The protocol keeps the stdout we started with; a backend's print goes to the case's log.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    # torch, Triton and the backends load here, once, before the first case.
    import moe_verify.run.verify  # noqa: F401
    from moe_verify.run.contain import watch_interrupts
    from moe_verify.run.options import RunOptions
    from moe_verify.spec import MoEProblem

    for line in sys.stdin:
        request = json.loads(line)
        name = request["name"]
        _log_to(log_path(folder, name))
        # Watched, so a backend's own KeyboardInterrupt is its case's error, not the user's.
        with watch_interrupts():
            outcome = run_in_process(
                MoEProblem.from_dict(request["problem"]), RunOptions.from_dict(request["options"])
            )
        result = {
            "status": outcome.status,
            "summary": outcome.summary,
            "messages": outcome.messages,
            "report": outcome.report,
            "peak_gpu_bytes": outcome.peak_gpu_bytes,
            "peak_allocated_bytes": outcome.peak_allocated_bytes,
            "phase_seconds": outcome.phase_seconds,
        }
        write_atomic(outcome_path(folder, name), json.dumps(result))
        replies.write(json.dumps({"done": name}) + "\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
