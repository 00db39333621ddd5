"""Synthetic traces for the tolerance tests: a tiny golden-like staged MoE written by hand.

This is not the golden (`reference/` owns that): it is just enough math that every stage's tensors
agree with each other (T=4 tokens, k=2, E=4 experts, H=I=128, alignment 8), so a test can mutate
one entry of a copy and watch exactly the check that owns it fail.
"""

from __future__ import annotations

import torch

from moe_verify.spec import FP8_MAX, MoEProblem, Status, Trace
from reference import formats
from tolerance.provenance import tag_hidden_states

# Rows name the edge they exercise: expert 3 is empty (last), token 3 has a -1 slot, expert 2
# takes three slots (an odd count inside an 8-row segment).
ROUTE_IDS = [[0, 1], [2, 0], [1, 2], [2, -1]]
ALIGNMENT = 8


def tiny_problem(recipe: str = "fp8_block", scale_fmt: str = "float32") -> MoEProblem:
    return MoEProblem(
        tokens=4,
        hidden=128,
        intermediate=128,
        num_experts=4,
        topk=2,
        recipe=recipe,
        scale_fmt=scale_fmt,
        alignment=ALIGNMENT,
    )


def quant_groups(x: torch.Tensor, group: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, N] -> (e4m3 codes [R, N], fp32 scales [R, N/group]); amax/448, optional ceil."""
    r, n = x.shape
    xg = x.view(r, n // group, group)
    scale = xg.abs().amax(dim=-1).clamp_min(1e-10) / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(r, n), scale


def dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [R, N] and fp32 scales [R, G] -> fp32 [R, N]."""
    group = q.shape[1] // scale.shape[1]
    return q.to(torch.float32) * scale.repeat_interleave(group, dim=1)


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales -> uint8 exponent bytes."""
    return (torch.log2(scale).round() + 127).to(torch.uint8)


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 [R, G] -> int32 [R, ceil(G/4)] as the golden packs it (group 4p+j in byte
    j, pad bytes 0, MN-major with strides (1, round_up(R, 4))); tolerance's own unpacker is held to
    that packer in tests/tolerance/test_e8m0_codecs.py."""
    return formats.pack_ue8m0(e8m0_bytes(scale))


