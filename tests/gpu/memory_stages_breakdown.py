"""Measurement script (not a test): where permute's and act_quant's time goes, by variants of
their kernels that leave one piece out or do it another way, timed side by side by CUDA-graph
replay with a device copy in the same run (issue 39: both stages under 75% of copy bandwidth).

    python tests/gpu/memory_stages_breakdown.py [permute] [act_quant] > breakdown.json

Shape: DeepSeek-V3 EP8-local at T=4096 (32 local experts, k=8, H=7168, I=2048, alignment 128,
uniform routing, fp32 scales), the `bench --production` case of docs/perf.md.

permute (optimized/kernels/scatter.py): `ep_scatter` with and without zeroing the padding rows;
its segments kernel alone; a copy of the scatter kernel with the row claim (atomics), the scale
stores or the store cache policy changed, and a row-ordered form (each program writes whole
output rows, so the MN-major scale stores coalesce); a plain copy of the live bytes.

act_quant (optimized/kernels/act_quant.py): the kernel as shipped, under the psum and the
m_indices layouts; launch shapes (rows and groups per program, warps), their codes compared with
the shipped kernel's; and copies of the module whose y / s is not the IEEE division per element
(a reciprocal per group and Markstein's FMA correction, with and without a fallback for tiny
scales; a bare multiply by the reciprocal; no exp and no division at all), with how many codes
each changes. Diagnostic variants are not correct kernels:
they say what a piece costs.

Without CUDA it runs the same code on tiny shapes under the Triton interpreter (times 0), which
is how a CPU checks that it still runs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from moe_verify.common.timing import replay_seconds
from moe_verify.production.bench import copy_bandwidth
from moe_verify.spec import Activation, ScaleFmt
from optimized.kernels import act_quant as aq
from optimized.kernels import scatter as sc
from optimized.kernels.psum import block_experts
from optimized.kernels.slot_counts import aligned_m_sum_upper_bound, count_expert_tokens

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
Results = dict[str, object]


def time_us(fn: Callable[[], object]) -> float:
    """Microseconds per call, CUDA-graph replayed (10 calls per graph, median of 20); 0 on a
    CPU, where the call runs once."""
    if not CUDA:
        fn()
        return 0.0
    return replay_seconds(fn, DEV, repeats=20, calls=10) * 1e6


def bandwidth() -> float:
    return copy_bandwidth(DEV) if CUDA else float("nan")


# -- permute ----------------------------------------------------------------------------------


@triton.jit
def _scatter_variant(
    a_ptr, stride_am, scale_ptr, stride_sm, stride_sk, ids_ptr, stride_it, rows_ptr,
    cursor_ptr, out_ptr, stride_om, out_scale_ptr, stride_osm, stride_osk, num_tokens, H, SK,
    TOPK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    ATOMICS: tl.constexpr, SCALES: tl.constexpr, EVICT_FIRST: tl.constexpr,
):  # fmt: skip
    """The scatter kernel's copy loop (ids local, no map): the row claimed by atomics or read
    from a precomputed inv_perm; scales stored or not; row stores evict-first or not."""
    slots = tl.arange(0, BLOCK_K)
    slot_mask = slots < TOPK
    for t in range(tl.program_id(0).to(tl.int64), num_tokens, tl.num_programs(0)):
        eid = tl.load(ids_ptr + t * stride_it + slots, mask=slot_mask, other=-1)
        live = eid >= 0
        if ATOMICS:
            row = tl.atomic_add(cursor_ptr + tl.where(live, eid, 0), 1, mask=live, sem="relaxed")
        else:
            row = tl.load(rows_ptr + t * TOPK + slots, mask=slot_mask, other=-1)
        live = live & (row >= 0)
        row64 = row.to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            x = tl.load(a_ptr + t * stride_am + cols, mask=cols < H)
            dst = out_ptr + row64[:, None] * stride_om + cols[None, :]
            tile = tl.broadcast_to(x[None, :], [BLOCK_K, BLOCK_H])
            mask = live[:, None] & (cols < H)[None, :]
            if EVICT_FIRST:
                tl.store(dst, tile, mask=mask, eviction_policy="evict_first")
            else:
                tl.store(dst, tile, mask=mask)
        if SCALES:
            for s0 in range(0, SK, BLOCK_S):
                g = s0 + tl.arange(0, BLOCK_S)
                s = tl.load(scale_ptr + t * stride_sm + g * stride_sk, mask=g < SK)
                dst = out_scale_ptr + row64[:, None] * stride_osm + g[None, :] * stride_osk
                tl.store(
                    dst,
                    tl.broadcast_to(s[None, :], [BLOCK_K, BLOCK_S]),
                    mask=live[:, None] & (g < SK)[None, :],
                )


@triton.jit
def _row_ordered_copy(
    a_ptr, stride_am, scale_ptr, stride_sm, stride_sk, src_ptr, out_ptr, stride_om,
    out_scale_ptr, stride_osk, m_sum, H, SK,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, ZERO: tl.constexpr,
):  # fmt: skip
    """Permute by output rows: each row's token (src, -1 on padding) gathered, BLOCK_R whole
    rows stored per program, so the MN-major scale stores of consecutive rows coalesce."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_buf = rows < m_sum
    src = tl.load(src_ptr + rows, mask=in_buf, other=-1)
    live = src >= 0
    src64 = tl.where(live, src, 0).to(tl.int64)
    written = in_buf if ZERO else live
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(
            a_ptr + src64[:, None] * stride_am + cols[None, :],
            mask=live[:, None] & (cols < H)[None, :],
            other=0,
        )
        dst = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(dst, x, mask=written[:, None] & (cols < H)[None, :])
    for s0 in range(0, SK, BLOCK_S):
        g = s0 + tl.arange(0, BLOCK_S)
        s = tl.load(
            scale_ptr + src64[:, None] * stride_sm + g[None, :] * stride_sk,
            mask=live[:, None] & (g < SK)[None, :],
            other=0,
        )
        dst = out_scale_ptr + rows[:, None] + g.to(tl.int64)[None, :] * stride_osk
        tl.store(dst, s, mask=in_buf[:, None] & (g < SK)[None, :])


