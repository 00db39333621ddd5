"""DeepGEMM's SM90 FP8 GEMM as the Hopper tensor core computes it: a bit-exact model.

A Hopper FP8 `wgmma` does not add its products in IEEE arithmetic. Per output element
d[r, n] = bf16_RNE(final), with fp8 e4m3 operands A [M, K] (scales sa [M, K/128]) and
B [N, K] (scales sb [ceil(N/128), K/128]):

1. every 128-wide K chunk c is summed on its own, from +0, by four CHAINED block steps of 32
   products each (k = 128c + 32s .. 128c + 32s + 31, s = 0..3);
2. a block step aligns its 32 products and the running chunk accumulator to the largest exponent
   E among them (zero terms do not count; a product's exponent is ea + eb, the sum of its inputs'
   exponents with e4m3 subnormals at -6; the accumulator's is floor(log2|acc|));
3. truncates each term toward zero to a multiple of 2^(E - 13), adds them exactly, and truncates
   the sum toward zero to 13 fraction bits below its own leading bit (+0 if it is zero);
4. promotes: final = fma(fp32(sa * sb), chunk, final) in fp32, chunks in K order, from +0;
5. rounds final to bf16, to nearest even.

Measured on an H200: 100.0000% of the outputs of DeepGEMM's fp8_gemm_nt and
m_grouped_fp8_gemm_nt_contiguous (docs/tensor-core.md). Sources: Khattak &
Mikaitis, "Accurate Models of NVIDIA Tensor Cores" (ACM TACO 2026, arXiv:2512.07004), and the
Hopper preset of mmaemu (32 products per step, 13 fraction bits, E floored at -132).

Exactness: an e4m3 value has at most 4 significant bits, so a product has at most 8 and lies in
[2^-18, 2^18): exact in fp32. Aligned terms are integers below 2^15 in units of 2^(E-13) and a
step's sum is below 2^21: exact in fp32 in any order. Scaling by a power of two and truncating are
exact. The fp32 FMA is emulated with one rounding (`fma_fp32`). Everything runs on the operands'
device, CPU or CUDA, with the same bits.

The SM90 recipe only (fp8_block: A 1x128, B 128x128 fp32 scales; UE8M0 "ceil" scales are fp32
powers of two and take the same path). SM100's tensor core accumulates differently: its packed
UE8M0, MX and FP4 recipes are not this model and are refused.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import torch
from torch import Tensor

from moe_verify.spec import QuantizedWeight, ceil_div
from reference.gemm import expert_rows
from reference.validate import first_index, require, require_scale_values, require_tensor

__all__ = [
    "CHUNK",
    "FRAC_BITS",
    "STEP",
    "FUSED_ENV",
    "block_step",
    "chunk_accumulators",
    "chunk_steps",
    "fused_steps",
    "decode_e4m3",
    "fma_fp32",
    "promote",
    "tensor_core_gemm",
    "tensor_core_grouped_gemm",
    "tensor_core_masked_gemm",
]

CHUNK = 128  # K elements per promotion: one fp32 scale of A and of B each
STEP = 32  # products per chained tensor-core block step (one wgmma k=32)
FRAC_BITS = 13  # fraction bits kept below the block exponent, and in a step's result
# The model floors E at -132. With e4m3 operands it never binds: every nonzero term has an
# exponent >= -25 (a product's ea + eb is >= -12; an accumulator is a multiple of 2^(-12-13)).
MIN_BLOCK_EXP = -132
# Exponent given to a zero (code or accumulator), so that zeros never set E: a product with a
# zero factor gets <= -50 + 8 = -42 < -25, and a step of zeros only gets E in [-100, -42], where
# 2^(E - 13) is still a normal fp32 number (its terms are all zero, so the value is irrelevant).
ZERO_EXP = -50

_FP8 = torch.float8_e4m3fn
_E4M3_BIAS = 7
_E4M3_MIN_EXP = -6  # subnormals keep the exponent of the smallest normal, 2^-6
_E4M3_NAN = 0x7F  # S.1111.111 is NaN; e4m3fn has no infinities
_F32_BIAS = 127
_F32_MANTISSA_BITS = 23

# Elements per vectorized step operation and columns per tile. Eager, a step materializes
# [32, chunks, rows, cols] temporaries: small on the CPU, so that they stay in cache and the
# allocator reuses them; large on a GPU, so that kernel launches are few (about 1.2 GiB). Fused,
# only the [chunks, rows, cols] accumulators are written, so a GPU tile is rows x cols <= 2^24
# with chunk batches of 2^27 accumulators (512 MiB); a tile's K/128 chunks are held for the
# promotion (3.5 GiB at K = 7168). Any GEMM runs in bounded memory.
_CPU_STEP_ELEMENTS, _CPU_TILE_COLS = 1 << 20, 128
_GPU_STEP_ELEMENTS, _GPU_TILE_COLS = 1 << 27, 4096
_FUSED_GPU_TILE_ELEMENTS = 1 << 24


def _step_elements(device: torch.device) -> int:
    return _CPU_STEP_ELEMENTS if device.type == "cpu" else _GPU_STEP_ELEMENTS


def _tile_cols(device: torch.device) -> int:
    return _CPU_TILE_COLS if device.type == "cpu" else _GPU_TILE_COLS


def _chunk_batch(rows: int, cols: int, device: torch.device, fused: bool) -> int:
    """Chunks computed at once for a rows x cols tile."""
    per_chunk = max(1, rows * cols) * (1 if fused else STEP)
    return max(1, _step_elements(device) // per_chunk)


def _row_tile(cols: int, device: torch.device, fused: bool) -> int:
    """Rows per tile: one chunk's step within budget (eager) or the fused GPU tile."""
    if fused and device.type != "cpu":
        return max(1, _FUSED_GPU_TILE_ELEMENTS // cols)
    return max(1, _step_elements(device) // (STEP * cols))


# ---------------------------------------------------------------------------------------------
# Exact helpers
# ---------------------------------------------------------------------------------------------


def _pow2(e: Tensor) -> Tensor:
    """fp32 2^e for integer e in the normal range [-126, 127], built from the bits (exact on
    every device, unlike exp2)."""
    return ((e.to(torch.int32) + _F32_BIAS) << _F32_MANTISSA_BITS).view(torch.float32)


def _floor_log2(x: Tensor) -> Tensor:
    """int32 floor(log2|x|) of an fp32 x that is +-0 or normal (ZERO_EXP for zero), read from the
    exponent field. Accumulators are: every nonzero one is a multiple of 2^-25."""
    biased = (x.view(torch.int32) >> _F32_MANTISSA_BITS) & 0xFF
    return torch.where(biased == 0, ZERO_EXP, biased - _F32_BIAS)


def _keep_fraction_bits(x: Tensor, bits: int) -> Tensor:
    """Normal fp32 x truncated toward zero to `bits` fraction bits below its leading bit.

    fp32 is sign-magnitude, so clearing the low 23 - bits mantissa bits truncates toward zero.
    """
    mask = ~((1 << (_F32_MANTISSA_BITS - bits)) - 1)
    return (x.view(torch.int32) & mask).view(torch.float32)


def decode_e4m3(q: Tensor) -> tuple[Tensor, Tensor]:
    """fp8 e4m3 [...] -> (values fp32 [...], exponents int8 [...]).

    The exponent is the model's: the unbiased exponent field, -6 for subnormals (which keep
    their denormal significand), ZERO_EXP for +-0. NaN codes are refused by the callers.
    """
    codes = torch.arange(256, dtype=torch.int32)
    field = (codes >> 3) & 0xF
    exponent = torch.where(field == 0, _E4M3_MIN_EXP, field - _E4M3_BIAS)
    is_zero = (codes & 0x7F) == 0
    exponent = torch.where(is_zero, ZERO_EXP, exponent).to(torch.int8).to(q.device)
    values = codes.to(torch.uint8).view(_FP8).float().to(q.device)
    # Contiguous in q's logical order (a transposed q gives K-major tables, as the steps want).
    index = q.view(torch.uint8).contiguous().long()
    return values[index], exponent[index]


# ---------------------------------------------------------------------------------------------
# The tensor core: one block step, one chunk
# ---------------------------------------------------------------------------------------------


def block_step(
    acc: Tensor, products: Tensor, product_exps: Tensor, *, fused: bool = False
) -> Tensor:
    """One chained tensor-core step over a batch of output elements.

    acc           fp32 [...]: the running chunk accumulator (at most 14 significant bits, or +0)
    products      fp32 [32, ...]: the step's exact products a_k * b_k
    product_exps  int8 [32, ...]: ea_k + eb_k of each product (<= ZERO_EXP + 8 for a zero one)
    Returns the new accumulator, fp32 [...]. A zero result is +0 as the hardware's: an IEEE sum
    is -0 only when every addend is, and the accumulator's own term is never -0 (the accumulator
    starts at +0, and a nonzero one is at or above the unit, so it never truncates to zero).
    """
    # An int8 max across the leading axis: torch.compile's CPU code (torch 2.13, the CPU tier's)
    # takes an int8 max *along memory* of negative values as 0; this one it gets right, and
    # tests/reference/hardware/test_tensor_core_fused.py's all-below-one case fails on the
    # other layout.
    block_exp = torch.maximum(product_exps.amax(0).to(torch.int32), _floor_log2(acc))
    block_exp = block_exp.clamp_min(MIN_BLOCK_EXP)
    unit = _pow2(block_exp - FRAC_BITS)
    if fused:
        # Compiled code: Triton lowers fp32 `/` to div.full.f32 (2 ulps, even where the exact
        # quotient is representable), so multiply by the exact power of two 2^(13 - E) instead
        # (normal: E >= 2 * ZERO_EXP), and truncate by the float -> int32 conversion.
        per_unit = _pow2(FRAC_BITS - block_exp)
        terms = (products * per_unit).to(torch.int32).sum(0, dtype=torch.int32)
        total = (terms + (acc * per_unit).to(torch.int32)).to(torch.float32)
    else:  # eager: ATen's division is IEEE, exact by a power of two, and one fast pass
        terms = torch.div(products, unit, rounding_mode="trunc").sum(0)
        total = terms + torch.div(acc, unit, rounding_mode="trunc")
    return _keep_fraction_bits(total * unit, FRAC_BITS)


def chunk_accumulators(
    a_values: Tensor, a_exps: Tensor, b_values: Tensor, b_exps: Tensor, fused: bool = False
) -> Tensor:
    """The tensor core's unscaled sum of every 128-wide K chunk: fp32 [K/128, rows, cols].

    a_values fp32 [K, rows] and a_exps int8 [K, rows] (decoded, K-major); b_* the same [K, cols].
    Chunks are independent (each starts from +0), so a batch of them runs at once. `fused`:
    the steps compiled (`fused_steps`).
    """
    k, rows = a_values.shape
    cols = b_values.shape[1]
    chunks = k // CHUNK
    out = torch.empty(chunks, rows, cols, dtype=torch.float32, device=a_values.device)
    batch = _chunk_batch(rows, cols, a_values.device, fused)

    def steps(x: Tensor, first: int, count: int) -> Tensor:
        """[K, width] -> [4, 32, count, width]: step s of chunk `first + j` is [s, :, j]."""
        x = x[first * CHUNK : (first + count) * CHUNK]
        return x.reshape(count, CHUNK // STEP, STEP, x.shape[1]).permute(1, 2, 0, 3)

    chained = _fused_chunk_steps() if fused else chunk_steps
    for first in range(0, chunks, batch):
        count = min(batch, chunks - first)
        av, ae = steps(a_values, first, count), steps(a_exps, first, count)
        bv, be = steps(b_values, first, count), steps(b_exps, first, count)
        out[first : first + count] = chained(av, ae, bv, be)
    return out


def chunk_steps(av: Tensor, ae: Tensor, bv: Tensor, be: Tensor, fused: bool = False) -> Tensor:
    """The four chained block steps of a batch of chunks, each from +0: fp32 [count, rows, cols].

    av, ae: fp32 / int8 [4, 32, count, rows], step s of chunk j at [s, :, j]; bv, be the same
    [4, 32, count, cols]. `fused`: written for torch.compile (`block_step`)."""
    acc = torch.zeros(av.shape[2], av.shape[3], bv.shape[3], dtype=torch.float32, device=av.device)
    for s in range(CHUNK // STEP):
        products = av[s, :, :, :, None] * bv[s, :, :, None, :]
        exps = ae[s, :, :, :, None] + be[s, :, :, None, :]
        acc = block_step(acc, products, exps, fused=fused)
    return acc


# `chunk_steps` fused by torch.compile: every operation in it is exact (products of e4m3 values,
# integer-valued sums below 2^21, multiplications by powers of two, bit masks), so any fusion or
# reordering keeps the bits, and the [32, count, rows, cols] temporaries of the eager form are
# never written: on the H200 the eager form is memory-bound at 14-207x the fp32 golden GEMM, the
# fused one 8-34x (docs/tensor-core.md#speed). The promotion's FMA is compiled too (one pass per
# chunk). Reducing along memory instead ([..., 32] products) measured 1.3-1.6x slower there.
# Default: fused on a GPU for GEMMs of at least FUSED_MIN_MULTIPLIES, eager otherwise. A compile
# costs 20-40 s cold and seconds with inductor's cache warm, once per process; eager runs about
# 84e9 multiplies per second on the H200, so below 2^37 (1.6 s eager) a one-off run, a sanitized
# case or a test spends more compiling than it saves. On the CPU compiling costs more than it
# saves in tests. MOE_VERIFY_FUSED_TENSOR_CORE=1 or 0 forces either, on any device and size.
FUSED_ENV = "MOE_VERIFY_FUSED_TENSOR_CORE"
FUSED_MIN_MULTIPLIES = 1 << 37


def fused_steps(device: torch.device, multiplies: int) -> bool:
    """Whether a GEMM of `multiplies` (M x N x K over its live rows) on `device` runs compiled
    (torch.compile: the chunk steps and the promotion)."""
    forced = os.environ.get(FUSED_ENV, "")
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"{FUSED_ENV}: expected 0 or 1, got {forced!r}")
    return device.type == "cuda" and multiplies >= FUSED_MIN_MULTIPLIES


def _compiled(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """`fn` under torch.compile with dynamic shapes, called with the compiler settings that keep
    its graphs few: sizes that merely coincide (rows == cols, rows == chunks) share no symbol, so
    only sizes of 1 specialize (at most 8 graphs for the three sizes of a step), and the limit is
    raised above that. Past the limit, fullgraph=True makes torch raise (FailOnRecompileLimitHit)
    and the case errors: loud, never silently slow."""
    # torch's own (private) settings modules, imported only when something is compiled
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as shapes_config

    compiled = torch.compile(fn, dynamic=True, fullgraph=True)
    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"

    def call(*args: Tensor) -> Tensor:
        with contextlib.ExitStack() as settings:
            if hasattr(shapes_config, "use_duck_shape"):
                settings.enter_context(shapes_config.patch(use_duck_shape=False))
            settings.enter_context(dynamo_config.patch(**{limit: 32}))
            return compiled(*args)

    return call


@functools.cache
def _fused_chunk_steps() -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    return _compiled(functools.partial(chunk_steps, fused=True))


@functools.cache
def _fused_fma() -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    return _compiled(fma_fp32)


# ---------------------------------------------------------------------------------------------
# Promotion: final = fma(sa * sb, chunk, final) in fp32
# ---------------------------------------------------------------------------------------------


def fma_fp32(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """fp32 a * b + c with ONE rounding (to nearest even), like the GPU's FFMA.

    a * b is exact in float64 (24 + 24 significant bits <= 53). The sum with c may need more
    than 53 bits (c = 2^30 plus a product near 2^-30), so float64 addition alone would round
    twice. Instead the sum is split exactly into s + err (Knuth's TwoSum) and rounded to odd at
    53 bits (an inexact s with an even last bit moves one ulp toward err); rounding that to the
    24 bits of fp32 gives the correctly rounded sum, because 53 >= 24 + 2 (Boldo & Melquiond,
    "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to odd", 2008).
    """
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    c_part = s - p
    err = (p - (s - c_part)) + (c - c_part)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(s.dtype)
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.to(torch.float32)


def promote(chunks: Tensor, scale_a: Tensor, scale_b: Tensor, fused: bool = False) -> Tensor:
    """fp32 [rows, cols]: final = fma(fp32(scale_a[c] * scale_b[c]), chunks[c], final) for c in
    K order, from +0.

    chunks fp32 [C, rows, cols] (chunk_accumulators); scale_a fp32 [C, rows, 1] and scale_b fp32
    [C, 1, cols] (or any shapes that broadcast to chunks'), each chunk's two scales. Their product
    is one eager IEEE multiply per chunk, so no compiler can contract it into the FMA. `fused`:
    the FMA compiled.
    """
    fma = _fused_fma() if fused else fma_fp32
    final = torch.zeros(chunks.shape[1:], dtype=torch.float32, device=chunks.device)
    for c in range(chunks.shape[0]):
        final = fma(scale_a[c] * scale_b[c], chunks[c], final)
    return final


# ---------------------------------------------------------------------------------------------
# GEMMs
# ---------------------------------------------------------------------------------------------


def _require_codes(name: str, q: Tensor) -> None:
    nan = (q.view(torch.uint8) & 0x7F) == _E4M3_NAN
    if bool(nan.any()):
        raise ValueError(
            f"{name}: {int(nan.sum())} NaN e4m3 codes, first at {first_index(nan)}; the "
            "tensor-core model covers finite operands only"
        )


def _require_fp32_scale_dtype(name: str, scale: Tensor, ndim: int) -> None:
    if isinstance(scale, Tensor) and scale.dtype == torch.int32:
        raise ValueError(
            f"{name}: int32 packed UE8M0 scales are SM100's format, whose tensor core is not "
            "this model; the SM90 recipe takes fp32 scales (ceil-UE8M0 values included)"
        )
    require_tensor(name, scale, (torch.float32,), ndim)


def _require_fp32_scales(name: str, scale: Tensor) -> None:
    _require_fp32_scale_dtype(name, scale, 2)
    require_scale_values(name, scale)


def _require_sm90_weight(w: QuantizedWeight) -> None:
    require(
        not w.fp4 and w.block == (CHUNK, CHUNK),
        "w",
        "fp8 e4m3 weights with 128x128 fp32 block scales (the SM90 fp8_block recipe; MX and FP4 "
        "run on SM100's tensor core, which is not this model)",
        f"{'E2M1' if w.fp4 else 'fp8'} weights with block {w.block}",
    )
    require_tensor("w.q", w.q, (_FP8,), 3)
    _require_fp32_scales("w.scale", w.scale)


def _gemm_decoded(
    a_values: Tensor, a_exps: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, fused: bool
) -> Tensor:
    """bf16 [M, N] from A decoded K-major (fp32 / int8 [K, M]) with fp32 scales [M, K/128], and
    fp8 B [N, K] with fp32 block scales [ceil(N/128), K/128]. Runs in tiles of columns and rows."""
    m, n = a_values.shape[1], b.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=b.device)
    sa = a_scale.t()  # [C, M]
    sb = b_scale.repeat_interleave(CHUNK, dim=0)[:n].t()  # [C, N]: the block scale of each column
    cols = max(1, min(n, _tile_cols(b.device)))
    rows = _row_tile(cols, b.device, fused)
    for n0 in range(0, n, cols):
        n1 = min(n, n0 + cols)
        b_values, b_exps = decode_e4m3(b[n0:n1].t())
        for m0 in range(0, m, rows):
            m1 = min(m, m0 + rows)
            chunks = chunk_accumulators(
                a_values[:, m0:m1], a_exps[:, m0:m1], b_values, b_exps, fused
            )
            final = promote(chunks, sa[:, m0:m1, None], sb[:, None, n0:n1], fused)
            out[m0:m1, n0:n1] = final.to(torch.bfloat16)
    return out


def _require_operands(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor) -> None:
    """Dense operands of one GEMM: a [M, K], a_scale [M, K/128], b [N, K], b_scale
    [ceil(N/128), K/128]."""
    require_tensor("a", a, (_FP8,), 2)
    require_tensor("b", b, (_FP8,), 2)
    k = a.shape[1]
    require(k % CHUNK == 0, "a", f"K a multiple of {CHUNK}", f"K = {k}")
    require(b.shape[1] == k, "b", f"K = {k} columns (A's K)", f"{b.shape[1]}")
    _require_fp32_scales("a_scale", a_scale)
    _require_fp32_scales("b_scale", b_scale)
    want = (a.shape[0], k // CHUNK)
    require(tuple(a_scale.shape) == want, "a_scale", f"shape {want}", f"{tuple(a_scale.shape)}")
    want = (ceil_div(b.shape[0], CHUNK), k // CHUNK)
    require(tuple(b_scale.shape) == want, "b_scale", f"shape {want}", f"{tuple(b_scale.shape)}")
    _require_codes("a", a)
    _require_codes("b", b)


def tensor_core_gemm(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, *, fused: bool | None = None
) -> Tensor:
    """bf16 [M, N]: DeepGEMM's SM90 fp8_gemm_nt (recipe (1, 128, 128)) as the tensor core does it.

    a        fp8 e4m3 [M, K], K a multiple of 128
    a_scale  fp32 [M, K/128]: per-token 1x128 scales
    b        fp8 e4m3 [N, K]
    b_scale  fp32 [ceil(N/128), K/128]: 128x128 block scales
    fused    compiled or eager (the same bits); None: `fused_steps` decides by this GEMM's size
    """
    _require_operands(a, a_scale, b, b_scale)
    if fused is None:
        fused = fused_steps(a.device, a.shape[0] * b.shape[0] * a.shape[1])
    a_values, a_exps = decode_e4m3(a.t())
    return _gemm_decoded(a_values, a_exps, a_scale, b, b_scale, fused)


def _require_activations(
    a: Tensor, a_scale: Tensor, a_group: int, w: QuantizedWeight, ndim: int
) -> None:
    require(
        a_group == CHUNK,
        "a_group",
        f"{CHUNK} (1x128 activation scales, the SM90 fp8_block recipe)",
        f"{a_group}",
    )
    require_tensor("a", a, (_FP8,), ndim)
    # Scale values are checked on the live rows only: padding rows may hold anything.
    _require_fp32_scale_dtype("a_scale", a_scale, ndim)
    _require_sm90_weight(w)
    k = w.shape[2]
    require(a.shape[-1] == k, "a", f"K = {k} columns (the weight's K)", f"{a.shape[-1]}")


def tensor_core_grouped_gemm(
    a: Tensor, a_scale: Tensor, a_group: int, w: QuantizedWeight, m_indices: Tensor
) -> Tensor:
    """bf16 [M_sum, N]: m_grouped_fp8_gemm_nt_contiguous on SM90, bit for bit.

    The contract of `reference.gemm.grouped_gemm`: a fp8 [M_sum, K] with fp32 [M_sum, K/128]
    scales (a_group 128), w the experts' fp8 weights [E, N, K] with 128x128 fp32 block scales,
    m_indices int32 [M_sum] (expert of each row, -1 for padding rows, which are left zero).
    """
    _require_activations(a, a_scale, a_group, w, 2)
    num_experts, n, k = w.shape
    out = torch.zeros(a.shape[0], n, dtype=torch.bfloat16, device=a.device)
    groups = expert_rows(m_indices, num_experts, a.shape[0])
    fused = fused_steps(a.device, sum(rows.numel() for _, rows in groups) * n * k)
    for e, rows in groups:
        out[rows] = tensor_core_gemm(a[rows], a_scale[rows], w.q[e], w.scale[e], fused=fused)
    return out


def tensor_core_masked_gemm(
    a: Tensor, a_scale: Tensor, w: QuantizedWeight, masked_m: Tensor
) -> Tensor:
    """bf16 [E, M_max, N]: m_grouped_fp8_gemm_nt_masked on SM90, bit for bit.

    D[e, :masked_m[e]] = A[e, :masked_m[e]] @ B[e]^T by the same per-block math as the contiguous
    GEMM (DeepGEMM's `m_grouped_fp8_gemm_nt_masked`); rows at or past masked_m[e] are left zero
    here (the kernel leaves them unspecified).
    a        fp8 [E, M_max, K]; a_scale fp32 [E, M_max, K/128]
    w        fp8 weights [E, N, K] with 128x128 fp32 block scales
    masked_m int32 [E]: live rows of each expert, in [0, M_max]
    """
    _require_activations(a, a_scale, CHUNK, w, 3)
    num_experts, n, _ = w.shape
    require(a.shape[0] == num_experts, "a", f"{num_experts} experts (dim 0)", f"{a.shape[0]}")
    require(
        tuple(masked_m.shape) == (num_experts,),
        "masked_m",
        f"shape ({num_experts},)",
        f"{tuple(masked_m.shape)}",
    )
    m_max = a.shape[1]
    require(
        bool(((masked_m >= 0) & (masked_m <= m_max)).all()),
        "masked_m",
        f"values in [0, {m_max}]",
        f"{masked_m.tolist()}",
    )
    out = torch.zeros(num_experts, m_max, n, dtype=torch.bfloat16, device=a.device)
    counts = masked_m.tolist()
    fused = fused_steps(a.device, sum(counts) * n * w.shape[2])
    for e, live in enumerate(counts):
        if live:
            a_e, s_e = a[e, :live], a_scale[e, :live]
            out[e, :live] = tensor_core_gemm(a_e, s_e, w.q[e], w.scale[e], fused=fused)
    return out
