"""E8M0 scale bytes inside the Triton kernels: the @triton.jit helpers every kernel of this path
uses to turn fp32 scales into E8M0 bytes, bytes back into fp32, and four bytes into an int32 word.

Byte b stands for 2^(b - 127). The two ends have two readings, kept apart by name:
- `pow2_from_byte` is the fp32 whose exponent field is b (b << 23), the inverse of `ue8m0_byte`:
  byte 0 reads as +0.0 and 255 as +Inf. The quantizers build their power-of-two scales this way,
  and the exact reciprocals 2^(127 - b) as `pow2_from_byte(254 - b)`.
- `e8m0_to_fp32` is the tensor core's reading of a scale operand (OCP MX, DeepGEMM): byte 0 is
  2^-127 (an fp32 subnormal), 255 is NaN. The grouped GEMM decodes scales with it.
The golden computes the same formats on its own in reference/formats.py (`ue8m0_bytes`,
`ceil_ue8m0`, `e8m0_to_fp32`, `pack_ue8m0`); tests/tolerance/test_e8m0_codecs.py holds the sides
to each other.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ue8m0_byte(s):
    """The exponent field of fp32 s, int32 0..255: the UE8M0 byte of a non-negative power of two
    (+0.0 gives 0, +Inf 255), as DeepGEMM's packer reads `bits >> 23`."""
    return (s.to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def ue8m0_ceil_byte(s):
    """Biased exponent b with 2^(b-127) = the smallest power of two >= s, for fp32 s >= 0.

    Normal s: exponent field + (mantissa != 0). Subnormal s: 2^-127 (byte 0) covers s <= 2^-127,
    2^-126 (byte 1) the rest; s == 0 gives 0. Infinity or NaN give 255 or more: callers clamp.
    """
    bits = s.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    normal = exponent + (mantissa != 0).to(tl.int32)
    subnormal = (mantissa > 0x400000).to(tl.int32)
    return tl.where(exponent == 0, subnormal, normal)


@triton.jit
def pow2_from_byte(byte):
    """fp32 with exponent field `byte` (int32): 2^(byte-127) for bytes 1..254; 0 gives +0.0 and
    255 +Inf (the inverse of `ue8m0_byte`, not the tensor core's reading: `e8m0_to_fp32`)."""
    return (byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_fp32(byte):
    """E8M0 bytes (int32 0..255) -> fp32 2^(byte-127) as the tensor core reads a scale operand:
    0 -> 2^-127 (subnormal, not 0), 255 -> NaN (not Inf)."""
    bits = tl.where(byte == 0, 0x00400000, tl.where(byte == 255, 0x7FC00000, byte << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pack_word(byte, GROUPS_PER_PROGRAM: tl.constexpr):
    """[BLOCK_M, 4] bytes -> [BLOCK_M] int32 words, byte j of a word = column j (little-endian)."""
    shifts = 8 * tl.arange(0, GROUPS_PER_PROGRAM)
    word = tl.sum(byte.to(tl.uint32) << shifts[None, :].to(tl.uint32), axis=1)
    return word.to(tl.int32, bitcast=True)


@triton.jit
def word_byte(word, j):
    """Byte j (0..3, little-endian) of int32 packed UE8M0 words, int32 0..255: K-group 4p + j."""
    return (word >> (j * 8)) & 0xFF
