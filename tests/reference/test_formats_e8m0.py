"""Golden UE8M0/E8M0: the ceiling to a power of two, the byte of a power-of-two scale, the tensor
core's reading of a byte, and DeepGEMM's packed int32 layout.

Expected values are derived by hand from the format definitions (comments show the arithmetic).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from moe_verify.spec import ceil_div, round_up
from reference.formats import ceil_ue8m0, e8m0_to_fp32, pack_ue8m0, ue8m0_bytes, unpack_ue8m0
from tests.reference.format_literals import F32, HEX, ULP1, f32

pytestmark = pytest.mark.cpu


# ---------------------------------------------------------------------------------------------
# UE8M0: ceil to a power of two, bytes, and the kernel's reading of E8M0 bytes.
# ---------------------------------------------------------------------------------------------

MAX_SUBNORMAL = 2.0**-126 - 2.0**-149
FP32_MAX = HEX("0x1.fffffep+127")


@pytest.mark.parametrize(
    ("x", "expected"),
    [
        pytest.param(1.0, 1.0, id="2^0-exact"),
        pytest.param(1024.0, 1024.0, id="2^10-exact"),
        pytest.param(2.0**-100, 2.0**-100, id="2^-100-exact"),
        pytest.param(1.0 + ULP1, 2.0, id="2^0-plus-ulp-up"),
        pytest.param(2.0**-100 * (1 + ULP1), 2.0**-99, id="2^-100-plus-ulp-up"),
        pytest.param(1.0 - ULP1 / 2, 1.0, id="2^0-minus-ulp"),
        pytest.param(2.0**-125 * (1 - ULP1 / 2), 2.0**-125, id="2^-125-minus-ulp"),
        pytest.param(0.75, 1.0, id="0.75-up-not-nearest"),
        pytest.param(3.0, 4.0, id="3-up-not-nearest"),
        pytest.param(2.0**-126, 2.0**-126, id="min-normal-exact"),
        pytest.param(MAX_SUBNORMAL, 2.0**-126, id="max-subnormal"),
        pytest.param(2.0**-127, 2.0**-126, id="subnormal-power-2^-127"),
        pytest.param(2.0**-149, 2.0**-126, id="min-subnormal"),
        pytest.param(0.0, 2.0**-126, id="zero-doc-2^-126"),
        pytest.param(-0.0, 2.0**-126, id="neg-zero-doc-2^-126"),
        pytest.param(2.0**126 * (1 + ULP1), 2.0**127, id="2^126-plus-ulp-up-to-max"),
        pytest.param(2.0**127 * (1 - ULP1 / 2), 2.0**127, id="2^127-minus-ulp"),
        pytest.param(2.0**127, 2.0**127, id="2^127-max-exact"),
    ],
)
def test_ceil_ue8m0(x: float, expected: float) -> None:
    out = ceil_ue8m0(f32(x))
    assert out.dtype == F32 and out.item() == expected


@pytest.mark.parametrize(
    "x",
    [
        pytest.param(2.0**127 * (1 + ULP1), id="2^127-plus-ulp"),
        pytest.param(FP32_MAX, id="fp32-max"),
        pytest.param(math.inf, id="inf"),
        pytest.param(math.nan, id="nan"),
        pytest.param(-1.0, id="negative"),
        pytest.param(-(2.0**-149), id="negative-subnormal"),
    ],
)
def test_ceil_ue8m0_rejects(x: float) -> None:
    with pytest.raises(ValueError, match=r"x must be"):
        ceil_ue8m0(f32(1.0, x))


def test_ceil_ue8m0_rejects_non_fp32() -> None:
    with pytest.raises(ValueError, match=r"x must have dtype float32, got float64"):
        ceil_ue8m0(torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize(
    ("scale", "byte"),
    [
        pytest.param(1.0, 127, id="one"),
        pytest.param(2.0, 128, id="two"),
        pytest.param(0.5, 126, id="half"),
        pytest.param(2.0**-126, 1, id="min-normal"),
        pytest.param(2.0**127, 254, id="max"),
        pytest.param(0.0, 0, id="zero-passes-device-assert"),
        pytest.param(math.inf, 255, id="inf-passes-device-assert"),
    ],
)
def test_ue8m0_bytes(scale: float, byte: int) -> None:
    out = ue8m0_bytes(f32(scale))
    assert out.dtype == torch.uint8 and out.tolist() == [byte]


@pytest.mark.parametrize(
    "scale",
    [
        pytest.param(3.0, id="3"),
        pytest.param(0.75, id="0.75"),
        pytest.param(1.0 + ULP1, id="one-plus-ulp"),
        pytest.param(2.0**-127, id="subnormal-power"),
        pytest.param(-1.0, id="negative-power"),
        pytest.param(-0.0, id="neg-zero"),
        pytest.param(math.nan, id="nan"),
    ],
)
def test_ue8m0_bytes_rejects_non_powers_of_two(scale: float) -> None:
    with pytest.raises(ValueError, match=r"0x807FFFFF"):
        ue8m0_bytes(f32(1.0, scale))


def test_ue8m0_bytes_rejects_non_fp32() -> None:
    with pytest.raises(ValueError, match=r"scale must have dtype float32, got bfloat16"):
        ue8m0_bytes(torch.ones(2, dtype=torch.bfloat16))


def test_e8m0_to_fp32_all_256_bytes() -> None:
    b = torch.arange(256, dtype=torch.int32)
    bits = e8m0_to_fp32(b.to(torch.uint8)).view(torch.int32)
    # 1..254: exponent field = byte, mantissa 0. 0x00: 2^-127 = mantissa bit 22 (subnormal).
    assert torch.equal(bits[1:255], b[1:255] << 23)
    assert bits[0].item() == 0x00400000
    assert math.isnan(e8m0_to_fp32(torch.tensor([255], dtype=torch.uint8)).item())


@pytest.mark.parametrize(
    ("byte", "value"),
    [
        pytest.param(0x00, 2.0**-127, id="0x00-is-2^-127-not-zero"),
        pytest.param(0x01, 2.0**-126, id="0x01-min-normal"),
        pytest.param(0x7F, 1.0, id="0x7F-one"),
        pytest.param(0xFE, 2.0**127, id="0xFE-max"),
        pytest.param(0xFF, math.nan, id="0xFF-is-nan-not-inf"),
    ],
)
def test_e8m0_to_fp32_edge_bytes(byte: int, value: float) -> None:
    out = e8m0_to_fp32(torch.tensor([byte], dtype=torch.uint8)).item()
    assert (math.isnan(out) and math.isnan(value)) or out == value


def test_e8m0_round_trips_through_ue8m0_bytes() -> None:
    b = torch.arange(1, 255, dtype=torch.uint8)
    assert torch.equal(ue8m0_bytes(e8m0_to_fp32(b)), b)
    assert torch.equal(e8m0_to_fp32(b.view(torch.float8_e8m0fnu)), e8m0_to_fp32(b))


# ---------------------------------------------------------------------------------------------
# Packed UE8M0: int32, 4 groups per word, MN-major, TMA-aligned (stride (1, round_up(MN, 4))).
# ---------------------------------------------------------------------------------------------


def test_pack_ue8m0_hand_built_byte_order() -> None:
    # MN=3, G=5 -> P=2 words per row, tma=4. Byte j of word p is group 4p+j, LSB first.
    exps = torch.tensor(
        [
            [0x01, 0x02, 0x03, 0x84, 0x05],
            [0x11, 0x12, 0x13, 0x14, 0x15],
            [0x21, 0x22, 0x23, 0xF4, 0x25],
        ],
        dtype=torch.uint8,
    )
    packed = pack_ue8m0(exps)
    assert packed.dtype == torch.int32 and packed.shape == (3, 2) and packed.stride() == (1, 4)
    wrap = 1 << 32  # words with a top byte >= 0x80 read as negative int32
    assert packed.tolist() == [
        [0x84030201 - wrap, 0x05],
        [0x14131211, 0x15],
        [0xF4232221 - wrap, 0x25],
    ]
    # Storage: word column 0 for rows 0..2, a zero TMA pad row, then word column 1, pad.
    storage = packed.as_strided((8,), (1,))
    assert storage.tolist() == [
        0x84030201 - wrap, 0x14131211, 0xF4232221 - wrap, 0,
        0x05, 0x15, 0x25, 0,
    ]  # fmt: skip
    # In memory (little-endian, as the GPU reads it) row 0's first word is bytes 01 02 03 84.
    assert storage.view(torch.uint8)[:4].tolist() == [0x01, 0x02, 0x03, 0x84]


@pytest.mark.parametrize("g", [1, 3, 5, 7])
@pytest.mark.parametrize("mn", [1, 3, 5, 130])
def test_pack_unpack_round_trip(mn: int, g: int) -> None:
    gen = torch.Generator().manual_seed(1000 * mn + g)
    exps = torch.randint(0, 256, (mn, g), generator=gen, dtype=torch.int32).to(torch.uint8)
    packed = pack_ue8m0(exps)
    p, tma = ceil_div(g, 4), round_up(mn, 4)
    assert packed.shape == (mn, p) and packed.stride() == (1, tma)
    assert torch.equal(unpack_ue8m0(packed, g), exps)
    # Bytes of groups >= G are 0; so are the TMA pad rows MN..tma-1 in storage.
    assert not bool(unpack_ue8m0(packed, 4 * p)[:, g:].any())
    assert not bool(packed.as_strided((tma, p), (1, tma))[mn:].any())


def test_pack_ue8m0_batched_strides() -> None:
    exps = torch.arange(2 * 3 * 5, dtype=torch.uint8).reshape(2, 3, 5)
    packed = pack_ue8m0(exps)
    # batch stride = P * tma = 2 * 4; the whole storage is 2 batches of [P, tma].
    assert packed.shape == (2, 3, 2) and packed.stride() == (8, 1, 4)
    assert torch.equal(unpack_ue8m0(packed, 5), exps)
    assert packed[1, 0, 0].item() == 15 | 16 << 8 | 17 << 16 | 18 << 24


def test_pack_ue8m0_empty_mn() -> None:
    packed = pack_ue8m0(torch.zeros(0, 6, dtype=torch.uint8))
    assert packed.shape == (0, 2) and unpack_ue8m0(packed, 6).shape == (0, 6)


def test_unpack_ue8m0_accepts_any_strides() -> None:
    exps = torch.arange(5 * 7, dtype=torch.uint8).reshape(5, 7)
    row_major = pack_ue8m0(exps).contiguous()
    assert row_major.stride() == (2, 1)
    assert torch.equal(unpack_ue8m0(row_major, 7), exps)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(
            lambda: pack_ue8m0(torch.zeros(3, 5, dtype=torch.int32)), r"uint8", id="pack-dtype"
        ),
        pytest.param(lambda: pack_ue8m0(torch.zeros(5, dtype=torch.uint8)), r"2 dims", id="1d"),
        pytest.param(
            lambda: unpack_ue8m0(torch.zeros(3, 2, dtype=torch.int32), 9), r"P=2", id="groups"
        ),
        pytest.param(
            lambda: unpack_ue8m0(torch.zeros(3, 2, dtype=torch.int64), 5),
            r"packed must have dtype int32",
            id="unpack-dtype",
        ),
    ],
)
def test_pack_ue8m0_rejects(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
