"""Deterministic inputs for one problem: activations, routing and weights as the kernel sees them.

Everything comes from a `torch.Generator` seeded by the problem (never global RNG state), so a case
id plus a device reproduces its inputs exactly, in any test order or xdist worker.
"""

from __future__ import annotations

import math

import torch

from moe_verify.device import default_device
from moe_verify.spec import MoEInputs, MoEProblem, QuantizedWeight, Recipe, Routing
from reference import formats
from tolerance.provenance import tag_hidden_states

# A logit offset large enough that softmax/top-k never picks (or always picks) an expert.
_NEVER = -1.0e4
_HOT = 8.0


def make_inputs(problem: MoEProblem, device: torch.device | str | None = None) -> MoEInputs:
    """Build the inputs of `problem` on `device` (default: the GPU if usable, else the CPU).

    hidden_states ~ N(0, 1) in bf16; weights ~ N(0, 1/fan_in), so GEMM1 outputs are O(1) and a
    gate/up swap or a wrong activation is visible (small-magnitude inputs hide both, §12 obs. 3).
    """
    device = torch.device(device) if device is not None else default_device()
    gen = torch.Generator(device=device).manual_seed(problem.seed)
    p = problem
    e, h, i, t = p.num_experts, p.hidden, p.intermediate, p.tokens

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale

    def weight_stack(n: int, k: int) -> torch.Tensor:
        """bf16 [E, n, k] ~ N(0, 1/k), drawn one expert at a time: an fp32 [E, n, k] temporary
        would be 28 GiB for DeepSeek-V3's w13 (E = 256)."""
        out = torch.empty(e, n, k, dtype=torch.bfloat16, device=device)
        for j in range(e):
            out[j] = randn(n, k, scale=1.0 / math.sqrt(k))
        return out

    hidden_states = randn(t, h).to(torch.bfloat16)
    if p.provenance:
        hidden_states = tag_hidden_states(hidden_states)
    router_logits = randn(t, e)
    score_bias = randn(e, scale=0.1) if p.routing is Routing.GROUPED else None
    w13 = weight_stack(2 * i, h)
    w2 = weight_stack(h, i)

    router_logits, topk_ids, topk_weights = _routing(p, router_logits, gen)
    w13_q, w13_ckpt = quantize_weight(w13, p)
    w2_q, w2_ckpt = quantize_weight(w2, p)
    shared_w13 = shared_w2 = None
    if p.shared_experts:
        i_s = i * p.shared_experts
        shared_w13, _ = quantize_weight(
            randn(1, 2 * i_s, h, scale=1.0 / math.sqrt(h)).bfloat16(), p
        )
        shared_w2, _ = quantize_weight(randn(1, h, i_s, scale=1.0 / math.sqrt(i_s)).bfloat16(), p)
    return MoEInputs(
        hidden_states=hidden_states,
        router_logits=router_logits,
        score_bias=score_bias,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        w13=w13,
        w2=w2,
        w13_q=w13_q,
        w2_q=w2_q,
        w13_ckpt=w13_ckpt,
        w2_ckpt=w2_ckpt,
        shared_w13=shared_w13,
        shared_w2=shared_w2,
    )


# Experts are quantized in chunks of about this many elements, so the fp32 temporaries stay near
# 1 GiB whatever E is.
_CHUNK_ELEMENTS = 1 << 28


