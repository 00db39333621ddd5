"""Run a `moe-verify repro` script as a user would, without moe-verify: from a directory outside
the repository, under blocked_runner.py (the project's packages unimportable), with PYTHONPATH
cleared, optionally pointed at a kernel of correct_kernels.py instead of the engine's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TIMEOUT_S = 600


def run_script(
    script: Path, kernel: str | None = None, *args: str
) -> subprocess.CompletedProcess[str]:
    """`python repro.py [--kernel correct_kernels:NAME] [ARGS]` under the blocked runner, in a
    scratch directory beside the script; stdout and stderr together in `.stdout`."""
    env_dir = script.parent / "standalone-env"
    env_dir.mkdir(exist_ok=True)
    assert REPO not in env_dir.resolve().parents, f"{env_dir} is inside the repository"
    for name in ("blocked_runner.py", "correct_kernels.py"):
        shutil.copy(HERE / name, env_dir / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    cmd = [sys.executable, str(env_dir / "blocked_runner.py"), str(script)]
    if kernel is not None:
        cmd += ["--kernel", f"correct_kernels:{kernel}"]
    cmd += args
    return subprocess.run(
        cmd,
        cwd=env_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
    )
