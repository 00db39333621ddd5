"""`moe-verify sweep --jobs N` (moe_verify/sweep/pool.py): N contained workers run the cases at
once. A segfault, a hang past the case timeout, an exit() and an os._exit(0) in concurrent workers
each end their own case only, as the right ERROR; every other case passes; junit, JSON and the
markdown list the cases in case order and count them right; and the outcomes are those of one
worker, case by case. Workers are pinned round robin to the GPUs and held back by the memory gate;
every worker shares the JIT caches.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import moe_verify.sweep.sweep as sweep_module
from moe_verify.cli import main
from moe_verify.common import jit_cache
from moe_verify.run.options import RunOptions
from moe_verify.run.preflight import estimate
from moe_verify.spec import MoEProblem, Status
from moe_verify.sweep import pool as sweep_pool
from moe_verify.sweep.pool import CaseOutcome, Device, RunningCase, run_again_alone, run_pool
from moe_verify.sweep.sweep import SweepSummary, sweep
from optimized.backend import OptimizedBackend
from tests.tester.fault_backends import (
    ATTEMPTS_DIR_VAR,
    EXIT_SEED,
    HANG_SEED,
    HARD_EXIT_SEED,
    OOM_ALWAYS_SEED,
    OOM_ONCE_SEED,
    SEGFAULT_SEED,
)

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
# Tiny, with a small alignment so M_sum stays small: a case takes about a second here.
CASE = MoEProblem(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32)
# Healthy cases among the faults, so a worker meets a fault while the other runs a healthy case.
SEEDS = [0, SEGFAULT_SEED, 1, HANG_SEED, EXIT_SEED, HARD_EXIT_SEED]
CASES = [CASE.replace(seed=s) for s in SEEDS]
BACKEND = "tests.tester.fault_backends:FaultsBySeed"
# Every fault shows in isolated mode; chained mode would only double the time.
MODE = "isolated"
# Several times a healthy tiny case's time on a loaded 2-core machine (1-2 s; its worker's start
# is not counted); the hang runs this long, in each of the module's two sweeps.
TIMEOUT_S = 6.0
# seed -> words its ERROR must carry (every fault happens in gemm1)
FAULT_WORDS = {
    SEGFAULT_SEED: "killed by SIGSEGV",
    HANG_SEED: f"timed out after {TIMEOUT_S:g} s",
    EXIT_SEED: "exit(0)",
    HARD_EXIT_SEED: "worker exit 0",
}


def _sweep(jobs: int, out: Path) -> tuple[SweepSummary, list[int]]:
    """The faulty sweep with `jobs` workers, and how many cases were in flight at each write of
    the summaries."""
    in_flight: list[int] = []
    real = sweep_module.write_summaries

    def counting(summary: SweepSummary, *args: object, **kwargs: object) -> None:
        in_flight.append(len(summary.in_flight))
        real(summary, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # the workers import the backend by module path
        mp.setattr(sweep_module, "write_summaries", counting)
        summary = sweep(
            CASES, backend=BACKEND, mode=MODE, out_dir=out, case_timeout_s=TIMEOUT_S, jobs=jobs
        )
    return summary, in_flight


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[SweepSummary, list[int], Path]:
    out = tmp_path_factory.mktemp("jobs2")
    return (*_sweep(2, out), out)


@pytest.fixture(scope="module")
def one_job(tmp_path_factory: pytest.TempPathFactory) -> SweepSummary:
    return _sweep(1, tmp_path_factory.mktemp("jobs1"))[0]


def test_each_fault_ends_its_own_case_only(two_jobs) -> None:
    summary, _, _ = two_jobs
    assert [o.problem.id for o in summary.outcomes] == [c.id for c in CASES]
    for case, outcome in zip(CASES, summary.outcomes, strict=True):
        if case.seed not in FAULT_WORDS:
            assert outcome.status is Status.PASS, outcome.summary
            continue
        text = outcome.summary + "\n" + "\n".join(outcome.messages)
        assert outcome.status is Status.ERROR, outcome.summary
        assert case.id in outcome.summary and "gemm1" in text, text[-2000:]
        assert FAULT_WORDS[case.seed] in text, (case.seed, text[-2000:])


def test_two_workers_ran_at_once_and_crashed_ones_were_replaced(two_jobs) -> None:
    summary, in_flight, _ = two_jobs
    assert max(in_flight) == 2 and in_flight[-1] == 0
    by_seed = {o.problem.seed: o for o in summary.outcomes}
    pids = [o.worker for o in summary.outcomes]
    assert None not in pids
    # Each fault ends its worker: no case after it runs in the worker it killed.
    for seed in FAULT_WORDS:
        dead = by_seed[seed].worker
        later = [o.worker for o in summary.outcomes[CASES.index(CASE.replace(seed=seed)) + 1 :]]
        assert dead not in later, (seed, pids)


def test_junit_json_and_markdown_count_and_order_the_cases(two_jobs) -> None:
    summary, _, out = two_jobs
    ids = [c.id for c in CASES]
    assert summary.exit_code == 2 and summary.complete and summary.running is None
    assert summary.count(Status.ERROR) == len(FAULT_WORDS)
    assert summary.count(Status.PASS) == len(CASES) - len(FAULT_WORDS)
    suite = ET.parse(out / "junit.xml").getroot()
    assert suite.get("tests") == str(len(CASES)) and suite.get("failures") == "0"
    assert suite.get("errors") == str(len(FAULT_WORDS))
    assert [c.get("name") for c in suite.iter("testcase")] == ids
    errored = [c.get("name") for c in suite.iter("testcase") if c.find("error") is not None]
    assert errored == [c.id for c in CASES if c.seed in FAULT_WORDS]
    data = json.loads((out / "summary.json").read_text())
    assert [c["id"] for c in data["cases"]] == ids and data["in_flight"] == []
    assert data["counts"] == {"pass": 2, "fail": 0, "error": 4} and data["exit_code"] == 2
    rows = [line for line in (out / "summary.md").read_text().splitlines() if "| fp8" in line]
    assert [r.split("|")[1].strip() for r in rows] == ids
    # Where each case's time went: every phase of a case that ran to its report; nothing for a
    # case whose worker died with it.
    for case in data["cases"]:
        phases = case["phase_seconds"]
        if case["report"] is None:
            assert phases is None, case
        else:
            assert {"inputs", "golden", "isolated", "compare"} <= set(phases), phases
            assert sum(phases.values()) <= case["seconds"], case


def _what(o: CaseOutcome) -> tuple[object, ...]:
    """What a case's outcome says, less what differs between any two runs (times, pids, the
    addresses in a crash's stack)."""
    stages = None if o.report is None else o.report.get("isolated")
    verdicts = [(r["stage"], r["status"], r["rank"]) for r in stages or []]
    return o.problem.id, o.status, o.summary.split(": ")[1], verdicts