def quantize_weight(
    w: torch.Tensor, problem: MoEProblem
) -> tuple[QuantizedWeight, QuantizedWeight | None]:
    """Quantize a bf16 weight stack [E, N, K] per recipe, then post-process as vLLM does.

    FP8 block weights with a UE8M0 scale format are requantized to power-of-two scales (lossy
    double quantization, §8.1): the kernel sees the requantized tensors, returned first; the
    checkpoint before requant is returned second so its error can be measured apart. Experts are
    quantized independently, so chunking them changes no bit.
    """
    step = max(1, _CHUNK_ELEMENTS // max(1, w[0].numel())) if w.shape[0] else 1
    if w.shape[0] <= step:
        return _quantize_experts(w, problem)
    parts = [_quantize_experts(w[j : j + step], problem) for j in range(0, w.shape[0], step)]

    def stack(ws: list[QuantizedWeight]) -> QuantizedWeight:
        return QuantizedWeight(
            torch.cat([x.q for x in ws]), torch.cat([x.scale for x in ws]), ws[0].block
        )

    kernel = stack([k for k, _ in parts])
    ckpts = [c for _, c in parts if c is not None]
    return kernel, stack(ckpts) if ckpts else None


def _quantize_experts(
    w: torch.Tensor, problem: MoEProblem
) -> tuple[QuantizedWeight, QuantizedWeight | None]:
    recipe = problem.recipe
    if recipe is Recipe.FP8_BLOCK:
        q, s = formats.quantize_fp8_blocks(w.float(), (128, 128), use_ue8m0=False)
        ckpt = QuantizedWeight(q, s, (128, 128))
        if not problem.scale_fmt.is_ue8m0:
            return ckpt, None
        rq, rs = formats.requantize_blocks_ue8m0(q, s, (128, 128))
        return QuantizedWeight(rq, rs, (128, 128)), ckpt
    if recipe is Recipe.MXFP8:
        q, s = formats.quantize_mxfp8(w.float(), 32)
        return QuantizedWeight(q, s, (1, 32)), None
    q, s = formats.quantize_mxfp4(w.float(), 32)
    return QuantizedWeight(q, s, (1, 32)), None


def _routing(
    p: MoEProblem, logits: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Shape the logits for router-driven modes, or fix ids directly for structural modes."""
    t, e, k = p.tokens, p.num_experts, p.topk
    device = logits.device
    mode = p.routing
    if mode in (Routing.EMPTY_FIRST, Routing.EMPTY_MIDDLE, Routing.EMPTY_LAST):
        if k >= e:
            raise ValueError(f"routing {mode}: needs topk < num_experts to leave an expert empty")
        empty = {Routing.EMPTY_FIRST: 0, Routing.EMPTY_MIDDLE: e // 2, Routing.EMPTY_LAST: e - 1}
        logits = logits.clone()
        logits[:, empty[mode]] = _NEVER
        return logits, None, None
    if mode is Routing.SKEW:
        hot = int(torch.randint(e, (1,), generator=gen, device=device))
        half = torch.rand(t, generator=gen, device=device) < 0.5
        logits = logits.clone()
        logits[half, hot] += _HOT
        return logits, None, None
    if mode in (Routing.SOFTMAX, Routing.GROUPED):
        return logits, None, None

    weights = torch.rand(t, k, generator=gen, device=device) + 0.1
    weights = weights / weights.sum(dim=-1, keepdim=True)
    if mode is Routing.UNIFORM:
        # Slot j of token t -> expert (t*k + j) mod E: every expert gets the same number of slots
        # (+-1) and a token never repeats an expert (k <= E).
        ids = (torch.arange(t * k, device=device) % e).view(t, k)
    elif mode is Routing.ONE_EXPERT:
        hot = int(torch.randint(e, (1,), generator=gen, device=device))
        ids = torch.full((t, k), -1, device=device, dtype=torch.long)
        ids[:, 0] = hot
        weights = torch.zeros(t, k, device=device)
        weights[:, 0] = 1.0
    elif mode is Routing.INVALID_SLOTS:
        ids = torch.argsort(torch.rand(t, e, generator=gen, device=device), dim=-1)[:, :k]
        drop = torch.rand(t, k, generator=gen, device=device) < 0.25
        drop[::7] = True  # every 7th token has no expert at all: its output must be exact zeros
        ids = ids.masked_fill(drop, -1)
    elif mode is Routing.DUPLICATES:
        ids = torch.randint(e, (t, k), generator=gen, device=device)
    else:
        raise ValueError(f"routing mode {mode} is not handled")
    return logits, ids.to(torch.int32), weights.float()
