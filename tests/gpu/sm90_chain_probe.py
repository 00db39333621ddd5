"""Measurement script (not a test): per-stage bitwise fractions of the DeepGEMM engine's chained
run against the SM90 chain, composed here from the golden's own pieces (the tensor-core recipe,
the table-gate act_quant, the gather), beside the fp32 golden's; and the tensor-core recipe's
time beside the fp32 golden GEMM's. docs/gpu-results.md (2026-12-01, issue 16) records its output
on the H200. One JSON line per case:

    python tests/gpu/sm90_chain_probe.py [NAME_FILTER ...] > probe.jsonl   # GPU with DeepGEMM
    PROBE_ENGINE=triton python tests/gpu/sm90_chain_probe.py "dsv3 T=128"   # the Triton engine
    SMOKE=1 TRITON_INTERPRET=1 python tests/gpu/sm90_chain_probe.py        # CPU: that it runs

Permuted rows are keyed by (token, k) through each side's inv_perm (the scatter's row order
within an expert is atomic). The product check is `moe-verify run --mode both`, which holds the
chained run to the SM90 chain itself (docs/tolerance.md#zero-tolerance-on-sm90).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from moe_verify.common.timing import timed_once
from moe_verify.run.inputs import make_inputs
from moe_verify.run.runner import run_chained, run_golden
from moe_verify.spec import MoEProblem, Routing, ScaleFmt
from optimized.backend import OptimizedBackend
from reference.activation import act_quant, fused_act_quant_recipe, sm90_triton_recipe
from reference.gather import gather
from reference.gemm import grouped_gemm
from reference.hardware.tensor_core import tensor_core_grouped_gemm
from reference.moe import ReferenceBackend

DSV3 = dict(  # DeepSeek-V3 EP8-local: 32 of 256 experts
    hidden=7168,
    intermediate=2048,
    num_experts=32,
    topk=8,
    routing=Routing.GROUPED,
    num_expert_group=8,
    topk_group=4,
)
QWEN3 = dict(hidden=4096, intermediate=1536, num_experts=128, topk=8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.itemsize == 1:
        return t.view(torch.uint8)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def equal_fraction(a: torch.Tensor, b: torch.Tensor) -> dict[str, float | int]:
    same = _bits(a) == _bits(b)
    return {"frac": float(same.float().mean()), "differ": int((~same).sum()), "n": same.numel()}


def keyed(g: torch.Tensor, g_inv: torch.Tensor, t: torch.Tensor, t_inv: torch.Tensor) -> dict:
    """Bitwise fraction of the rows of every live (token, k) slot, each side's row by its own
    inv_perm."""
    live = (g_inv >= 0) & (t_inv >= 0)
    return equal_fraction(g[g_inv[live].long()], t[t_inv[live].long()])


def probe(name: str, problem: MoEProblem, device: str, engine: str) -> dict:
    x = make_inputs(problem, device)
    golden = ReferenceBackend()
    g, t_golden = timed_once(lambda: run_golden(golden, problem, x, 0))
    t, t_tested = timed_once(lambda: run_chained(OptimizedBackend(engine=engine), problem, x, 0))
    local = golden.shard(problem, x, 0)
    gp, tp = g["permute"], t["permute"]
    g_inv, t_inv = gp["inv_perm"], tp["inv_perm"]
    out: dict[str, object] = {"case": name, "id": problem.id, "golden_s": t_golden}
    out["tested_s"] = t_tested
    out["failed"] = {s: str(t.failure(s))[:200] for s in t if t.failure(s) is not None}
    out["route_ids"] = equal_fraction(g["route"]["topk_ids"], t["route"]["topk_ids"])
    out["route_weights"] = equal_fraction(g["route"]["topk_weights"], t["route"]["topk_weights"])
    out["a1q"] = equal_fraction(g["quant_input"]["a1q"], t["quant_input"]["a1q"])
    out["a_perm"] = keyed(gp["a_perm"], g_inv, tp["a_perm"], t_inv)
    # Each stage against its recipe on the tested chain's own upstream
    rows = tp["m_indices"]
    tc1, out["tc_gemm1_s"] = timed_once(
        lambda: tensor_core_grouped_gemm(tp["a_perm"], tp["a_scale_perm"], 128, local.w13, rows)
    )
    fp1, out["fp32_gemm1_s"] = timed_once(
        lambda: grouped_gemm(tp["a_perm"], tp["a_scale_perm"], 128, local.w13, rows)
    )
    live = rows >= 0
    out["gemm1_vs_tc"] = equal_fraction(tc1[live], t["gemm1"]["mm1"][live])
    out["gemm1_vs_fp32"] = equal_fraction(fp1[live], t["gemm1"]["mm1"][live])
    twin = sm90_triton_recipe(fused_act_quant_recipe(problem.scale_fmt), problem.activation)
    q, s = act_quant(t["gemm1"]["mm1"][live], problem.activation, 128, problem.scale_fmt, twin)
    out["act_codes_vs_table"] = equal_fraction(q, t["act_quant"]["a2q"][live])
    out["act_scales_vs_table"] = equal_fraction(s, t["act_quant"]["a2q_scale"][live])
    aq = t["act_quant"]
    tc2, out["tc_gemm2_s"] = timed_once(
        lambda: tensor_core_grouped_gemm(aq["a2q"], aq["a2q_scale"], 128, local.w2, rows)
    )
    _, out["fp32_gemm2_s"] = timed_once(
        lambda: grouped_gemm(aq["a2q"], aq["a2q_scale"], 128, local.w2, rows)
    )
    out["gemm2_vs_tc"] = equal_fraction(tc2[live], t["gemm2"]["mm2"][live])
    route = t["route"]
    own = gather(t["gemm2"]["mm2"], route["topk_ids"], route["topk_weights"], t_inv)
    out["gather_vs_golden_on_own"] = equal_fraction(own, t["gather"]["out"])
    # The whole SM90 chain from the golden's own upstream
    c1 = tensor_core_grouped_gemm(gp["a_perm"], gp["a_scale_perm"], 128, local.w13, gp["m_indices"])
    out["chain_mm1"] = keyed(c1, g_inv, t["gemm1"]["mm1"], t_inv)
    q, s = act_quant(c1, problem.activation, 128, problem.scale_fmt, twin)
    out["chain_a2q"] = keyed(q, g_inv, aq["a2q"], t_inv)
    out["chain_a2q_scale"] = keyed(s, g_inv, aq["a2q_scale"], t_inv)
    c2 = tensor_core_grouped_gemm(q, s, 128, local.w2, gp["m_indices"])
    out["chain_mm2"] = keyed(c2, g_inv, t["gemm2"]["mm2"], t_inv)
    chain = gather(c2, g["route"]["topk_ids"], g["route"]["topk_weights"], g_inv)
    out["chain_out"] = equal_fraction(chain, t["gather"]["out"])
    out["fp32_golden_out"] = equal_fraction(g["gather"]["out"], t["gather"]["out"])
    return out


def main(filters: list[str]) -> None:
    if os.environ.get("SMOKE"):
        cases = [("smoke", MoEProblem(tokens=33, num_experts=8, topk=2))]
        device, engine = "cpu", "triton"
    else:
        cases = [
            (f"{family} T={tokens} {fmt}", MoEProblem(tokens=tokens, scale_fmt=fmt, **shape))
            for fmt in (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0)
            for family, shape, token_counts in (
                ("dsv3", DSV3, (1, 128, 4096)),
                ("qwen3", QWEN3, (128, 1024)),
            )
            for tokens in token_counts
        ]
        device, engine = "cuda", os.environ.get("PROBE_ENGINE", "deepgemm")
    for name, problem in cases:
        if not filters or any(f in name for f in filters):
            print(json.dumps(probe(name, problem, device, engine)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
