"""`moe-verify engines --run`: every release of an engine's window, checked in this environment.

For each release: the release installed here is used as it is; any other is installed with
`pip install --no-deps --target <cache>/<engine>-<release>` (kept for the next run) over this
environment's dependencies and put first on PYTHONPATH in a child process, so its package and its
dist-info are the ones the adapter reads. The child first says what it loaded (`moe-verify engines
ENGINE --json`: it must be that release, admitted on its evidence, with the opt-in variable
removed), then runs the engine's checks as a sweep (`moe-verify sweep --preset engine-ENGINE
--backend ENGINE`, moe_verify/engines/checks.py), and the sweep's summary.json is judged against
what each stage must do. One verdict line per release.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from moe_verify.engines import checks
from moe_verify.engines.window import here, window

# The lines of a failing child's output a verdict quotes.
TAIL_LINES = 5


@dataclass(frozen=True)
class Verdict:
    engine: str
    release: str
    passed: bool
    detail: str
    seconds: float

    def line(self) -> str:
        word = "PASS" if self.passed else "FAIL"
        return f"{word} {self.engine} {self.release}: {self.detail} ({self.seconds:.0f} s)"


def run_windows(keys: list[str], cache: Path, out: Path, jobs: int | None = None) -> list[Verdict]:
    """Check every release of each engine's window; print a verdict line as each finishes."""
    verdicts = []
    for key in keys:
        installed = here(key).installed
        for release in window(key).releases():
            verdict = check_release(key, release, cache, out, jobs, in_place=release == installed)
            print(verdict.line(), flush=True)
            verdicts.append(verdict)
    return verdicts


def check_release(
    key: str, release: str, cache: Path, out: Path, jobs: int | None, in_place: bool
) -> Verdict:
    """One release: installed (unless `in_place`), loaded in a child, its checks judged."""
    start = time.monotonic()
    engine = window(key).engine

    def verdict(passed: bool, detail: str) -> Verdict:
        return Verdict(engine, release, passed, detail, time.monotonic() - start)

    target = None
    if not in_place:
        try:
            target = install(key, release, cache)
        except RuntimeError as exc:
            return verdict(False, str(exc))
    env = child_env(target, window(key).untested_env)
    loaded = _child([sys.executable, "-m", "moe_verify.cli", "engines", key, "--json"], env)
    if loaded.returncode:
        return verdict(False, f"`moe-verify engines {key}` failed: {_tail(loaded)}")
    seen = json.loads(loaded.stdout)[key]
    if seen["installed"] != release:
        return verdict(False, f"the child loaded {engine} {seen['installed']}, not {release}")
    if not seen["admitted"]:
        return verdict(False, f"refused: {seen['detail']}")
    where = out / f"{key}-{release}"
    sweep = [
        *(sys.executable, "-m", "moe_verify.cli", "sweep", "--preset", f"engine-{key}"),
        *("--backend", key, "--mode", "both", "--out", str(where)),
        *(("--jobs", str(jobs)) if jobs else ()),
    ]
    ran = _child(sweep, env)
    summary_path = where / "summary.json"
    if not summary_path.is_file():
        return verdict(False, f"the sweep wrote no summary (exit {ran.returncode}): {_tail(ran)}")
    problems = checks.judge(key, json.loads(summary_path.read_text()))
    if problems:
        return verdict(False, f"{'; '.join(problems)} (summaries in {where})")
    cases = len(checks.CHECKS[key].cases)
    return verdict(True, f"{seen['detail']}; {cases} cases as recorded")


def install(key: str, release: str, cache: Path) -> Path:
    """`<cache>/<key>-<release>`, holding the release installed --no-deps (done once)."""
    target = cache / f"{key}-{release}"
    if _holds(target, key, release):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-{release}-", dir=cache))
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target"]
    done = _child([*pip, str(staging), f"{key}=={release}"], dict(os.environ))
    if done.returncode or not _holds(staging, key, release):
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"pip install --no-deps {key}=={release} failed: {_tail(done)}")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def _holds(target: Path, key: str, release: str) -> bool:
    """`target` has the distribution `key` at `release`."""
    if not target.is_dir():
        return False
    return any(
        (d.metadata["Name"] or "").lower() == key and d.version == release
        for d in metadata.distributions(path=[str(target)])
    )


def child_env(target: Path | None, untested_env: str) -> dict[str, str]:
    """This environment, with `target` first on PYTHONPATH and the opt-in removed (a release of
    the window must be admitted on its evidence)."""
    env = {k: v for k, v in os.environ.items() if k != untested_env}
    if target is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH")) if p)
    return env


def _child(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, check=False)


def _tail(done: subprocess.CompletedProcess[str]) -> str:
    lines = (done.stderr or done.stdout or "").strip().splitlines()
    return " | ".join(lines[-TAIL_LINES:]) or f"exit {done.returncode}"