def build_golden(
    problem: MoEProblem, *, with_reduce: bool = True, seed: int = 0, provenance: bool = False
) -> Trace:
    """A consistent single-rank trace of every stage (plus `reduce`, the one rank's output);
    with `provenance`, each token's activations carry its index (`tag_hidden_states`)."""
    gen = torch.Generator().manual_seed(seed)
    t, h, i, e, k = problem.tokens, problem.hidden, problem.intermediate, problem.num_experts, 2
    group = problem.recipe.act_group
    ue8m0 = problem.scale_fmt.is_ue8m0
    mx = problem.recipe.value == "mxfp8"
    packed = problem.scale_fmt.value == "ue8m0_packed"
    trace = Trace("golden")

    ids = torch.tensor(ROUTE_IDS, dtype=torch.int32)
    raw = torch.rand(t, k, generator=gen) + 0.1
    raw = torch.where(ids >= 0, raw, torch.zeros_like(raw))
    weights = raw / raw.sum(dim=1, keepdim=True)
    trace.add("route", {"topk_ids": ids, "topk_weights": weights})

    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    if provenance:
        x = tag_hidden_states(x)
    a1q, a1s = quant_groups(x.float(), group, ue8m0)
    trace.add("quant_input", {"a1q": a1q, "a1q_scale": e8m0_bytes(a1s) if mx else a1s})

    counts = torch.bincount(ids[ids >= 0].long(), minlength=e).to(torch.int32)
    padded = (counts.long() + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    m_sum = int(padded.sum())
    starts = torch.cumsum(padded, 0) - padded
    slots = t * k  # both upper bounds of M_sum, by hand: min(8, E=4) = E, so they coincide
    bound = -(-(slots + min(slots, e) * (ALIGNMENT - 1)) // ALIGNMENT) * ALIGNMENT
    recipes = {"exact_counts": m_sum, "min_active_bound": bound, "all_experts_bound": bound}
    trace.add(
        "align",
        {
            "M_sum": m_sum,
            "alignment": ALIGNMENT,
            "counts": counts,
            "M_sum_recipes": recipes,
        },
    )

    m_indices = torch.full((m_sum,), -1, dtype=torch.int32)
    inv_perm = torch.full((t, k), -1, dtype=torch.int32)
    cursor = starts.clone()
    for tok in range(t):
        for slot in range(k):
            ex = int(ids[tok, slot])
            if ex >= 0:
                inv_perm[tok, slot] = int(cursor[ex])
                m_indices[int(cursor[ex])] = ex
                cursor[ex] += 1
    live = inv_perm >= 0
    rows = inv_perm[live].long()
    tokens = torch.arange(t)[:, None].expand(t, k)[live]
    a_perm = torch.zeros(m_sum, h, dtype=torch.float8_e4m3fn)
    a_perm[rows] = a1q[tokens]
    scale_perm = torch.zeros(m_sum, h // group)
    scale_perm[rows] = a1s[tokens]
    trace.add(
        "permute",
        {
            "a_perm": a_perm,
            "a_scale_perm": pack_ue8m0(scale_perm) if mx else scale_perm,
            "m_indices": m_indices,
            "expert_ends": (starts + counts).to(torch.int32),
            "inv_perm": inv_perm,
            "expert_start": starts.to(torch.int32),
        },
    )

    w13 = torch.randn(e, 2 * i, h, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, i, generator=gen) * i**-0.5
    experts = m_indices[rows].long()
    mm1 = torch.zeros(m_sum, 2 * i, dtype=torch.bfloat16)
    a_deq = dequant(a_perm[rows], scale_perm[rows])
    mm1[rows] = torch.einsum("rh,rnh->rn", a_deq, w13[experts]).to(torch.bfloat16)
    trace.add("gemm1", {"mm1": mm1, "engine": "torch"})

    gate, up = mm1[:, :i].float(), mm1[:, i:].float()
    y = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16).float()
    a2q, a2s = quant_groups(y, group, ue8m0)
    if packed:
        a2s_stored = pack_ue8m0(a2s)
    else:
        a2s_stored = torch.empty_strided(a2s.shape, (1, m_sum))  # column-major, as vLLM's
        a2s_stored.copy_(a2s)
    trace.add("act_quant", {"a2q": a2q, "a2q_scale": a2s_stored})

    mm2 = torch.zeros(m_sum, h, dtype=torch.bfloat16)
    a2_deq = dequant(a2q[rows], a2s[rows])
    mm2[rows] = torch.einsum("ri,rhi->rh", a2_deq, w2[experts]).to(torch.bfloat16)
    trace.add("gemm2", {"mm2": mm2, "engine": "torch"})

    out = torch.zeros(t, h)
    for slot in range(k):
        r = inv_perm[:, slot].long()
        use = r >= 0
        out[use] += mm2[r[use]].float() * weights[use, slot, None]
    out = out.to(torch.bfloat16)
    trace.add("gather", {"out": out})
    if with_reduce:
        trace.add("reduce", {"out": out.clone()})
    return trace


def clone_trace(trace: Trace, backend: str = "candidate") -> Trace:
    """A deep copy (tensors cloned with their strides) under another backend name."""
    out = Trace(backend, trace.rank)
    for stage, outs in trace.items():
        out.add(
            stage, {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in outs.items()}
        )
    return out


def replace_stage(trace: Trace, stage: str, outputs: dict[str, object] | None) -> Trace:
    """A copy of `trace` with one stage's outputs replaced (None drops the stage)."""
    out = Trace(trace.backend, trace.rank)
    for name, outs in trace.items():
        if name != stage:
            out.add(name, outs)
        elif outputs is not None:
            out.add(name, outputs)
    return out


def mark_stage(trace: Trace, stage: str, status: Status, reason: str) -> Trace:
    """A copy of `trace` whose `stage` is recorded as skipped (Status.SKIP) or as raised
    (Status.ERROR) with `reason`, as a backend's runner records them."""
    out = Trace(trace.backend, trace.rank)
    for name, outs in trace.items():
        if name != stage:
            out.add(name, outs)
        elif status is Status.SKIP:
            out.add_skipped(name, reason)
        else:
            out.add_error(name, reason)
    return out


def slot_row(trace: Trace, token: int, k: int) -> int:
    return int(trace["permute"]["inv_perm"][token, k])


def reorder_segments(trace: Trace, backend: str = "candidate") -> Trace:
    """A copy whose rows inside every expert segment are reversed, with inv_perm following:
    the same data in another (legal) atomic order."""
    out = clone_trace(trace, backend)
    m_indices = trace["permute"]["m_indices"]
    counts = trace["align"]["counts"]
    starts = trace["permute"]["expert_start"]
    new_row = torch.arange(m_indices.numel())
    for ex in range(counts.numel()):
        s, c = int(starts[ex]), int(counts[ex])
        new_row[s : s + c] = torch.arange(s + c - 1, s - 1, -1)
    for stage, name in (
        ("permute", "a_perm"),
        ("permute", "a_scale_perm"),
        ("gemm1", "mm1"),
        ("act_quant", "a2q"),
        ("act_quant", "a2q_scale"),
        ("gemm2", "mm2"),
    ):
        src = trace[stage][name]
        dst = out[stage][name]
        dst[new_row] = src
    inv = trace["permute"]["inv_perm"].long()
    live = inv >= 0
    new_inv = out["permute"]["inv_perm"]
    new_inv[live] = new_row[inv[live]].to(new_inv.dtype)
    return out
