"""Bits recorded from the hardware, so the CPU tier can hold the golden's hardware recipes to them.

On SM90 two steps of the layer are not IEEE arithmetic, and both are reproducible: DeepGEMM's FP8
GEMM (the tensor core's block accumulation, docs/tensor-core.md) and act_quant's gate (tl.exp and
an approximate division, a function of one bf16 value). This module records each on a GPU:

- `record_gemm_vectors`: DeepGEMM's grouped GEMMs, contiguous (m_indices with -1 padding) and
  masked, on small fixed operands that reach the model's edges (rows spanning 2^-14..2^8, exact
  zeros, subnormal e4m3 codes, one dominant term among tiny ones, a row of zeros, cancelling
  pairs), for both SM90 scale formats. The operands are generated on the CPU from a fixed seed
  and stored with the output bits, so a replay needs no RNG agreement across machines.
- `record_gate_tables`: the act_quant kernel's gate for all 65,536 bf16 inputs, per alpha
  (optimized.kernels.act_quant.gate_table).
- `record_quotient_tables`: other engines' approximate steps, each a function of one bf16 value
  (reference/hardware/quotient_table.py): Triton's fp32 `448 / v` (div.full.f32, LMDeploy's
  quantizer), the same quotient and silu's `v / (1 + expf(-v))` as nvcc compiles them with
  `--use_fast_math` (SGLang's JIT CUDA quantizer and activation), for every bf16 v and the
  quantizers' amax floors.

Each file carries the GPU, the driver's CUDA, torch, Triton and DeepGEMM versions and the date in
its metadata (the quotient file also nvcc's). `python -m moe_verify.hw_vectors OUT_DIR` writes the
three files.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_verify.spec import QuantizedWeight, ScaleFmt, compute_capability, round_up
from reference.formats import quantize_fp8_blocks, quantize_fp8_groups
from reference.hardware.gate_table import GATE_FILE, every_bf16, gate_key
from reference.hardware.quotient_table import FLOORS, QUOTIENT_FILE, TABLES

GEMM_FILE = "sm90_deepgemm_gemm.safetensors"
SEED = 20261201
FORMATS = (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0)
ALPHAS = (1.0, 1.702)  # silu; gpt-oss's swigluoai
ALIGNMENT = 128  # DeepGEMM's contiguous-layout alignment on SM90 (BLOCK_M)


@dataclass(frozen=True)
class GemmShape:
    """One recorded GEMM: N, K and the live rows of each expert (segment or batch)."""

    layout: str  # "contiguous" or "masked"
    n: int
    k: int
    rows: tuple[int, ...]


SHAPES = (
    GemmShape("contiguous", n=256, k=384, rows=(72, 20, 128)),
    GemmShape("masked", n=256, k=384, rows=(100, 37)),
)


def _edge_rows(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 [rows, k]: random values with the model's edges planted (docstring of the module)."""
    x = torch.randn(rows, k, generator=gen)
    x *= torch.pow(2.0, torch.randint(-14, 9, (rows, 1), generator=gen).float())
    x[torch.rand(rows, k, generator=gen) < 0.05] = 0.0
    # Within a 128-group, values 2^-12 below the amax quantize to subnormal e4m3 codes.
    tiny = torch.rand(rows, k, generator=gen) < 0.1
    x[tiny] *= 2.0**-12
    if rows > 4:
        x[1] = 0.0  # a row of zeros: every chunk's sum is +0
        x[2] *= 2.0**-10
        x[2, 5] = 300.0  # one dominant term: the others are truncated against its exponent
        half = k // 2
        x[3, half:] = -x[3, :half]  # cancelling halves
    return x


