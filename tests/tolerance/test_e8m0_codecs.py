"""The E8M0 codecs on the three sides of the independence line agree, bit for bit.

Each side has its own codec on purpose: the golden's (reference/formats.py: pack_ue8m0,
unpack_ue8m0, ue8m0_bytes, e8m0_to_fp32), the optimized path's (optimized/kernels/quant.py:
pack_ue8m0, pack_ue8m0_from_fp32; the Triton helpers of optimized/kernels/e8m0.py) and
tolerance's (tolerance/stages/layouts.py: unpack_ue8m0, fp32_to_e8m0, e8m0_to_float), which may
import neither of the others (tests/spec/test_layering.py), so a side's packed scales are never
judged by that side's own decoder. Here one side encodes and another decodes: a byte-order, sign or
pad slip in any one of them shows as a difference.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import triton
import triton.language as tl

from moe_verify.common.device import default_device
from optimized.kernels import quant
from optimized.kernels.e8m0 import e8m0_to_fp32, pow2_from_byte, ue8m0_byte
from reference import formats
from tolerance.results import ContractError
from tolerance.stages import layouts

pytestmark = pytest.mark.cpu

# The bytes at the ends of the range: 2^-127 (byte 0, an fp32 subnormal when decoded), 1.0 (127),
# 2^127 (254), NaN (255), and their neighbours; 255 sets a packed word's sign bit in slot 3.
EDGE_BYTES = (0, 1, 126, 127, 128, 253, 254, 255)
# (MN, G): odd group counts leave pad bytes in the last word, MN % 4 != 0 leaves TMA pad rows.
SHAPES = [(1, 1), (3, 3), (5, 5), (2, 7), (8, 9), (4, 13), (17, 6), (3, 8)]


def exponent_bytes(mn: int, g: int) -> torch.Tensor:
    """Random uint8 [mn, g] that holds every edge byte (as many as fit), in random places."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"e8m0-{mn}-{g}".encode()))
    flat = torch.randint(0, 256, (mn * g,), generator=gen, dtype=torch.int32)
    edges = torch.tensor(EDGE_BYTES[: mn * g], dtype=torch.int32)
    flat[torch.randperm(mn * g, generator=gen)[: len(edges)]] = edges
    return flat.to(torch.uint8).view(mn, g)


def assert_read_back(packed: torch.Tensor, b: torch.Tensor) -> None:
    """`packed` holds the bytes `b` for the golden's unpacker (uint8) and tolerance's (int64: its
    scale comparison puts -1 beside the bytes for a value that has none), each in its own dtype."""
    g = b.shape[-1]
    assert torch.equal(formats.unpack_ue8m0(packed, g), b)
    assert torch.equal(layouts.unpack_ue8m0(packed, g), b.to(torch.int64))


@pytest.mark.parametrize(("mn", "g"), SHAPES, ids=[f"MN{mn}-G{g}" for mn, g in SHAPES])
def test_each_packer_is_read_back_by_every_unpacker(mn: int, g: int) -> None:
    b = exponent_bytes(mn, g)
    golden, optimized = formats.pack_ue8m0(b), quant.pack_ue8m0(b)
    assert optimized.dtype == golden.dtype == torch.int32
    assert optimized.stride() == golden.stride()
    assert torch.equal(optimized, golden)
    assert_read_back(golden, b)
    assert_read_back(optimized, b)


def test_a_column_major_input_and_a_batch_are_read_back() -> None:
    b = exponent_bytes(12, 7)
    column_major = b.t().contiguous().t()
    assert torch.equal(layouts.unpack_ue8m0(quant.pack_ue8m0(column_major), 7), b.long())
    batch = torch.stack([exponent_bytes(5, 9), exponent_bytes(5, 9).flip(0)])
    golden, optimized = formats.pack_ue8m0(batch), quant.pack_ue8m0(batch)
    assert torch.equal(formats.unpack_ue8m0(optimized, 9), batch)
    for e in range(2):
        assert torch.equal(layouts.unpack_ue8m0(golden[e], 9), batch[e].long())
        assert torch.equal(layouts.unpack_ue8m0(optimized[e], 9), batch[e].long())


