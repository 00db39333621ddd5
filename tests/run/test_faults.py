"""Every run bounded, every crash contained, results always left (moe_verify/run/contain.py, the
runner, the sweep): each backend of tests/tester/fault_backends.py must become a failed check or
an error of the stage it happened in, `moe-verify run` must exit with the matching code, and a
sweep must go on to the next case and leave its summaries, also when it is killed.

The in-process sweep (isolate=False) does not survive a SIGSEGV or an abort: it is run in a
subprocess here, and what must survive is on disk (the finished case, and the one in flight).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from moe_verify.args import EXIT_ERROR, EXIT_FAIL, EXIT_PASS
from moe_verify.cli import main
from moe_verify.run import contain
from moe_verify.run.contain import CaseTimeout, deadline, run_contained, watch_interrupts
from moe_verify.run.runner import run_stage_into
from moe_verify.spec import Mode, MoEProblem, Stage, Status, Trace
from moe_verify.sweep.sweep import SweepSummary, sweep
from tests.tester import fault_backends as fb
from tests.tester.fault_backends import CRASHES, EXPECTED, FAULT_SEED

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
# Tiny, with a small alignment so M_sum stays small: a case takes about a second here.
FAULTY = MoEProblem(
    tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32, seed=FAULT_SEED
)
HEALTHY = FAULTY.replace(seed=0)
FLAGS = ["-T", "4", "-H", "128", "-I", "128", "-E", "4", "-k", "2", "--alignment", "32"]
# Every fault shows in isolated mode; chained mode would only double the time.
MODE = "isolated"
# Long enough for a healthy tiny case on a loaded 2-core machine (1-2 s in the -n 2 tier; a
# sweep's worker start is not counted), short enough for a hang test: every test of the hang
# waits it out.
HANG_TIMEOUT_S = 6.0
SUBPROCESS_LIMIT_S = 120
EXIT_OF = {Status.FAIL: EXIT_FAIL, Status.ERROR: EXIT_ERROR}


def _spec(name: str) -> str:
    return f"tests.tester.fault_backends:{name}"


# The faults that show only in the harness's workspaces: run with them (and a poison).
WORKSPACES = {
    "OverrunsWorkspace": {"workspace": True},
    "LeavesRowUnwritten": {"workspace": True, "poison": (fb.POISON,)},
}


def _workspace_flags(name: str) -> list[str]:
    opts = WORKSPACES.get(name, {})
    flags = ["--workspace"] if opts.get("workspace") else []
    return flags + [f for b in opts.get("poison", ()) for f in ("--poison", str(b))]


def _timeout(name: str) -> float:
    return HANG_TIMEOUT_S if name == "HangsInGemm1" else contain.DEFAULT_CASE_TIMEOUT_S


def _python(code: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


# -- moe-verify run ---------------------------------------------------------------------------


def _run_args(name: str) -> list[str]:
    args = ["run", *FLAGS, "--seed", str(FAULT_SEED), "--backend", _spec(name), "--mode", MODE]
    args += _workspace_flags(name)
    return [*args, "--case-timeout", f"{_timeout(name):g}"]


@pytest.mark.parametrize("name", CRASHES)
def test_run_never_passes_a_crash_of_its_own_process(name: str) -> None:
    """`run` does not contain a crash of its own process (a subprocess shows it); it never
    passes."""
    cmd = [sys.executable, "-m", "moe_verify.cli", *_run_args(name)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_LIMIT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode != EXIT_PASS and "PASS" not in proc.stdout, out[-3000:]


@pytest.mark.parametrize("name", [n for n in EXPECTED if n not in CRASHES])
def test_run_exits_with_the_faults_code_and_names_case_and_stage(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process: `main` returns the code the console script exits with (the README's examples
    run that boundary as a user does); the hang, a backend's exit(0) and its own
    KeyboardInterrupt are contained here as in a `moe-verify` process."""
    monkeypatch.chdir(ROOT)  # the backend is imported by module path
    status, stage = EXPECTED[name]
    code = main(_run_args(name))
    out = "".join(capsys.readouterr())
    assert code == EXIT_OF[status], out[-3000:]
    assert FAULTY.id in out and f"first failure: {stage}" in out, out[-3000:]