def gemm_operands(shape: GemmShape, fmt: ScaleFmt) -> dict[str, torch.Tensor]:
    """The CPU operands of one recorded GEMM: a, a_scale, b, b_scale and m_indices (contiguous)
    or masked_m (masked)."""
    gen = torch.Generator().manual_seed(SEED + 7 * SHAPES.index(shape))
    experts = len(shape.rows)
    w = torch.randn(experts, shape.n, shape.k, generator=gen)
    w *= torch.pow(2.0, torch.randint(-6, 3, (experts, 1, 1), generator=gen).float())
    b, b_scale = quantize_fp8_blocks(w, (128, 128), use_ue8m0=fmt.is_ue8m0)
    out: dict[str, torch.Tensor] = {"b": b, "b_scale": b_scale}
    if shape.layout == "contiguous":
        segments = [round_up(r, ALIGNMENT) for r in shape.rows]
        x = _edge_rows(sum(segments), shape.k, gen)
        m_indices = torch.full((sum(segments),), -1, dtype=torch.int32)
        start = 0
        for e, (live, seg) in enumerate(zip(shape.rows, segments, strict=True)):
            m_indices[start : start + live] = e
            x[start + live : start + seg] = 0.0  # padding rows hold zeros, as a fresh scatter
            start += seg
        out["m_indices"] = m_indices
    else:
        max_m = round_up(max(shape.rows), ALIGNMENT)
        x = _edge_rows(experts * max_m, shape.k, gen).view(experts, max_m, shape.k)
        for e, live in enumerate(shape.rows):
            x[e, live:] = 0.0
        out["masked_m"] = torch.tensor(shape.rows, dtype=torch.int32)
    a, a_scale = quantize_fp8_groups(x, 128, fmt)
    out.update(a=a, a_scale=a_scale)
    return out


def run_deepgemm(shape: GemmShape, ops: dict[str, torch.Tensor]) -> torch.Tensor:
    """`shape`'s GEMM through DeepGEMM on this GPU: bf16 output on the CPU."""
    from optimized import deepgemm

    dev = {k: v.cuda() for k, v in ops.items()}
    w = QuantizedWeight(dev["b"], dev["b_scale"], (128, 128))
    w_scale = deepgemm.prepare_weight_scales(w, use_ue8m0=False)
    if shape.layout == "contiguous":
        d = deepgemm.m_grouped_gemm(
            dev["a"], dev["a_scale"], 128, w, w_scale, dev["m_indices"], ALIGNMENT,
            use_ue8m0=False,
        )  # fmt: skip
    else:
        expected_m = max(1, int(dev["masked_m"].float().mean()))
        d = deepgemm.m_grouped_gemm_masked(
            dev["a"], dev["a_scale"], w, w_scale, dev["masked_m"], expected_m, use_ue8m0=False
        )
    torch.cuda.synchronize()
    return d.cpu()


def _as_stored(x: torch.Tensor) -> torch.Tensor:
    """fp8 as its bytes (uint8), the rest as is: readable by any safetensors version."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x.contiguous()


def versions() -> dict[str, str]:
    """Where these bits come from."""
    import triton

    from optimized import deepgemm

    status = deepgemm.probe()
    return {
        "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, compute_capability() or ())),
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "deep_gemm": f"{status.version} ({status.source})"
        if status.usable
        else f"unavailable: {status.reason}",
        "date": datetime.date.today().isoformat(),
    }


def record_gemm_vectors(path: Path) -> int:
    """Run every `SHAPES` x `FORMATS` GEMM through DeepGEMM here and write operands and outputs;
    returns the number of GEMMs recorded."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for shape in SHAPES:
        for fmt in FORMATS:
            ops = gemm_operands(shape, fmt)
            ops["out"] = run_deepgemm(shape, ops)
            for name, x in ops.items():
                tensors[f"{shape.layout}.{fmt}.{name}"] = _as_stored(x)
    save_file(tensors, str(path), metadata=versions())
    return len(SHAPES) * len(FORMATS)


def load_gemm_vectors(path: Path) -> dict[tuple[str, ScaleFmt], dict[str, torch.Tensor]]:
    """(layout, scale format) -> the recorded operands and `out` (fp8 restored from bytes)."""
    from safetensors.torch import load_file

    flat = load_file(str(path))
    out: dict[tuple[str, ScaleFmt], dict[str, torch.Tensor]] = {}
    for key, x in flat.items():
        layout, fmt, name = key.split(".")
        if name in ("a", "b"):
            x = x.view(torch.float8_e4m3fn)
        out.setdefault((layout, ScaleFmt(fmt)), {})[name] = x
    return out


