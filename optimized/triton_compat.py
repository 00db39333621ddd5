"""A correct float downcast for the Triton CPU interpreter (TRITON_INTERPRET=1).

The interpreter's `_convert_float` (triton/runtime/interpreter.py) rounds a downcast by adding the
cut-off bit (not ties-to-even) and ORs a mantissa overflow into the exponent field instead of
carrying it, so e.g. -124.12 -> e4m3 gives -64 instead of -128. Its fp32 -> bf16 path (rounding
mode None) truncates. On GPUs these casts are RNE, saturating for e4m3 (`cvt.rn.satfinite`). This
module replaces the downcasts we use with torch's conversions (RNE), so kernels under the
interpreter produce the codes the GPU would. Other conversions keep the interpreter's own code.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

_FP8_E4M3_MAX = 448.0


@functools.cache
def _torch_dtype_for(tl_dtype: object) -> torch.dtype | None:
    import triton.language as tl

    table = {
        tl.float32: torch.float32,
        tl.bfloat16: torch.bfloat16,
        tl.float16: torch.float16,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
    }
    return table.get(tl_dtype)


def _convert_float_via_torch(
    data: np.ndarray, src: torch.dtype, dst: torch.dtype
) -> np.ndarray:
    """Bit patterns of `src` (as unsigned ints) -> bit patterns of `dst`, rounded to nearest even."""
    bits = torch.from_numpy(np.ascontiguousarray(data).view(f"uint{src.itemsize * 8}").copy())
    signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[src.itemsize]
    value = bits.view(signed).view(src).to(torch.float32)
    if dst == torch.float8_e4m3fn:
        # Hardware converts with satfinite: finite overflow clamps to +-448, NaN stays NaN.
        value = torch.where(value.isnan(), value, value.clamp(-_FP8_E4M3_MAX, _FP8_E4M3_MAX))
    out = value.to(dst)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[dst.itemsize]
    signed_out = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dst.itemsize]
    return out.view(signed_out).numpy().view(unsigned).reshape(data.shape)


def install_interpreter_fp8_fix() -> None:
    """Patch the interpreter's float downcast (idempotent). Call before running kernels."""
    import triton.runtime.interpreter as interp

    if getattr(interp._convert_float, "_moe_verify_fixed", False):
        return
    original = interp._convert_float
    rtz = interp._ir.ROUNDING_MODE.RTZ

    def convert_float(input, input_dtype, output_dtype, rounding_mode):  # type: ignore[no-untyped-def]
        src = _torch_dtype_for(input_dtype)
        dst = _torch_dtype_for(output_dtype)
        downcast = src is not None and dst is not None and dst.itemsize < src.itemsize
        if downcast and rounding_mode != rtz:
            return _convert_float_via_torch(input, src, dst)
        if src is not None and dst is not None and dst.itemsize > src.itemsize:
            # Upcasts are exact; torch's also decode e4m3 NaN (0x7f/0xff) correctly.
            return _convert_float_via_torch(input, src, dst)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert_float._moe_verify_fixed = True  # type: ignore[attr-defined]
    interp._convert_float = convert_float