def test_two_jobs_give_one_jobs_outcomes_case_by_case(two_jobs, one_job) -> None:
    summary, _, _ = two_jobs
    assert [_what(o) for o in summary.outcomes] == [_what(o) for o in one_job.outcomes]
    # One worker, replaced after each fault: as many workers as faults (the last fault ends it).
    assert len({o.worker for o in one_job.outcomes}) == len(FAULT_WORDS)


class ReportsItsGpu(OptimizedBackend):
    """The optimized path, named after the GPU its worker was given."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.name = "gpu-" + os.environ.get("CUDA_VISIBLE_DEVICES", "unpinned")


def test_workers_are_pinned_round_robin_and_held_to_each_devices_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two GPUs, three workers: slots 0 and 2 share GPU 0, whose budget holds one case at a time,
    so at most two cases ever run at once, one per GPU."""
    monkeypatch.chdir(ROOT)
    one_case = 1.5 * estimate(CASE).total
    monkeypatch.setattr(
        sweep_pool, "devices", lambda: [Device("0", int(one_case)), Device("1", int(one_case))]
    )
    cases = [CASE.replace(seed=s) for s in range(4)]
    # No case here hangs: a bound only, generous for two cases at once on a loaded machine.
    options = RunOptions(f"{__name__}:ReportsItsGpu", MODE, case_timeout_s=10 * TIMEOUT_S)
    running: set[int] = set()
    most = 0
    outcomes: dict[int, CaseOutcome] = {}

    def started(index: int) -> None:
        nonlocal most
        running.add(index)
        most = max(most, len(running))

    def finished(index: int, outcome: CaseOutcome) -> None:
        running.discard(index)
        outcomes[index] = outcome

    run_pool(cases, options, 3, started, finished)
    assert sorted(outcomes) == [0, 1, 2, 3] and most == 2
    assert all(o.status is Status.PASS for o in outcomes.values())
    # The summary line names the backend: "... [gpu-0, isolated] ..."
    gpus = {o.summary.split("[")[1].split(",")[0] for o in outcomes.values()}
    assert gpus == {"gpu-0", "gpu-1"}, [o.summary for o in outcomes.values()]


