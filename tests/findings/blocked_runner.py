"""Run a `moe-verify repro` script where moe-verify cannot be imported.

    python blocked_runner.py SCRIPT [SCRIPT ARGS...]

The project's packages (and its tests) are set to None in sys.modules, so any import of them,
however indirect, raises ImportError: the script must run on torch, safetensors and the engine
alone. This file's own directory is on sys.path (Python puts it there), so a module written
beside it can stand in for the engine's kernel (`--kernel module:function`). The script's forked
child processes inherit the same sys.modules; a spawned one (`--spawn`, or any on a GPU) starts a
fresh interpreter, which this runner does not reach.
"""

import runpy
import sys

BLOCKED = ("moe_verify", "reference", "optimized", "tolerance", "tests")

for name in BLOCKED:
    sys.modules[name] = None  # type: ignore[assignment]

script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
