"""Correct float casts and bf16 arithmetic for the Triton CPU interpreter (TRITON_INTERPRET=1).

The interpreter's `_convert_float` (triton/runtime/interpreter.py) rounds a downcast by adding the
cut-off bit (not ties-to-even) and ORs a mantissa overflow into the exponent field instead of
carrying it, so e.g. -124.12 -> e4m3 gives -64 instead of -128. Its fp32 -> bf16 path (rounding
mode None) truncates. On GPUs these casts are RNE, saturating for e4m3 (`cvt.rn.satfinite`). This
module replaces the downcasts we use with torch's conversions (RNE), so kernels under the
interpreter produce the codes the GPU would, and the float upcasts too (the interpreter's own
flushes bf16 subnormals and decodes e4m3 NaN as a number; torch's are exact). Other conversions
keep the interpreter's own code.
The replaced function stays reachable (`unpatched_convert_float`), so a test can show it is wrong.

The interpreter also computes bf16 arithmetic on the uint16 bit patterns it stores bf16 in (a
kernel's bf16 `silu_out * up` gives garbage). `install_interpreter_bf16_fix` makes each entry that
does so decode to fp32, compute, and round back RNE once, the GPU's `mul.rn.bf16` result; see
"bf16 arithmetic" below for what is covered and why one fp32 op then RNE is correctly rounded.
`unpatched_bf16_arithmetic` runs a block on the interpreter's own code, so a test can show it is
wrong.

A GPU computes IEEE results silently: exp overflows to inf, a max over NaN is NaN. The
interpreter computes them with numpy, which says so on stderr ("overflow encountered in exp",
"All-NaN slice encountered") in the middle of a report whose NaN/Inf check already counts them.
`install_interpreter_quiet` runs each interpreted launch with those warnings off, and nothing else.

The CPU tier's time is the interpreter's own Python, not numpy's arithmetic (docs/ci.md "CPU main
tier time"). `install_interpreter_overhead_cuts` removes costs that compute nothing: every
call of a `@triton.jit` helper inside a kernel re-patched triton.language (inspect.getmembers over
it, ~0.4 ms, a fifth of a small verification), `_get_np_dtype` rebuilt a dict of 19 dtypes on
each of its tens of thousands of calls, and every op's result type re-derived the same shape
tuple, size and name. Every value a kernel computes stays the same.

`prepare_interpreter` is the one setup: without a GPU it selects the interpreter and installs the
fixes. `optimized/__init__` calls it before any kernel module is imported, so every way into the
optimized kernels (the CLI, `verify`, a user's `OptimizedBackend` subclass) gets it.

`torch_exp_in_interpreter` is separate and opt-in: the interpreter evaluates `tl.exp` with numpy's
float32 exp (up to ~2.4 ulp; about 40% of results differ from torch's), while the golden uses
torch.exp. Neither is the GPU's `ex2.approx`-based `tl.exp`, so this is not a correctness fix: it
lets a test check a kernel's rounding recipe bit for bit against the golden with the exp
approximation held equal (the policy bounds what a different exp does:
docs/tolerance.md#act_quant-codes-and-scales).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
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
    """Without a GPU, run Triton kernels under its interpreter, with correct float casts and bf16.

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
    install_interpreter_bf16_fix()
    install_interpreter_quiet()
    install_interpreter_overhead_cuts()
    return True


_QUIET_ORIGINAL = "_moe_verify_quiet_original"