def test_every_byte_from_fp32_bits_on_every_side() -> None:
    """All 256 bytes as the fp32 each stands for in a scale tensor (byte << 23: +0.0 for 0, +Inf
    for 255): the golden's and tolerance's fp32 -> byte, and the optimized fp32 packer read back
    by the other two. validate=False lets +Inf through (DeepGEMM's packer also takes it)."""
    b = torch.arange(256, dtype=torch.int32)
    scale = (b << 23).view(torch.float32)
    assert torch.equal(formats.ue8m0_bytes(scale), b.to(torch.uint8))
    assert torch.equal(layouts.fp32_to_e8m0(scale), b.long())
    packed = quant.pack_ue8m0_from_fp32(scale.view(16, 16), validate=False)
    assert_read_back(packed, b.to(torch.uint8).view(16, 16))


def test_every_byte_decodes_to_the_same_value_on_both_sides() -> None:
    """2^(b - 127), byte 0 the fp32 subnormal 2^-127 and 255 NaN, as the tensor core reads them."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    golden = formats.e8m0_to_fp32(b).to(torch.float64)
    judged = layouts.e8m0_to_float(b)
    nan = golden.isnan()
    assert nan.nonzero().flatten().tolist() == [255]
    assert torch.equal(judged.isnan(), nan)
    assert torch.equal(golden[~nan].view(torch.int64), judged[~nan].view(torch.int64))
    assert golden[0].item() == 2.0**-127


@triton.jit
def _decode_every_byte(byte_ptr, read_ptr, field_ptr, back_ptr):
    offs = tl.arange(0, 256)
    byte = tl.load(byte_ptr + offs)
    tl.store(read_ptr + offs, e8m0_to_fp32(byte))
    field = pow2_from_byte(byte)
    tl.store(field_ptr + offs, field)
    tl.store(back_ptr + offs, ue8m0_byte(field))


def test_every_byte_through_the_triton_helpers() -> None:
    """The kernels' two readings of all 256 bytes: the tensor core's (`e8m0_to_fp32`, as the
    golden and tolerance decode) and the exponent field's (`pow2_from_byte`: byte << 23, +0.0
    for 0 and +Inf for 255), which `ue8m0_byte` and the golden's `ue8m0_bytes` turn back into
    the byte."""
    device = default_device()
    b = torch.arange(256, dtype=torch.int32, device=device)
    read, field = torch.empty(256, device=device), torch.empty(256, device=device)
    back = torch.empty(256, dtype=torch.int32, device=device)
    _decode_every_byte[(1,)](b, read, field, back)
    golden = formats.e8m0_to_fp32(b.cpu().to(torch.uint8))
    assert torch.equal(read.cpu().isnan(), golden.isnan())
    assert torch.equal(read.cpu()[:255].view(torch.int32), golden[:255].view(torch.int32))
    assert torch.equal(field.cpu().view(torch.int32), b.cpu() << 23)
    assert torch.equal(back.cpu(), b.cpu())
    assert torch.equal(formats.ue8m0_bytes(field.cpu()), b.cpu().to(torch.uint8))


@pytest.mark.parametrize(
    ("packed", "groups", "match"),
    [
        (torch.zeros(3, 2, dtype=torch.int64), 5, "int32"),
        (torch.zeros(2, 3, 2, dtype=torch.int32), 5, r"\[R, P\]"),
        (torch.zeros(3, 2, dtype=torch.int32), 9, "hold 8 groups per row, need 9"),
    ],
    ids=["dtype", "3d", "too-few-words"],
)
def test_tolerance_refuses_what_it_cannot_read(
    packed: torch.Tensor, groups: int, match: str
) -> None:
    with pytest.raises(ContractError, match=match):
        layouts.unpack_ue8m0(packed, groups)