def record_gate_tables(path: Path) -> int:
    """The act_quant kernel's gate for every bf16 input at each of `ALPHAS`; returns the count."""
    from safetensors.torch import save_file

    from optimized.kernels.act_quant import gate_table

    tables = {gate_key(alpha): gate_table(alpha, "cuda").cpu() for alpha in ALPHAS}
    torch.cuda.synchronize()
    save_file(tables, str(path), metadata=versions())
    return len(tables)


# The engines' own expressions, compiled with the flags their JIT builds pass (SGLang 0.5.23:
# `--use_fast_math` for per_token_group_quant.cuh and activation.cuh), one thread per input.
_FAST_MATH_SOURCE = r"""
extern "C" __global__ void fast_math_kernel(const float* v, float* quotient, float* silu, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float kMaxValue = 448.0f;
  quotient[i] = kMaxValue / v[i];             // per_token_group_quant.cuh: kMaxValue / amax
  silu[i] = v[i] / (1.0f + expf(-v[i]));      // activation.cuh: apply_activation_f32<kSiLU>
}
extern "C" int fast_math(const float* v, float* quotient, float* silu, int n) {
  fast_math_kernel<<<(n + 255) / 256, 256>>>(v, quotient, silu, n);
  return (int)cudaDeviceSynchronize();
}
"""


def _nvcc() -> str:
    import os

    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return str(Path(home) / "bin" / "nvcc")


def _cuda_fast_math(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(448 / v, v / (1 + expf(-v)), nvcc's version) as nvcc --use_fast_math compiles them."""
    with tempfile.TemporaryDirectory(prefix="moe-verify-fast-math-") as tmp:
        src, lib = Path(tmp) / "fast_math.cu", Path(tmp) / "fast_math.so"
        src.write_text(_FAST_MATH_SOURCE)
        major, minor = compute_capability() or (9, 0)
        arch = f"sm_{major}{minor}"
        cmd = [_nvcc(), "-O3", "--use_fast_math", f"-arch={arch}", "-shared", "-Xcompiler",
               "-fPIC", "-o", str(lib), str(src)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        version = subprocess.run([_nvcc(), "--version"], capture_output=True, text=True).stdout
        quotient, silu = torch.empty_like(v), torch.empty_like(v)
        torch.cuda.synchronize()
        rc = ctypes.CDLL(str(lib)).fast_math(
            ctypes.c_void_p(v.data_ptr()), ctypes.c_void_p(quotient.data_ptr()),
            ctypes.c_void_p(silu.data_ptr()), ctypes.c_int(v.numel()),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"the fast-math kernel failed: cudaError {rc}")
    release = version.strip().splitlines()[-1] if version.strip() else "unknown"
    return quotient, silu, release


def record_quotient_tables(path: Path) -> int:
    """Every table of reference/hardware/quotient_table.py `TABLES`, for all bf16 inputs and
    `FLOORS`; returns the number of tables."""
    from safetensors.torch import save_file

    from optimized.kernels.quant import triton_quotient

    v = torch.cat([every_bf16("cuda"), torch.tensor(FLOORS, device="cuda")])
    cuda_quotient, cuda_silu, nvcc = _cuda_fast_math(v)
    computed = {
        "quotient_448_triton": triton_quotient(448.0, v),
        "quotient_448_cuda_fast_math": cuda_quotient,
        "silu_cuda_fast_math": cuda_silu,
    }
    if set(computed) != set(TABLES):
        raise AssertionError(f"recorded {sorted(computed)}, the reader expects {sorted(TABLES)}")
    torch.cuda.synchronize()
    tables = {name: t.cpu() for name, t in computed.items()}
    tables["floors"] = torch.tensor(FLOORS, dtype=torch.float32)
    save_file(tables, str(path), metadata={**versions(), "nvcc": nvcc})
    return len(computed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for the two safetensors files")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("recording hardware bits needs a GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    n = record_gate_tables(args.out / GATE_FILE)
    print(f"{n} gate tables -> {args.out / GATE_FILE}")
    n = record_quotient_tables(args.out / QUOTIENT_FILE)
    print(f"{n} quotient tables -> {args.out / QUOTIENT_FILE}")
    n = record_gemm_vectors(args.out / GEMM_FILE)
    print(f"{n} DeepGEMM GEMMs -> {args.out / GEMM_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