@contextlib.contextmanager
def ieee_quiet() -> Iterator[None]:
    """Within the block, numpy computes inf and NaN without saying so (floating-point errors and
    its All-NaN reductions), as a GPU kernel does."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"All-NaN (slice|axis) encountered", RuntimeWarning)
        yield


def install_interpreter_quiet() -> None:
    """Run every interpreted kernel launch under `ieee_quiet` (idempotent)."""
    import triton.runtime.interpreter as interp

    launch = interp.GridExecutor.__dict__["__call__"]
    if hasattr(launch, _QUIET_ORIGINAL):
        return

    def quiet_launch(self: object, *args: object, **kwargs: object) -> object:
        with ieee_quiet():
            return launch(self, *args, **kwargs)

    setattr(quiet_launch, _QUIET_ORIGINAL, launch)
    interp.GridExecutor.__call__ = quiet_launch


@contextlib.contextmanager
def unquiet_interpreter() -> Iterator[None]:
    """Within the block, interpreted launches warn as numpy does (a test shows what is hidden)."""
    import triton.runtime.interpreter as interp

    quiet = interp.GridExecutor.__dict__["__call__"]
    interp.GridExecutor.__call__ = getattr(quiet, _QUIET_ORIGINAL, quiet)
    try:
        yield
    finally:
        interp.GridExecutor.__call__ = quiet


_OVERHEAD_ORIGINAL = "_moe_verify_overhead_original"


def install_interpreter_overhead_cuts() -> None:
    """Patch triton.language once per helper per launch, memoize `_get_np_dtype` and block types'
    derived fields (idempotent).

    Under the interpreter, `GridExecutor.__call__` patches triton.language for the launch (a
    scope it restores when the launch ends), and `InterpretedFunction.__call__`, a `@triton.jit`
    helper called from a kernel, patches it again on every call, into a scope nobody restores.
    Its second call in the same launch sets the same attributes to functions that do the same
    thing, so it is skipped: a helper is patched at its first call after each restore. A launch's
    own patch always runs (a restore ended the last one), and covers triton.language, which the
    interpreter's rewrite puts in every kernel's and helper's globals: so a helper whose globals
    gain it after its first call (at that rewrite) needs no second patch either. `_get_np_dtype`
    maps a dtype, or a block's element dtype, to a numpy dtype: its answer for a scalar dtype is
    cached. `block_type(element_ty, shape)`, built for nearly every op's result, derives its
    shape tuple, element count and name from str(element_ty) and the dims alone: for a list of
    ints they are computed once per (element type, dims) and shared (triton.language never
    changes a block type's shape in place; only the compiler's tuple assignment would).
    """
    import triton.language.core as core
    import triton.runtime.interpreter as interp

    if hasattr(interp._patch_lang, _OVERHEAD_ORIGINAL):
        return
    scope_type = interp._LangPatchScope
    restore = scope_type.restore
    patch_lang = interp._patch_lang
    get_np_dtype = interp._get_np_dtype
    generation = [0]  # restores so far: each ends a launch's patches
    patched_at: dict[object, int] = {}

    def counted_restore(self: object) -> None:
        generation[0] += 1
        restore(self)

    def patch_lang_once(fn: object) -> object:
        if patched_at.get(fn) == generation[0]:
            return scope_type()  # already patched since the last restore: nothing to change
        scope = patch_lang(fn)
        patched_at[fn] = generation[0]
        return scope

    np_dtypes: dict[object, np.dtype] = {}

    def cached_np_dtype(tt_dtype: object) -> np.dtype:
        import triton.language as tl

        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):  # unhashable; always uint64
            return get_np_dtype(scalar)
        found = np_dtypes.get(scalar)
        if found is None:
            found = np_dtypes[scalar] = get_np_dtype(scalar)
        return found

    block_init = core.block_type.__init__
    block_fields: dict[tuple[object, ...], tuple[object, object, str]] = {}

    def cached_block_type_init(self: object, element_ty: object, shape: object) -> None:
        dims = _int_dims(shape, core.constexpr)
        if dims is None:  # anything but a list of ints: the original, errors included
            block_init(self, element_ty, shape)
            return
        key = (str(element_ty), *dims)
        fields = block_fields.get(key)
        if fields is None:
            block_init(self, element_ty, shape)
            block_fields[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = fields

    cuts = _overhead_patches(
        counted_restore, patch_lang_once, cached_np_dtype, cached_block_type_init
    )
    for owner, name, patched in cuts:
        setattr(patched, _OVERHEAD_ORIGINAL, getattr(owner, name))
        setattr(owner, name, patched)


def _overhead_patches(*patched: object) -> list[tuple[object, str, object]]:
    """(owner, attribute, value) of the entries `install_interpreter_overhead_cuts` replaces,
    with their values from `patched` (or the current ones)."""
    import triton.language.core as core
    import triton.runtime.interpreter as interp

    owners = [
        (interp._LangPatchScope, "restore"),
        (interp, "_patch_lang"),
        (interp, "_get_np_dtype"),
        (core.block_type, "__init__"),
    ]
    values = patched or tuple(getattr(owner, name) for owner, name in owners)
    return [(owner, name, value) for (owner, name), value in zip(owners, values, strict=True)]


def _int_dims(shape: object, constexpr: type) -> list[int] | None:
    """The dims of a block shape given as a list of ints (plain or constexpr), else None."""
    if type(shape) is not list:
        return None
    dims = []
    for dim in shape:
        value = dim.value if type(dim) is constexpr else dim
        if type(value) is not int:
            return None
        dims.append(value)
    return dims


@contextlib.contextmanager
def uncut_interpreter_overheads() -> Iterator[None]:
    """Within the block, the interpreter's own `_patch_lang` and `_get_np_dtype` and triton's own
    `block_type.__init__` (a test compares kernels' results with and without the cuts)."""
    current = _overhead_patches()
    for owner, name, value in current:
        setattr(owner, name, getattr(value, _OVERHEAD_ORIGINAL, value))
    try:
        yield
    finally:
        for owner, name, value in current:
            setattr(owner, name, value)


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


# ------------------------------------------------------------------------------ bf16 arithmetic
#
# The interpreter holds bf16 as its uint16 bit patterns and hands those to numpy, so `x * y`,
# `x + y`, `x < y`, `-x`, `tl.maximum`, `tl.fma`, `tl.clamp`, `tl.dot`, bf16 reductions and
# scans, and int/bool/fp64 -> bf16 casts compute on integers. Each entry patched below decodes
# bf16 operands to fp32 (exact), runs the interpreter's own fp32 code, rounds to bf16 once, RNE,
# as `add/sub/mul/fma.rn.bf16` and `cvt.rn.bf16.*` do on a GPU. For add, sub and mul (and div)
# one fp32 operation then one RNE rounding IS the correctly rounded bf16 result: a double
# rounding can only go wrong when the fp32 result lands exactly on a bf16 midpoint while the
# exact result is not that midpoint, and a sweep of all 2^32 pairs of finite bf16 values found no
# such pair for add (sub is add of -y), mul or div (fp32 has 24 >= 2*8 + 2 bits). max/min/fmod/
# compares are exact in fp32. fma and the casts from wider types need a sticky bit: see
# `_round_to_bf16`.
#
# Not reached as bf16 from a kernel, so not fixes but consistency: `/` and `%` promote bf16 to
# fp32 in the frontend (computation_type_impl), and exp/log/sqrt/sigmoid reject bf16 (libdevice's
# convention, on GPUs too), so kernels upcast before those and neg is the only unary op to fix.
# Not the GPU's bits: bf16 sums and dots, whose order the hardware layout sets. Sums accumulate
# in fp32 and round once and scans round every step, as numpy treats fp16 here.

_BF16_ORIGINAL = "_moe_verify_bf16_original"


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> their fp32 values; exact (bf16 is fp32's upper half)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 values -> bf16 bit patterns (uint16), rounded to nearest even."""
    return _convert_float_via_torch(np.asarray(x, dtype=np.float32), torch.float32, torch.bfloat16)


def _round_to_bf16(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """bf16 bit patterns of the exact value hi + lo (float64, |lo| <= ulp(hi) / 2), one RNE.

    Rounding to fp32 first and then to bf16 rounds twice and can break a tie the wrong way
    (cast 1 + 2^-8 + 2^-30 via fp32: 1 + 2^-8 is a bf16 tie, and it goes down). Rounding to fp32
    *to odd* keeps a sticky bit instead, and RNE of a round-to-odd result with >= 2 spare bits is
    the correct RNE (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums", 2008):
    an inexact fp32 result with an even last bit steps one ulp toward the exact value.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        f = hi.astype(np.float32)  # RNE; beyond fp32's range inf, which bf16 rounds to as well
        # hi - f is exact (Sterbenz), so its sign with lo's is the sign of the rounding error.
        rest = (hi - f.astype(np.float64)) + lo
    inexact_even = (rest != 0) & np.isfinite(f) & ((f.view(np.uint32) & 1) == 0)
    toward = np.where(rest > 0, np.float32(np.inf), np.float32(-np.inf))
    return _f32_to_bf16(np.where(inexact_even, np.nextafter(f, toward), f))


def _exact_f64_pair(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integers or fp64 as (hi, lo) float64 with hi + lo exactly x (lo == 0 below 64 bits)."""
    hi = x.astype(np.float64)
    if x.dtype.kind not in "iu" or x.dtype.itemsize < 8:
        return hi, np.zeros_like(hi)
    # A 64-bit integer may round to 2^63 (2^64 unsigned), which does not convert back: stay one
    # fp64 below it. The residual is then under 2^11, exact in (wrapping) integer arithmetic.
    top = np.float64(2.0**63 if x.dtype.kind == "i" else 2.0**64)
    hi = np.minimum(hi, np.nextafter(top, 0.0))
    lo = (x - hi.astype(x.dtype)).view(np.int64).astype(np.float64)
    return hi, lo


def _is_bf16(handle: object) -> bool:
    import triton.language as tl

    return handle.dtype.scalar == tl.bfloat16


def _as_f32_handle(handle: object) -> object:
    """A bf16 TensorHandle as the fp32 handle of the same values; other handles unchanged."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if not _is_bf16(handle):
        return handle
    return interp.TensorHandle(_bf16_to_f32(handle.data), tl.float32)


def _as_f32_tensor(t: object) -> object:
    """A bf16 tl.tensor (block or scalar) as the fp32 tensor of the same values."""
    import triton.language as tl

    return tl.core.tensor(_as_f32_handle(t.handle), t.type.with_element_ty(tl.float32))


def _as_bf16_tensor(t: object) -> object:
    """An fp32 tl.tensor rounded (RNE) to a bf16 tensor of the same shape."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    handle = interp.TensorHandle(_f32_to_bf16(t.handle.data), tl.bfloat16)
    return tl.core.tensor(handle, t.type.with_element_ty(tl.bfloat16))


def _bf16_binary_op(original: Callable[..., object]) -> Callable[..., object]:
    def binary_op(self: object, lhs: object, rhs: object, op: Callable[..., np.ndarray]) -> object:
        import triton.language as tl
        import triton.runtime.interpreter as interp

        if not (_is_bf16(lhs) or _is_bf16(rhs)):
            return original(self, lhs, rhs, op)
        with np.errstate(all="ignore"):  # inf and NaN are the IEEE answers, as on a GPU
            out = original(self, _as_f32_handle(lhs), _as_f32_handle(rhs), op).data
        # Comparisons give bools, tagged with the operand type as the interpreter does.
        data = _f32_to_bf16(out) if out.dtype == np.float32 else out
        return interp.TensorHandle(data, tl.bfloat16)

    return binary_op


def _bf16_unary_op(original: Callable[..., object]) -> Callable[..., object]:
    def unary_op(self: object, arg: object, op: Callable[..., np.ndarray]) -> object:
        import triton.language as tl
        import triton.runtime.interpreter as interp

        if not _is_bf16(arg):
            return original(self, arg, op)
        if op is np.negative:
            # neg.bf16 flips the sign bit, NaN payloads included.
            return interp.TensorHandle(arg.data ^ np.uint16(0x8000), tl.bfloat16)
        with np.errstate(all="ignore"):  # inf and NaN are the IEEE answers, as on a GPU
            out = op(_bf16_to_f32(arg.data))
        return interp.TensorHandle(_f32_to_bf16(out), tl.bfloat16)

    return unary_op


def _bf16_fma(original: Callable[..., object]) -> Callable[..., object]:
    def create_fma(self: object, x: object, y: object, z: object) -> object:
        import triton.language as tl
        import triton.runtime.interpreter as interp

        if not _is_bf16(z):
            return original(self, x, y, z)
        a, b, c = (_bf16_to_f32(h.data).astype(np.float64) for h in (x, y, z))
        a, b, c = np.broadcast_arrays(a, b, c)
        with np.errstate(invalid="ignore"):
            product = a * b  # 16 significant bits: exact in fp64
            hi = product + c
            # TwoSum: lo is exactly the error of hi, so hi + lo is the exact x*y + z.
            back = hi - product
            lo = (product - (hi - back)) + (c - back)
        return interp.TensorHandle(_round_to_bf16(hi, lo), tl.bfloat16)

    return create_fma


def _bf16_clampf(original: Callable[..., object]) -> Callable[..., object]:
    def create_clampf(
        self: object, arg: object, lo: object, hi: object, propagate: object
    ) -> object:
        import triton.language as tl
        import triton.runtime.interpreter as interp

        if not _is_bf16(arg):
            return original(self, arg, lo, hi, propagate)
        out = original(self, *(_as_f32_handle(h) for h in (arg, lo, hi)), propagate)
        return interp.TensorHandle(_f32_to_bf16(out.data), tl.bfloat16)

    return create_clampf


def _bf16_cast_impl(original: Callable[..., object]) -> Callable[..., object]:
    def cast_impl(self: object, src: object, dst_type: object) -> object:
        import triton.language as tl
        import triton.runtime.interpreter as interp

        # fp32 -> bf16 goes through the fixed `_convert_float`, and the frontend sends bf16 to any
        # other type through fp32. Integers and bools (compares come tagged with their operands'
        # float type, so the data decides) would be cast as bit patterns: round them here.
        data = np.asarray(src.data)
        keep = data.dtype == np.float32 or (data.dtype == np.uint16 and _is_bf16(src))
        if dst_type.scalar != tl.bfloat16 or keep:
            return original(self, src, dst_type)
        hi, lo = _exact_f64_pair(data)
        return interp.TensorHandle(_round_to_bf16(hi, lo), tl.bfloat16)

    return cast_impl


def _bf16_dot(original: Callable[..., object]) -> Callable[..., object]:
    def create_dot(self: object, a: object, b: object, d: object, *args: object) -> object:
        return original(self, _as_f32_handle(a), _as_f32_handle(b), d, *args)

    return create_dot


def _bf16_min_max(original: Callable[..., object]) -> Callable[..., object]:
    def min_max(
        self: object,
        input: object,
        val_reduce_op: Callable[..., np.ndarray] | None,
        idx_reduce_op: Callable[..., np.ndarray] | None = None,
    ) -> object:
        import triton.language as tl

        input = input[0] if isinstance(input, tuple) else input
        if input.dtype != tl.bfloat16:
            return original(self, input, val_reduce_op, idx_reduce_op)
        out = original(self, _as_f32_tensor(input), val_reduce_op, idx_reduce_op)
        if val_reduce_op is None:
            return out
        if isinstance(out, tuple):
            return _as_bf16_tensor(out[0]), out[1]
        return _as_bf16_tensor(out)

    return min_max


def _bf16_sum(original: Callable[..., object]) -> Callable[..., object]:
    def sum(self: object, input: object) -> object:
        import triton.language as tl

        if input.dtype != tl.bfloat16:
            return original(self, input)
        return _as_bf16_tensor(original(self, _as_f32_tensor(input)))

    return sum


def _bf16_scan(
    original: Callable[..., object], op: Callable[..., np.ndarray]
) -> Callable[..., object]:
    def scan(self: object, input: object) -> list[object]:
        import triton.language as tl
        import triton.runtime.interpreter as interp

        if input.dtype != tl.bfloat16:
            return original(self, input)
        steps = np.moveaxis(input.handle.data, self.axis, 0).copy()
        for i in range(1, steps.shape[0]):
            steps[i] = _f32_to_bf16(op(_bf16_to_f32(steps[i - 1]), _bf16_to_f32(steps[i])))
        data = np.ascontiguousarray(np.moveaxis(steps, 0, self.axis))
        handle = interp.TensorHandle(data, tl.bfloat16)
        return [tl.core.tensor(handle, input.type)]

    return scan


def _bf16_patches() -> list[
    tuple[type, str, Callable[[Callable[..., object]], Callable[..., object]]]
]:
    """(owner, attribute, wrapper) for each interpreter entry that computes on bf16 bits."""
    import triton.runtime.interpreter as interp

    builder = interp.InterpreterBuilder
    return [
        (builder, "binary_op", _bf16_binary_op),  # + - * / %, min/max, compares
        (builder, "unary_op", _bf16_unary_op),  # neg
        (builder, "create_fma", _bf16_fma),
        (builder, "create_clampf", _bf16_clampf),  # tl.clamp(propagate_nan=ALL): np.clip
        (builder, "cast_impl", _bf16_cast_impl),  # int, bool, fp64 -> bf16
        (builder, "create_dot", _bf16_dot),
        (interp.ReduceOps, "min_max", _bf16_min_max),  # tl.max/min/argmax/argmin
        (interp.ReduceOps, "sum", _bf16_sum),
        (interp.ScanOps, "cumsum", lambda f: _bf16_scan(f, np.add)),
        (interp.ScanOps, "cumprod", lambda f: _bf16_scan(f, np.multiply)),
    ]


def install_interpreter_bf16_fix() -> None:
    """Make the interpreter's bf16 arithmetic decode, compute in fp32, round RNE (idempotent)."""
    for owner, name, wrap in _bf16_patches():
        current = owner.__dict__[name]
        if hasattr(current, _BF16_ORIGINAL):
            continue
        patched = wrap(current)
        setattr(patched, _BF16_ORIGINAL, current)
        setattr(owner, name, patched)


@contextlib.contextmanager
def unpatched_bf16_arithmetic() -> Iterator[None]:
    """Within the block, the interpreter's own bf16 arithmetic (on bit patterns), to show it wrong.

    The float-cast fix stays in, so what differs inside the block is the arithmetic alone.
    """
    restore = []
    for owner, name, _ in _bf16_patches():
        current = owner.__dict__[name]
        original = getattr(current, _BF16_ORIGINAL, None)
        if original is not None:
            setattr(owner, name, original)
            restore.append((owner, name, current))
    try:
        yield
    finally:
        for owner, name, patched in restore:
            setattr(owner, name, patched)


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
