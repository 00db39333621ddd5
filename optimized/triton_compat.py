"""A correct float downcast for the Triton CPU interpreter (TRITON_INTERPRET=1).

The interpreter's `_convert_float` (triton/runtime/interpreter.py) rounds a downcast by adding the
cut-off bit (not ties-to-even) and ORs a mantissa overflow into the exponent field instead of
carrying it, so e.g. -124.12 -> e4m3 gives -64 instead of -128. Its fp32 -> bf16 path (rounding
mode None) truncates. On GPUs these casts are RNE, saturating for e4m3 (`cvt.rn.satfinite`). This
module replaces the downcasts we use with torch's conversions (RNE), so kernels under the
interpreter produce the codes the GPU would, and the float upcasts too (the interpreter's own
flushes bf16 subnormals and decodes e4m3 NaN as a number; torch's are exact). Other conversions
keep the interpreter's own code.
The replaced function stays reachable (`unpatched_convert_float`), so a test can show it is wrong.

`prepare_interpreter` is the one setup: without a GPU it selects the interpreter and installs the
fix. `optimized/__init__` calls it before any kernel module is imported, so every way into the
optimized kernels (the CLI, `verify`, a user's `OptimizedBackend` subclass) gets it.

`torch_exp_in_interpreter` is separate and opt-in: the interpreter evaluates `tl.exp` with numpy's
float32 exp (up to ~2.4 ulp; about 40% of results differ from torch's), while the golden uses
torch.exp. Neither is the GPU's `ex2.approx`-based `tl.exp`, so this is not a correctness fix: it
lets a test check a kernel's rounding recipe bit for bit against the golden with the exp
approximation held equal (the policy bounds what a different exp does, ref §5.3).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator

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


def _convert_float_via_torch(data: np.ndarray, src: torch.dtype, dst: torch.dtype) -> np.ndarray:
    """Bit patterns of `src` (unsigned ints) -> bit patterns of `dst`, rounded to nearest even."""
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


def interpreter_mode() -> bool:
    """True when Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def prepare_interpreter() -> bool:
    """Without a GPU, run Triton kernels under its interpreter, with the correct float casts.

    Idempotent; returns whether kernels run interpreted. TRITON_INTERPRET must be set before
    triton is first imported: triton.language's own helpers (`tl.max`, ...) are `@triton.jit`
    functions decorated at that import, and the interpreter cannot call compiled-mode ones
    ("Cannot call @triton.jit'd outside of the scope of a kernel"). `optimized/__init__` calls
    this, and Python imports the package before any of its modules. When triton came first, or
    TRITON_INTERPRET is set explicitly (e.g. 0 on a CPU), it is left alone: kernel wrappers then
    refuse CPU tensors and say why.
    """
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not interpreter_mode():
        return False
    install_interpreter_fp8_fix()
    return True


class _TorchConvertFloat:
    """The interpreter's `_convert_float` with float down- and upcasts done by torch (RNE)."""

    def __init__(self, original: Callable[..., np.ndarray], rtz: object) -> None:
        self.original = original
        self.rtz = rtz

    def __call__(
        self, input: np.ndarray, input_dtype: object, output_dtype: object, rounding_mode: object
    ) -> np.ndarray:
        src = _torch_dtype_for(input_dtype)
        dst = _torch_dtype_for(output_dtype)
        if src is not None and dst is not None:
            if dst.itemsize < src.itemsize and rounding_mode != self.rtz:
                return _convert_float_via_torch(input, src, dst)
            if dst.itemsize > src.itemsize:
                # Upcasts are exact; torch's also decode e4m3 NaN (0x7f/0xff) correctly.
                return _convert_float_via_torch(input, src, dst)
        return self.original(input, input_dtype, output_dtype, rounding_mode)


def install_interpreter_fp8_fix() -> None:
    """Patch the interpreter's float downcast (idempotent). Call before running kernels."""
    import triton.runtime.interpreter as interp

    if isinstance(interp._convert_float, _TorchConvertFloat):
        return
    interp._convert_float = _TorchConvertFloat(interp._convert_float, interp._ir.ROUNDING_MODE.RTZ)


def unpatched_convert_float() -> Callable[..., np.ndarray]:
    """The interpreter's own `_convert_float` (the one `install_interpreter_fp8_fix` replaced)."""
    import triton.runtime.interpreter as interp

    current = interp._convert_float
    return current.original if isinstance(current, _TorchConvertFloat) else current


@contextlib.contextmanager
def torch_exp_in_interpreter() -> Iterator[None]:
    """Within the block, interpreted `tl.exp` on fp32/fp64 is torch.exp (the golden's exp)."""
    import triton.runtime.interpreter as interp

    builder = interp.InterpreterBuilder
    numpy_exp = builder.create_exp

    def create_exp(
        self: interp.InterpreterBuilder, arg: interp.TensorHandle
    ) -> interp.TensorHandle:
        data = arg.data
        if data.dtype not in (np.float32, np.float64):
            return numpy_exp(self, arg)
        out = torch.exp(torch.from_numpy(np.ascontiguousarray(data))).numpy()
        return interp.TensorHandle(out.reshape(data.shape), arg.dtype.scalar)

    builder.create_exp = create_exp
    try:
        yield
    finally:
        builder.create_exp = numpy_exp
