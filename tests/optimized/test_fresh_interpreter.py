"""`import optimized` prepares Triton by itself: a fresh Python on a CPU, with no conftest and no
TRITON_INTERPRET, verifies an OptimizedBackend subclass correctly (the interpreter's fp8 cast fix
installed) and still catches a subclass that gets quant_input wrong.

Before the setup moved into `optimized`, this script's correct subclass false-failed at
quant_input (-128 vs -64, the interpreter's fp8 rounding), or every kernel refused CPU tensors.
When triton is imported first the interpreter can no longer be selected (triton.language's
helpers are already compiled-mode functions): kernels then refuse CPU tensors and say why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300

SCRIPT = textwrap.dedent(
    """
    import json
    import os
    import sys

    import torch

    assert "TRITON_INTERPRET" not in os.environ
    # The harness first, as a user would write it: it must not import triton before optimized.
    from moe_verify import MoEProblem, verify

    import optimized


    class MyKernels(optimized.OptimizedBackend):
        \"\"\"A user's own permute (here the inherited one); every other stage inherited.\"\"\"

        name = "my-kernels"

        def permute(self, ctx):
            return super().permute(ctx)


    class FlipsOneCode(optimized.OptimizedBackend):
        \"\"\"quant_input with one fp8 code off by one unit in the last place.\"\"\"

        name = "flips-one-code"

        def quant_input(self, ctx):
            out = super().quant_input(ctx)
            a1q = out["a1q"].clone()
            a1q.view(torch.uint8)[0, 0] ^= 1
            return {**out, "a1q": a1q}


    problem = MoEProblem(
        tokens=8, hidden=128, intermediate=128, num_experts=4, topk=2, alignment=32
    )
    good = verify(problem, backend=MyKernels())
    bad = verify(problem, backend=FlipsOneCode())
    import triton.runtime.interpreter as interp

    print(json.dumps({
        "interpret": os.environ.get("TRITON_INTERPRET"),
        "fix_installed": type(interp._convert_float).__name__ == "_TorchConvertFloat",
        "good_passed": good.passed,
        "good": good.summary_line(),
        "bad_first_failure": bad.first_failure,
        "bad": bad.summary_line(),
    }))
    """
)


TRITON_FIRST = textwrap.dedent(
    """
    import torch
    import triton

    import optimized
    from moe_verify.spec import ScaleFmt
    from optimized.kernels import quant
    from optimized.kernels._validate import InvalidKernelInput

    try:
        quant.quantize_fp8_groups(torch.ones(1, 128), 128, ScaleFmt.FLOAT32)
    except InvalidKernelInput as exc:
        print(exc)
    """
)


def _fresh_python(script: str) -> str:
    """stdout of `script` in a new interpreter: no conftest, no TRITON_INTERPRET."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter is set up only on a machine without a GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def fresh_run() -> dict[str, object]:
    return json.loads(_fresh_python(SCRIPT).strip().splitlines()[-1])


def test_import_optimized_selects_the_interpreter_and_the_fix(
    fresh_run: dict[str, object],
) -> None:
    assert fresh_run["interpret"] == "1" and fresh_run["fix_installed"]


def test_a_correct_subclass_passes(fresh_run: dict[str, object]) -> None:
    assert fresh_run["good_passed"], fresh_run["good"]


def test_a_wrong_subclass_fails_at_its_stage(fresh_run: dict[str, object]) -> None:
    assert fresh_run["bad_first_failure"] == "quant_input", fresh_run["bad"]


def test_triton_imported_first_is_refused_with_the_reason() -> None:
    said = _fresh_python(TRITON_FIRST)
    assert "x is on cpu" in said and "before triton is first imported" in said, said