# -- sweeps -----------------------------------------------------------------------------------


def _check_sweep(name: str, out_dir: Path, summary: SweepSummary) -> None:
    """The faulty case first, named with its stage and status; the healthy one after it passes;
    the three summaries say the same."""
    status, stage = EXPECTED[name]
    faulty, healthy = summary.outcomes
    assert (faulty.status, healthy.status) == (status, Status.PASS), faulty.summary
    assert FAULTY.id in faulty.summary and stage in faulty.summary, faulty.summary
    assert summary.exit_code == EXIT_OF[status]
    suite = ET.parse(out_dir / "junit.xml").getroot()
    counted = "failures" if status is Status.FAIL else "errors"
    assert suite.get("tests") == "2" and suite.get(counted) == "1"
    (bad,) = [c for c in suite.iter("testcase") if len(c)]
    tag = "failure" if status is Status.FAIL else "error"
    assert bad.get("name") == FAULTY.id and bad[0].tag == tag and stage in (bad[0].text or "")
    data = json.loads((out_dir / "summary.json").read_text())
    assert [c["status"] for c in data["cases"]] == [status, Status.PASS]
    assert data["exit_code"] == summary.exit_code and data["running"] is None
    matrix = (out_dir / "summary.md").read_text()
    assert f"| {FAULTY.id} | {status.upper()} |" in matrix and f"| {HEALTHY.id} | PASS |" in matrix


IN_PROCESS = [n for n in EXPECTED if n not in CRASHES]


@pytest.mark.parametrize("name", IN_PROCESS)
def test_an_in_process_sweep_records_the_fault_and_goes_on(name: str, tmp_path: Path) -> None:
    summary = sweep(
        [FAULTY, HEALTHY],
        backend=_spec(name),
        mode=MODE,
        out_dir=tmp_path,
        isolate=False,
        case_timeout_s=_timeout(name),
        **WORKSPACES.get(name, {}),
    )
    _check_sweep(name, tmp_path, summary)


# Crashes need the subprocess; the hang shows the child's own deadline, and that the child's
# failure messages reach the junit as an in-process run's do.
ISOLATED = [*CRASHES, "HangsInGemm1"]


