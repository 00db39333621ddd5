"""SM90 tier: the bits recorded from the hardware still describe this machine.

reference/data/sm90_quotient.safetensors (other engines' approximate 448 / amax and silu) too.

reference/data/sm90_triton_gate.safetensors (the act_quant gate for every bf16 input) and
tests/reference/data/sm90_deepgemm_gemm.safetensors (DeepGEMM's GEMM outputs) were recorded on an
H200 (moe_verify/hw_vectors.py). Here they are recorded again, in memory, and compared bit for
bit. A Triton or DeepGEMM upgrade that changes the lowering fails here, naming the versions on
both sides, before the golden's hardware recipes silently stop matching the kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_verify import hw_vectors

pytestmark = pytest.mark.sm90

ROOT = Path(__file__).resolve().parents[2]
GATES = ROOT / "reference" / "data" / hw_vectors.GATE_FILE
GEMMS = ROOT / "tests" / "reference" / "data" / hw_vectors.GEMM_FILE


def _recorded_with(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return ", ".join(f"{k} {meta.get(k)}" for k in ("gpu", "triton", "deep_gemm", "torch"))


def _here() -> str:
    v = hw_vectors.versions()
    return ", ".join(f"{k} {v[k]}" for k in ("gpu", "triton", "deep_gemm", "torch"))


@pytest.mark.parametrize("alpha", hw_vectors.ALPHAS)
def test_the_gate_table_is_this_machines(alpha: float) -> None:
    from safetensors.torch import load_file

    from optimized.kernels.act_quant import gate_table

    stored = load_file(str(GATES))[hw_vectors.gate_key(alpha)]
    fresh = gate_table(alpha, "cuda").cpu()
    differ = fresh.view(torch.int32) != stored.view(torch.int32)
    assert not bool(differ.any()), (
        f"alpha={alpha}: {int(differ.sum())} of {differ.numel()} gate values differ from the "
        f"recorded table (recorded with {_recorded_with(GATES)}; here {_here()}): record it "
        "again with `python -m moe_verify.hw_vectors DIR`"
    )


@pytest.mark.parametrize("shape", hw_vectors.SHAPES, ids=lambda s: s.layout)
@pytest.mark.parametrize("fmt", hw_vectors.FORMATS, ids=str)
def test_deepgemm_still_computes_the_recorded_bits(shape: hw_vectors.GemmShape, fmt) -> None:
    from moe_verify.hw_vectors import gemm_operands, load_gemm_vectors, run_deepgemm

    stored = load_gemm_vectors(GEMMS)[(shape.layout, fmt)]["out"]
    fresh = run_deepgemm(shape, gemm_operands(shape, fmt))
    if shape.layout == "contiguous":
        live = gemm_operands(shape, fmt)["m_indices"] >= 0
    else:
        rows = torch.arange(fresh.shape[1])[None, :]
        live = rows < torch.tensor(shape.rows)[:, None]
    differ = fresh[live].view(torch.int16) != stored[live].view(torch.int16)
    assert not bool(differ.any()), (
        f"{shape.layout} {fmt}: {int(differ.sum())} of {differ.numel()} live outputs differ from "
        f"the recorded ones (recorded with {_recorded_with(GEMMS)}; here {_here()})"
    )


def test_the_quotient_tables_are_this_machines(tmp_path: Path) -> None:
    """Triton's and nvcc --use_fast_math's 448 / v and SGLang's fast-math silu
    (reference/hardware/quotient_table.py), recorded again here (nvcc compiles the snippet)."""
    from safetensors.torch import load_file

    from reference.hardware.quotient_table import QUOTIENT_FILE, TABLES

    stored_path = ROOT / "reference" / "data" / QUOTIENT_FILE
    fresh_path = tmp_path / QUOTIENT_FILE
    hw_vectors.record_quotient_tables(fresh_path)
    stored, fresh = load_file(str(stored_path)), load_file(str(fresh_path))
    for name in TABLES:
        differ = fresh[name].view(torch.int32) != stored[name].view(torch.int32)
        assert not bool(differ.any()), (
            f"{name}: {int(differ.sum())} of {differ.numel()} values differ from the recorded "
            f"table (recorded with {_recorded_with(stored_path)}; here {_here()}): record it "
            "again with `python -m moe_verify.hw_vectors DIR`"
        )