def test_the_cli_runs_a_shard_with_two_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    args = ["sweep", "--preset", "smoke", "--shard", "2/9", "--jobs", "2", "--mode", MODE]
    assert main([*args, "--engine", "triton", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "summary.json").read_text())
    assert len(data["cases"]) == 2 and data["passed"]
    assert len({c["worker"] for c in data["cases"]}) == 2


# -- the arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize("jobs", [0, -1, True, 2.0, "2", None])
def test_sweep_refuses_a_bad_jobs_before_any_work(jobs: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^jobs: expected an int >= 1"):
        sweep([CASE], out_dir=tmp_path / "out", jobs=jobs)
    assert not (tmp_path / "out").exists()


def test_jobs_need_isolation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^jobs: 2 workers need isolate=True"):
        sweep([CASE], out_dir=tmp_path, isolate=False, jobs=2)


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_the_cli_refuses_a_bad_jobs(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:  # argparse's own error
        main(["sweep", "--preset", "smoke", "--out", str(tmp_path / "out"), "--jobs", value])
    assert exited.value.code == 2
    assert f"argument --jobs: expected an int >= 1 (worker processes), got {value!r}" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_jobs_in_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["sweep", "--out", str(tmp_path / "out"), "--in-process", "--jobs", "2"])
    assert code == 2
    assert "--jobs 2 needs workers: --in-process runs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "jobs", "shard"),
    [
        ([], 5, None),  # the machine's default (default_jobs, here stood in for)
        (["--jobs", "3"], 3, None),
        (["--in-process"], 1, None),
        (["--shard", "2/4", "--jobs", "2"], 2, "2/4"),
    ],
)
def test_the_cli_hands_jobs_and_shard_to_the_sweep(
    flags: list[str],
    jobs: int,
    shard: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict = {}

    class Summary:
        exit_code = 0

    def stand_in(preset: str, **kwargs: object) -> Summary:
        seen.update(kwargs)
        return Summary()

    monkeypatch.setattr(sweep_module, "sweep", stand_in)
    monkeypatch.setattr(sweep_pool, "default_jobs", lambda: 5)
    assert main(["sweep", "--preset", "nightly", "--out", str(tmp_path), *flags]) == 0
    assert (seen["jobs"], seen["shard"]) == (jobs, shard)


H200, H100, L4 = 141 * 10**9, 80 * 2**30, 24 * 2**30


@pytest.mark.parametrize(
    ("gpus", "memory", "cpus", "jobs"),
    [
        ([], None, 2, 2),  # the CPU tier's machines: one per core
        ([], None, 16, 4),
        ([], None, 1, 1),
        (["0"], H200, 16, 8),  # one H200: eight share it (one per 16 GiB)
        (["0"], H100, 16, 5),
        (["0"], L4, 16, 1),  # a small GPU: one
        (["0"], H200, 2, 1),  # never more than one per two cores
        (["0"], H200, 1, 1),  # but always one
        (["0", "1"], H200, 32, 16),  # eight per GPU
        (["0", "1"], H200, 8, 4),
        ([str(i) for i in range(8)], H200, 128, 64),
        ([str(i) for i in range(8)], H200, 4, 8),  # at least one per GPU
    ],
)
def test_the_default_jobs(
    gpus: list[str], memory: int | None, cpus: int, jobs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sweep_pool, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(sweep_pool, "gpu_memory", lambda count: [memory] * count)
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert sweep_pool.default_jobs() == jobs


def _running(estimate: int, alone: bool = False) -> RunningCase:
    return RunningCase(0, CASE, 0.0, None, None, estimate, alone=alone)


def test_a_devices_memory_gate() -> None:
    gpu = Device("0", budget=100)
    assert gpu.fits(500)  # alone on its device a case always starts (its pre-flight decides)
    first = _running(60)
    gpu.take(first)
    assert gpu.fits(40) and not gpu.fits(41)
    assert not first.crowded  # nothing ran beside it yet
    second = _running(40)
    gpu.take(second)
    assert first.crowded and second.crowded  # each had company, whoever came first
    gpu.release(first)
    gpu.release(second)
    assert gpu.fits(500) and (gpu.in_flight, gpu.cases) == (0, 0)
    gpu.reserve(2)  # two workers' own memory comes off the budget
    assert gpu.budget == 100 - 2 * sweep_pool.WORKER_BYTES
    unknown = Device(None, budget=None)
    unknown.take(_running(10**15))
    assert unknown.fits(10**15)
    # A case that must run alone keeps the device to itself, whatever the budget.
    unknown.release(unknown.running[0])
    unknown.take(_running(1, alone=True))
    assert not unknown.fits(1)


def _outcome(status: Status, summary: str) -> CaseOutcome:
    return CaseOutcome(CASE, status, 1.0, summary)


@pytest.mark.parametrize(
    ("status", "summary", "crowded", "alone", "again"),
    [
        (Status.ERROR, "ERROR c: OutOfMemoryError: CUDA out of memory. Tried", True, False, True),
        (Status.ERROR, "ERROR c: DoesNotFit: needs 8.76 GiB, 7.39 GiB free", True, False, True),
        (Status.ERROR, "ERROR c: worker killed by SIGSEGV", True, False, False),
        (Status.FAIL, "FAIL c: gemm1 out of memory?", True, False, False),
        (Status.ERROR, "ERROR c: OutOfMemoryError: CUDA out of memory.", False, False, False),
        (Status.ERROR, "ERROR c: OutOfMemoryError: CUDA out of memory.", True, True, False),
    ],
)
def test_which_cases_run_again_alone(
    status: Status, summary: str, crowded: bool, alone: bool, again: bool
) -> None:
    """Only an ERROR for want of memory, beside other cases, on its first run."""
    running = _running(1, alone=alone)
    running.crowded = crowded
    assert run_again_alone(running, _outcome(status, summary)) is again


def test_a_case_out_of_memory_beside_others_runs_again_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers: the two cases that start together both run out of memory; each runs again
    alone on the device (nothing else starts meanwhile), where one passes and the other, out of
    memory alone too, stays an ERROR that says so; the healthy case runs after them."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(ATTEMPTS_DIR_VAR, str(tmp_path / "attempts"))
    cases = [CASE.replace(seed=OOM_ONCE_SEED), CASE.replace(seed=OOM_ALWAYS_SEED), CASE]
    options = RunOptions(BACKEND, MODE, case_timeout_s=10 * TIMEOUT_S)
    starts: list[tuple[int, bool, list[int]]] = []  # case, alone, the cases already running
    real_take = Device.take

    def take(device: Device, running: RunningCase) -> None:
        starts.append((running.index, running.alone, [r.index for r in device.running]))
        real_take(device, running)

    monkeypatch.setattr(Device, "take", take)
    outcomes: dict[int, CaseOutcome] = {}
    run_pool(cases, options, 2, lambda i: None, outcomes.__setitem__)
    assert starts[:2] == [(0, False, []), (1, False, [0])], starts
    # Each re-run alone (in the order their first runs ended), then the healthy case.
    assert sorted(starts[2:4]) == [(0, True, []), (1, True, [])], starts
    assert starts[4:] == [(2, False, [])], starts
    once, always, healthy = (outcomes[i] for i in range(3))
    assert once.status is Status.PASS and "OutOfMemoryError" in (once.retried or "")
    assert always.status is Status.ERROR and "run 2" in "\n".join(always.messages)
    assert "run 1" in (always.retried or "") and "run alone" in always.messages[-1]
    assert healthy.status is Status.PASS and healthy.retried is None
    assert all(o.estimate_bytes == estimate(CASE).total for o in outcomes.values())


def test_a_case_out_of_memory_alone_is_not_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(ATTEMPTS_DIR_VAR, str(tmp_path / "attempts"))
    summary = sweep(
        [CASE.replace(seed=OOM_ONCE_SEED)], backend=BACKEND, mode=MODE, out_dir=tmp_path, jobs=1
    )
    (outcome,) = summary.outcomes
    assert outcome.status is Status.ERROR and "OutOfMemoryError" in outcome.summary
    assert outcome.retried is None and len(list((tmp_path / "attempts").iterdir())) == 1
    data = json.loads((tmp_path / "summary.json").read_text())["cases"][0]
    assert data["retried"] is None and data["estimate_bytes"] == estimate(CASE).total
    # no GPU here: nothing measured, nothing made up
    assert data["peak_gpu_bytes"] is None and data["peak_allocated_bytes"] is None


def test_a_workers_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "3", "MOE_VERIFY_CACHE_DIR": str(tmp_path)}
    env = sweep_pool.worker_environment(tmp_path / "w", "1", 4, base)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["PATH"] == "/bin"
    assert env["OMP_NUM_THREADS"] == "3" and env["OPENBLAS_NUM_THREADS"] == "4"
    assert env["MOE_VERIFY_BREADCRUMB"] == str(tmp_path / "w" / sweep_pool.BREADCRUMB)
    assert env["DG_JIT_CACHE_DIR"] == str(tmp_path / "deep_gemm")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    alone = sweep_pool.worker_environment(tmp_path / "w", None, 1, {"PATH": "/bin"})
    assert "CUDA_VISIBLE_DEVICES" not in alone and "OMP_NUM_THREADS" not in alone
    assert "DG_JIT_CACHE_DIR" not in base  # the base is not changed


def test_the_shared_jit_caches_keep_what_is_set(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path), "TRITON_CACHE_DIR": "/mine", "DG_JIT_CACHE_DIR": ""}
    got = jit_cache.shared_jit_caches(env)
    root = tmp_path / "moe-verify" / "jit"
    assert got == {
        "DG_JIT_CACHE_DIR": str(root / "deep_gemm"),
        "TRITON_CACHE_DIR": "/mine",
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
    }
    assert {k: env[k] for k in got} == got and root.is_dir()
    home = jit_cache.cache_root({})
    assert home == Path("~/.cache/moe-verify/jit").expanduser()


def test_no_shared_jit_caches_where_the_root_cannot_be_made(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {"MOE_VERIFY_CACHE_DIR": str(blocker / "jit"), "TRITON_CACHE_DIR": "/mine"}
    assert jit_cache.shared_jit_caches(env) == {"TRITON_CACHE_DIR": "/mine"}
    assert "DG_JIT_CACHE_DIR" not in env and "TORCHINDUCTOR_CACHE_DIR" not in env