@pytest.mark.parametrize("name", ISOLATED)
def test_an_isolated_sweep_contains_the_fault_and_goes_on(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the subprocess imports the backend by module path
    summary = sweep(
        [FAULTY, HEALTHY],
        backend=_spec(name),
        mode=MODE,
        out_dir=tmp_path,
        case_timeout_s=_timeout(name),
    )
    _check_sweep(name, tmp_path, summary)
    error = ET.parse(tmp_path / "junit.xml").getroot().find("testcase/error")
    assert error is not None and error.text
    if name in CRASHES:  # the exit, the breadcrumb and the child's stderr
        signame = "SIGSEGV" if name == "SegfaultsInGemm1" else "SIGABRT"
        assert f"killed by {signame}" in error.text
        assert '"stage": "gemm1"' in error.text and "stderr (crash report):" in error.text
        assert "in gemm1" in error.text  # faulthandler's Python stack names the hook
    else:  # rebuilt from the child's report: the same messages as an in-process run
        assert (
            f"{FAULTY.id} [isolated] stage gemm1" in error.text and "timed out after" in error.text
        )


# The cases a worker runs: the faulty one second, so one worker must run a case before the fault
# and a fresh one the cases after it. backend -> the status of each case, and which worker ran it
# (0: the first started, 1: the second): a worker is replaced only after an ERROR.
WORKER_CASES = [HEALTHY, FAULTY, FAULTY.replace(seed=2), FAULTY.replace(seed=3)]
PASS, FAIL, ERROR = Status.PASS, Status.FAIL, Status.ERROR
WORKERS = {
    "optimized": ([PASS, PASS, PASS, PASS], [0, 0, 0, 0]),  # one process start for the sweep
    "NanInLiveRow": ([PASS, FAIL, PASS, PASS], [0, 0, 0, 0]),  # a failed check keeps the worker
    "RaisesInGemm1": ([PASS, ERROR, PASS, PASS], [0, 0, 1, 1]),  # a raise may leave state behind
    "SegfaultsInGemm1": ([PASS, ERROR, PASS, PASS], [0, 0, 1, 1]),  # the worker died with it
}


@pytest.mark.parametrize("name", list(WORKERS))
def test_an_isolated_sweep_replaces_its_worker_only_after_an_error(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the worker imports the backend by module path
    backend = name if name == "optimized" else _spec(name)
    summary = sweep(WORKER_CASES, backend=backend, mode=MODE, out_dir=tmp_path)
    statuses, workers = WORKERS[name]
    assert [o.status for o in summary.outcomes] == statuses, [o.summary for o in summary.outcomes]
    pids = [o.worker for o in summary.outcomes]
    assert None not in pids and [list(dict.fromkeys(pids)).index(p) for p in pids] == workers
    data = json.loads((tmp_path / "summary.json").read_text())
    assert [c["worker"] for c in data["cases"]] == pids
    if name == "SegfaultsInGemm1":  # the crashed case names its signal and stage
        crashed = summary.outcomes[1]
        assert "killed by SIGSEGV" in crashed.summary and '"stage": "gemm1"' in crashed.summary
        assert FAULTY.id in crashed.summary


def test_an_in_process_sweep_killed_by_a_segfault_leaves_the_finished_case(
    tmp_path: Path,
) -> None:
    proc = _python(
        f"""
        from moe_verify.spec import MoEProblem
        from moe_verify.sweep.sweep import SweepSummary, sweep
        faulty = MoEProblem.from_dict({FAULTY.to_dict()!r})
        sweep([faulty.replace(seed=0), faulty], backend={_spec("SegfaultsInGemm1")!r},
              out_dir={str(tmp_path)!r}, isolate=False)
        """
    )
    _, err = proc.communicate(timeout=SUBPROCESS_LIMIT_S)
    assert proc.returncode == -signal.SIGSEGV, err[-3000:]
    data = json.loads((tmp_path / "summary.json").read_text())
    assert [(c["id"], c["status"]) for c in data["cases"]] == [(HEALTHY.id, Status.PASS)]
    assert data["running"] == FAULTY.id and data["exit_code"] == EXIT_ERROR
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert [c.get("name") for c in suite.iter("testcase")] == [HEALTHY.id]


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if entry.name.isdigit() and text in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize(
    ("stop", "code", "said"),
    [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGINT, 130, "interrupted (Ctrl-C)")],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_sweep_terminated_midway_leaves_valid_summaries_and_no_child(
    tmp_path: Path, stop: signal.Signals, code: int, said: str
) -> None:
    scratch = tmp_path / "scratch"  # the sweep's temporary files: the hung child's command has it
    scratch.mkdir()
    out = tmp_path / "out"
    proc = _python(
        f"""
        from moe_verify.spec import MoEProblem
        from moe_verify.sweep.sweep import SweepSummary, sweep
        faulty = MoEProblem.from_dict({FAULTY.to_dict()!r})
        sweep([faulty.replace(seed=0), faulty], backend={_spec("HangsInGemm1")!r},
              out_dir={str(out)!r}, case_timeout_s=600)
        """,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    start = time.monotonic()
    crumbs: list[Path] = []
    while not crumbs:  # the second case's child has reached its stages
        assert proc.poll() is None and time.monotonic() - start < SUBPROCESS_LIMIT_S
        time.sleep(0.2)
        progress = out / "progress.json"
        data = json.loads(progress.read_text()) if progress.exists() else {}
        if data.get("running") == FAULTY.id:
            crumbs = list(scratch.glob("*/breadcrumb.json"))
    assert _processes_mentioning(str(scratch))
    proc.send_signal(stop)
    out_text, err = proc.communicate(timeout=SUBPROCESS_LIMIT_S)
    # SIGTERM exits 143; Ctrl-C's KeyboardInterrupt leaves this bare script by the signal
    assert proc.returncode in (code, -stop), err[-3000:]
    assert _processes_mentioning(str(scratch)) == []  # the hung child's group was killed
    suite = ET.parse(out / "junit.xml").getroot()
    assert [c.get("name") for c in suite.iter("testcase")] == [HEALTHY.id]
    data = json.loads((out / "summary.json").read_text())  # written again on SIGTERM
    assert [c["id"] for c in data["cases"]] == [HEALTHY.id] and data["running"] == FAULTY.id
    progress = json.loads((out / "progress.json").read_text())
    assert progress["running"] == FAULTY.id and progress["exit_code"] == code, progress
    # on stdout, in the verdict's place (a CI job that keeps stdout sees why there is none)
    (last,) = [line for line in out_text.splitlines() if line.startswith("sweep ")]
    assert last.startswith(f"sweep cases {said}, exit {code}: 1 of 2 cases ran"), out_text
    assert f"partial summary in {out / 'summary.json'}" in last, out_text
    assert "summaries in" not in out_text  # no verdict line: the sweep did not finish


def test_a_sweep_refuses_an_unwritable_output_directory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"out_dir: expected a writable directory.*file/summaries"):
        sweep([HEALTHY], out_dir=blocker / "summaries", isolate=False)


# -- the pieces -------------------------------------------------------------------------------


def test_a_deadline_interrupts_python_and_restores_the_handler() -> None:
    before = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    with pytest.raises(CaseTimeout, match=r"after 0.2 s, in case x stage y"):
        with deadline(0.2, lambda: "case x stage y"):
            time.sleep(30)
    assert time.monotonic() - start < 5
    assert (
        signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )
    with deadline(30, lambda: "case x"):
        pass  # a block that ends in time leaves no timer behind
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_a_case_stuck_outside_python_ends_the_process_naming_the_stage() -> None:
    # SIGALRM blocked stands for C code that never returns to the interpreter.
    proc = _python(
        """
        import signal, time
        from moe_verify.run import contain
        contain.HARD_GRACE_S = 0.5
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        with contain.deadline(0.5, lambda: "case x rank 0 isolated gemm1"):
            time.sleep(60)
        """
    )
    _, err = proc.communicate(timeout=SUBPROCESS_LIMIT_S)
    assert proc.returncode == contain.HARD_EXIT_CODE
    assert "case timeout of 0.5 s ran out in case x rank 0 isolated gemm1" in err


def test_run_contained_kills_the_whole_group_on_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    done = run_contained(["sh", "-c", script], 0.5, None)
    assert done.timed_out and done.signal == "SIGTERM" and "timed out" in done.exit_text
    grandchild = int(pid_file.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in _state(grandchild)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_run_contained_reports_a_signal_by_name() -> None:
    done = run_contained([sys.executable, "-c", "import os; os.abort()"], 30, None)
    assert done.rc == -signal.SIGABRT and done.signal == "SIGABRT" and not done.timed_out


def test_a_terminated_parent_takes_its_contained_child_along(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    proc = _python(
        f"""
        from moe_verify.run.contain import run_contained
        run_contained(["sh", "-c", "echo $$ > {pid_file}; exec sleep 60"], None, None)
        """
    )
    start = time.monotonic()
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() - start < SUBPROCESS_LIMIT_S
        time.sleep(0.05)
    child = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=SUBPROCESS_LIMIT_S)
    assert proc.returncode == 128 + signal.SIGTERM
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in _state(child)


class _Interrupts:
    """A stage that raises KeyboardInterrupt itself, or gets a real SIGINT (the user's Ctrl-C)."""

    name = "interrupts"

    def __init__(self, real: bool) -> None:
        self.real = real

    def route(self, ctx):
        if self.real:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises here
        raise KeyboardInterrupt

    quant_input = align = permute = dispatch = gemm1 = act_quant = gemm2 = gather = shared = route


def test_the_users_ctrl_c_propagates_but_a_backends_keyboard_interrupt_is_its_error() -> None:
    # Run as the golden's stages: no inputs to protect; interrupts are told apart the same way.
    trace = Trace("interrupts")
    upstream = Trace("golden")
    with watch_interrupts():
        backend = _Interrupts(real=False)
        run_stage_into(trace, backend, Stage.ROUTE, HEALTHY, None, upstream, Mode.ISOLATED, True)
        with pytest.raises(KeyboardInterrupt):
            backend = _Interrupts(real=True)
            stage = Stage.QUANT_INPUT
            run_stage_into(trace, backend, stage, HEALTHY, None, upstream, Mode.ISOLATED, True)
    failure = trace.failure(Stage.ROUTE)
    assert failure is not None and failure.status is Status.ERROR
    assert "raised KeyboardInterrupt" in failure.reason