def permute(r: Results, tokens: int = 4096, hidden: int = 7168, k: int = 8, experts: int = 32,
            align: int = 128) -> None:  # fmt: skip
    g = torch.Generator(device=DEV).manual_seed(0)
    a = (torch.randn(tokens, hidden, device=DEV, generator=g) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(tokens, hidden // 128, device=DEV, generator=g) + 0.5
    ids = torch.stack(
        [torch.randperm(experts, device=DEV, generator=g)[:k] for _ in range(tokens)]
    ).to(torch.int32)
    counts = count_expert_tokens(ids, experts)
    m_sum = aligned_m_sum_upper_bound(tokens, k, experts, align)
    buf = torch.empty(m_sum, hidden, dtype=a.dtype, device=DEV)

    def scatter(zero: bool) -> sc.Scattered:
        return sc.ep_scatter(
            a, s, ids, counts, experts, align, m_sum, validate=False, a_perm_out=buf,
            zero_padding=zero,
        )  # fmt: skip

    ref = scatter(True)
    sk = s.shape[1]
    live = tokens * k
    floor = tokens * (hidden + sk * 4) + live * (hidden + sk * 4)
    bw = bandwidth()
    r["copy bandwidth GB/s"] = bw / 1e9
    r["permute floor us (live rows, as bench --production)"] = floor / bw * 1e6
    r["permute rows (live, m_sum)"] = [live, m_sum]
    r["ep_scatter, padding zeroed (m_indices)"] = time_us(lambda: scatter(True))
    r["ep_scatter, padding left (psum)"] = time_us(lambda: scatter(False))

    lead = (m_sum + 3) // 4 * 4
    storage = torch.empty(sk, lead, dtype=torch.float32, device=DEV)
    m_indices = torch.empty(m_sum, dtype=torch.int32, device=DEV)
    start = torch.empty(experts, dtype=torch.int32, device=DEV)
    ends, cursor = torch.empty_like(start), torch.empty_like(start)
    out = buf.view(torch.uint8)
    for zero in (True, False):

        def segments(zero: bool = zero) -> None:
            sc._segments_kernel[(experts + triton.cdiv(lead, 32),)](
                counts, start, ends, cursor, m_indices, out, out.stride(0),
                storage.view(torch.int32), lead, sk, hidden, m_sum, experts, ALIGN=align,
                ZERO_ROWS=zero, BLOCK_E=max(16, triton.next_power_of_2(experts)), BLOCK_R=32,
                BLOCK_H=1024, BLOCK_C=64, num_warps=4,
            )  # fmt: skip

        r[f"segments kernel alone, zero rows={zero}"] = time_us(segments)

    segments()
    inv = ref.inv_perm.clone()
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count if CUDA else 2
    scale_words = s.view(torch.int32)
    out_scales = storage.view(torch.int32).t()

    def variant(atomics=True, scales=True, evict=False, block_h=2048, warps=4, per_sm=8):
        def fn() -> None:
            if atomics:
                cursor.copy_(start)
            _scatter_variant[(min(tokens, per_sm * sms),)](
                a.view(torch.uint8), hidden, scale_words, scale_words.stride(0),
                scale_words.stride(1), ids, k, inv, cursor, out, out.stride(0), out_scales,
                out_scales.stride(0), out_scales.stride(1), tokens, hidden, sk, TOPK=k,
                BLOCK_K=triton.next_power_of_2(k), BLOCK_H=block_h, BLOCK_S=64,
                ATOMICS=atomics, SCALES=scales, EVICT_FIRST=evict, num_warps=warps,
            )  # fmt: skip

        return fn

    r["scatter copy: as shipped (atomics, scales)"] = time_us(variant())
    r["scatter copy: no scale stores"] = time_us(variant(scales=False))
    r["scatter copy: rows from inv_perm, no atomics"] = time_us(variant(atomics=False))
    r["scatter copy: no atomics, no scales"] = time_us(variant(atomics=False, scales=False))
    r["scatter copy: evict_first row stores"] = time_us(variant(evict=True))
    r["scatter copy: 8192 columns, 8 warps"] = time_us(variant(block_h=8192, warps=8))
    r["scatter copy: 1024 columns, 16 programs per SM"] = time_us(variant(block_h=1024, per_sm=16))

    src = torch.full((m_sum,), -1, dtype=torch.int32, device=DEV)
    slots = inv.flatten().long()
    ok = slots >= 0
    src[slots[ok]] = (torch.arange(tokens * k, device=DEV)[ok] // k).to(torch.int32)
    for zero in (True, False):
        for block_r, block_h in ((8, 1024), (16, 1024), (32, 512), (4, 2048)):

            def ordered(zero: bool = zero, block_r: int = block_r, block_h: int = block_h):
                _row_ordered_copy[(triton.cdiv(m_sum, block_r),)](
                    a.view(torch.uint8), hidden, scale_words, scale_words.stride(0),
                    scale_words.stride(1), src, out, out.stride(0), out_scales,
                    out_scales.stride(1), m_sum, hidden, sk, BLOCK_R=block_r, BLOCK_H=block_h,
                    BLOCK_S=64, ZERO=zero, num_warps=4,
                )  # fmt: skip

            r[f"row-ordered copy: zero={zero} rows={block_r} columns={block_h}"] = time_us(ordered)
    ordered()
    rows = slots[ok]
    r["row-ordered copy: live rows equal ep_scatter's"] = torch.equal(
        buf.view(torch.uint8)[rows], ref.a_perm.view(torch.uint8)[rows]
    )
    dst = torch.empty(tokens * hidden * k, dtype=torch.uint8, device=DEV)
    src_bytes = a.view(torch.uint8).flatten().repeat(k)
    r["plain copy of the live bytes written (k*T*H)"] = time_us(lambda: dst.copy_(src_bytes))


# -- act_quant --------------------------------------------------------------------------------

_DIVISION = "q = to_fp8_satfinite(divide_by_scale(y, s, PACKED or CEIL_UE8M0))"
_EXACT = "PACKED or CEIL_UE8M0"  # power-of-two scales: a multiply already, left alone
_MARKSTEIN = """
@triton.jit
def _markstein(x, s, FALLBACK: tl.constexpr):
    # one IEEE reciprocal per group, then q = x*r and q + (x - q*s)*r, both FMAs exact
    s3 = s[:, :, None] + tl.zeros_like(x)
    if FALLBACK:
        if tl.min(s) < 2.0**-90:  # the residual could underflow: divide exactly
            return div_rn(x, s3)
    r = div_rn(1.0 + tl.zeros_like(s), s)[:, :, None] + tl.zeros_like(x)
    q = x * r
    e = tl.fma(-q, s3, x)
    return tl.where((tl.abs(e) > 0.0) & (r > 0.0), tl.fma(e, r, q), q)


@triton.jit
def _bf16(x):"""


def _division(expr: str) -> str:
    return f"q = to_fp8_satfinite(divide_by_scale(y, s, True) if {_EXACT} else {expr})"


# name: (source replacements, whether its codes must equal the shipped kernel's)
_DIVISION_VARIANTS = {
    "reciprocal + Markstein's correction, tile fallback for tiny scales (tried 2026-12-06)": (
        {"@triton.jit\ndef _bf16(x):": _MARKSTEIN, _DIVISION: _division("_markstein(y, s, True)")},
        True,
    ),
    "reciprocal + Markstein's correction, no fallback (act_quant's scales are >= 2^-42)": (
        {"@triton.jit\ndef _bf16(x):": _MARKSTEIN, _DIVISION: _division("_markstein(y, s, False)")},
        True,
    ),
    "multiply by the reciprocal (not exact)": (
        {_DIVISION: _division("y * (1.0 / s)[:, :, None]")},
        False,
    ),
    "no exp, no division (diagnostic)": (
        {
            "return g / (1.0 + tl.exp(-g * alpha))": "return g * alpha",
            _DIVISION: _division("y * (1.0 / s)[:, :, None]"),
        },
        False,
    ),
}


def _module_variant(name: str, replacements: dict[str, str], where: Path) -> object:
    text = Path(aq.__file__).read_text()
    for old, new in replacements.items():
        if old not in text:
            raise ValueError(f"{name}: the act_quant source no longer holds {old!r}")
        text = text.replace(old, new)
    path = where / f"act_quant_variant_{abs(hash(name))}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def act_quant(r: Results, rows_per_expert: int = 1024, experts: int = 32, inter: int = 2048,
              align: int = 128) -> None:  # fmt: skip
    g = torch.Generator(device=DEV).manual_seed(1)
    segment = rows_per_expert + align  # each expert's live rows, then a gap of `align` rows
    m = experts * segment
    mm1 = (torch.randn(m, 2 * inter, device=DEV, generator=g) * 2).to(torch.bfloat16)
    ends = torch.arange(experts, device=DEV, dtype=torch.int32) * segment + rows_per_expert
    starts = torch.arange(experts, device=DEV) * segment
    live = (starts[:, None] + torch.arange(rows_per_expert, device=DEV)[None, :]).flatten()
    act = Activation()
    bw = bandwidth()
    floor = live.numel() * (2 * inter * 2 + inter + (inter // 128) * 4)
    r["act_quant floor us (live rows)"] = floor / bw * 1e6

    def shipped(fmt: ScaleFmt, psum: bool = True, module: object = aq):
        kw = dict(expert_ends=ends, expert_alignment=align) if psum else {}
        return lambda: module.silu_mul_quant(mm1, act, 128, fmt, validate=False, **kw)

    for fmt in (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0):
        r[f"act_quant {fmt.value}: shipped, psum"] = time_us(shipped(fmt))
        r[f"act_quant {fmt.value}: shipped, m_indices (every row)"] = time_us(shipped(fmt, False))
    fmt = ScaleFmt.FLOAT32
    q0, s0 = shipped(fmt)()
    for block_m, groups, warps in ((32, 1, 4), (8, 1, 4), (16, 2, 8), (8, 4, 8)):
        q = torch.empty(m, inter, dtype=torch.float8_e4m3fn, device=DEV)
        s = torch.empty(inter // 128, m, dtype=torch.float32, device=DEV).t()

        def launch(block_m=block_m, groups=groups, warps=warps, q=q, s=s) -> None:
            aq._silu_mul_quant_kernel[(triton.cdiv(m, block_m), triton.cdiv(inter // 128, groups))](
                mm1, q, s, m, inter, mm1.stride(0), q.stride(0), s.stride(0), s.stride(1),
                act.alpha, act.beta, 0.0, ends, experts, align, GROUP=128,
                GROUPS_PER_PROGRAM=groups, BLOCK_M=block_m, HAS_LIMIT=False, PACKED=False,
                CEIL_UE8M0=False, PSUM=True, BLOCK_E=block_experts(experts), num_warps=warps,
            )  # fmt: skip

        name = f"act_quant float32: {block_m} rows x {groups} groups, {warps} warps"
        r[name] = time_us(launch)
        launch()
        r[name + ", codes and scales as shipped"] = torch.equal(
            q.view(torch.uint8)[live], q0.view(torch.uint8)[live]
        ) and torch.equal(s[live], s0[live])
    stress = {
        "every bf16 bit pattern": torch.randint(
            0, 1 << 16, (256, 2 * inter), device=DEV, dtype=torch.int32, generator=g
        )
        .to(torch.int16)
        .view(torch.bfloat16),
        "rows scaled by 2^-60..2^60": (
            torch.randn(256, 2 * inter, device=DEV, generator=g)
            * torch.exp2(torch.randint(-60, 60, (256, 1), device=DEV, generator=g).float())
        ).to(torch.bfloat16),
    }
    with tempfile.TemporaryDirectory() as where:
        for name, (replacements, exact) in _DIVISION_VARIANTS.items():
            module = _module_variant(name, replacements, Path(where))
            r[f"act_quant float32, {name}: meant to be exact"] = exact
            r[f"act_quant float32, {name}"] = time_us(shipped(fmt, module=module))
            q1, _ = shipped(fmt, module=module)()
            differ = q1.view(torch.uint8)[live] != q0.view(torch.uint8)[live]
            r[f"act_quant float32, {name}: codes that differ from shipped"] = int(differ.sum())
            for what, x in stress.items():
                x = torch.where(x.isfinite(), x, torch.zeros_like(x))
                a = aq.silu_mul_quant(x, act, 128, fmt)[0].view(torch.uint8)
                b = module.silu_mul_quant(x, act, 128, fmt)[0].view(torch.uint8)
                r[f"act_quant float32, {name}: codes that differ, {what}"] = int((a != b).sum())


def main(parts: list[str]) -> None:
    small = not CUDA  # the interpreter: tiny shapes, just to run the code
    results: Results = {"device": torch.cuda.get_device_name() if CUDA else "cpu (interpreter)"}
    for part in parts or ["permute", "act_quant"]:
        if part == "permute":
            permute(results, *((16, 256, 2, 4, 16) if small else ()))
        elif part == "act_quant":
            act_quant(results, *((8, 4, 256, 8) if small else ()))
        else:
            raise SystemExit(f"unknown part {part!r}: permute | act_quant")
        print(json.dumps(results, indent=1), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
