"""Deterministic inputs for one problem: activations, routing and weights as the kernel sees them.

Everything comes from a `torch.Generator` seeded by the problem (never global RNG state), so a case
id plus a device reproduces its inputs exactly, in any test order or xdist worker.
"""

from __future__ import annotations

import math

import torch

from moe_verify.common.device import default_device
from moe_verify.spec import (
    MoEInputs,
    MoEProblem,
    QuantizedWeight,
    Recipe,
    Routing,
    ceil_div,
    check_device,
    check_type,
)
from reference import formats
from tolerance.provenance import tag_hidden_states

# A logit offset large enough that softmax/top-k never picks (or always picks) an expert.
_NEVER = -1.0e4
_HOT = 8.0
# |max| of a tiny token (MoEProblem.tiny_tokens): every 1x32 group's amax / 448 is then at most
# 2^-119 / 448 = 2^-127.8, so its MXFP8 scale is E8M0 byte 0 (2^-127), the code Triton's decoder
# read as zero (Triton #11624); its codes stay up to 256, not zeros.
TINY_AMAX = 2.0**-119


def make_inputs(problem: MoEProblem, device: torch.device | str | None = None) -> MoEInputs:
    """Build the inputs of `problem` on `device` (default: the GPU if usable, else the CPU).

    hidden_states ~ N(0, 1) in bf16; weights ~ N(0, 1/fan_in), so GEMM1 outputs are O(1) and a
    gate/up swap or a wrong activation is visible (small-magnitude inputs hide both: with GEMM1
    outputs near 0, silu(a) * b ~ a * b / 2 ~ silu(b) * a).
    """
    check_type("make_inputs: problem", problem, MoEProblem)
    if device is not None:
        device = check_device("make_inputs: device", device, present=True)
    else:
        device = default_device()
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
    if p.tiny_tokens:
        hidden_states = shrink_tokens(hidden_states, p.tiny_tokens)
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


def shrink_tokens(hidden: torch.Tensor, n: int) -> torch.Tensor:
    """bf16 [T, H] -> a copy whose first `n` rows are rescaled so each row's |max| is exactly
    TINY_AMAX (a row of zeros stays zero). No random draw: the other rows, the routing and the
    weights are those of the same problem without tiny tokens."""
    out = hidden.clone()
    rows = hidden[:n].float()
    amax = rows.abs().amax(dim=1, keepdim=True)
    out[:n] = torch.where(amax > 0, rows / amax * TINY_AMAX, rows).to(torch.bfloat16)
    return out


# check_inputs reads a tensor's values in slices of about this many elements.
_FINITE_CHUNK = 1 << 24
# Experts are quantized in chunks of about this many elements, so the fp32 temporaries stay near
# 1 GiB whatever E is.
_CHUNK_ELEMENTS = 1 << 28


def quantize_weight(
    w: torch.Tensor, problem: MoEProblem
) -> tuple[QuantizedWeight, QuantizedWeight | None]:
    """Quantize a bf16 weight stack [E, N, K] per recipe, then post-process as vLLM does.

    FP8 block weights with a UE8M0 scale format are requantized to power-of-two scales (lossy double
    quantization, vLLM's `requant_weight_ue8m0_inplace`): the kernel sees the requantized tensors,
    returned first; the checkpoint before requant is returned second so its error can be measured
    apart. Experts are quantized independently, so chunking them changes no bit.
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
        # MoEProblem refuses topk >= num_experts here: an expert can always be left empty.
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


def check_inputs(problem: MoEProblem, inputs: MoEInputs) -> None:
    """Raise ValueError unless every tensor of `inputs` has the shape and dtype `problem` implies.

    Inputs built for another problem (E=4 weights for an E=8 problem, T=16 tokens for T=32) would
    otherwise run, compare golden against tested on the same wrong data and pass under the
    problem's case id. Shapes, dtypes and devices, the range of given topk_ids, and finite values
    (NaN or Inf in an input is refused here, naming the tensor and the count: the golden models
    finite data only, and a NaN weight code or a NaN activation would otherwise surface as the
    golden failing at the first stage that reads it). One pass over each tensor, once per case.
    """
    check_type("check_inputs: problem", problem, MoEProblem)
    check_type("check_inputs: inputs", inputs, MoEInputs)
    p = problem
    t, h, i, e, k = p.tokens, p.hidden, p.intermediate, p.num_experts, p.topk
    check = _InputChecker(p, inputs.hidden_states)
    check.tensor("hidden_states", inputs.hidden_states, (t, h), (torch.bfloat16,))
    check.tensor("router_logits", inputs.router_logits, (t, e), (torch.float32,))
    if p.routing is Routing.GROUPED:
        if inputs.score_bias is not None:
            check.tensor("score_bias", inputs.score_bias, (e,), (torch.float32,))
    else:
        check.absent("score_bias", inputs.score_bias, f"routing {p.routing.value!r} has no bias")
    if (inputs.topk_ids is None) != (inputs.topk_weights is None):
        raise ValueError(
            f"inputs.topk_ids and inputs.topk_weights: expected both or neither for {p.id}, got "
            f"topk_ids {_describe(inputs.topk_ids)} and topk_weights "
            f"{_describe(inputs.topk_weights)}"
        )
    if inputs.topk_ids is not None:
        check.tensor("topk_ids", inputs.topk_ids, (t, k), (torch.int32, torch.int64))
        check.tensor("topk_weights", inputs.topk_weights, (t, k), (torch.float32,))
        ids = inputs.topk_ids
        if ids.numel() and not bool(((ids >= -1) & (ids < e)).all()):
            raise ValueError(
                f"inputs.topk_ids: expected expert ids in [-1, {e}) for {p.id}, got values in "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )
    elif p.routing in (
        Routing.UNIFORM,
        Routing.ONE_EXPERT,
        Routing.INVALID_SLOTS,
        Routing.DUPLICATES,
    ):
        raise ValueError(
            f"inputs.topk_ids: expected int32 {[t, k]} for {p.id} (routing {p.routing.value!r} "
            "fixes ids directly), got None"
        )
    check.tensor("w13", inputs.w13, (e, 2 * i, h), (torch.bfloat16,))
    check.tensor("w2", inputs.w2, (e, h, i), (torch.bfloat16,))
    check.weight("w13_q", inputs.w13_q, e, 2 * i, h)
    check.weight("w2_q", inputs.w2_q, e, h, i)
    for name, ckpt, n, kk in (
        ("w13_ckpt", inputs.w13_ckpt, 2 * i, h),
        ("w2_ckpt", inputs.w2_ckpt, h, i),
    ):
        if ckpt is None:
            continue
        if p.recipe is not Recipe.FP8_BLOCK or not p.scale_fmt.is_ue8m0:
            check.absent(name, ckpt, "only fp8_block weights requantized to UE8M0 keep one")
        check.weight(name, ckpt, e, n, kk)
    i_s = i * p.shared_experts
    for name, w, n, kk in (
        ("shared_w13", inputs.shared_w13, 2 * i_s, h),
        ("shared_w2", inputs.shared_w2, h, i_s),
    ):
        if p.shared_experts:
            check.weight(name, w, 1, n, kk)
        else:
            check.absent(name, w, "the problem has shared_experts=0")


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"a tensor {list(t.shape)} {t.dtype} on {t.device}"
    if isinstance(t, QuantizedWeight):
        return f"QuantizedWeight q {_describe(t.q)}, scale {_describe(t.scale)}, block {t.block}"
    return repr(t) if t is None else type(t).__name__


class _InputChecker:
    """Checks of one MoEInputs against one problem; every tensor must sit on hidden_states'
    device."""

    def __init__(self, problem: MoEProblem, anchor: object) -> None:
        self.p = problem
        self.device = anchor.device if isinstance(anchor, torch.Tensor) else None

    def _fail(self, name: str, expected: str, got: object) -> None:
        raise ValueError(
            f"inputs.{name}: expected {expected} for MoEProblem {self.p.id}, got {got}"
        )

    def tensor(
        self, name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
    ) -> None:
        want = f"{list(shape)} {' or '.join(str(d) for d in dtypes)}"
        if not isinstance(t, torch.Tensor):
            self._fail(name, f"a tensor {want}", _describe(t))
            return
        if tuple(t.shape) != shape or t.dtype not in dtypes:
            self._fail(name, want, f"{list(t.shape)} {t.dtype}")
        if self.device is not None and t.device != self.device:
            self._fail(name, f"a tensor on {self.device} (hidden_states' device)", t.device)
        self.finite(name, t)

    def finite(self, name: str, t: torch.Tensor) -> None:
        """No NaN or Inf in a float tensor (fp8: no NaN code), read in slices of the first
        dimension of about _FINITE_CHUNK elements, so a model's weights need no second copy."""
        if not t.dtype.is_floating_point:
            return
        rows = t.flatten(1) if t.dim() > 1 else t.reshape(1, -1)
        nan = inf = 0
        for part in rows.split(max(1, _FINITE_CHUNK // max(1, rows.shape[1]))):
            x = part.float()
            nan += int(x.isnan().sum())
            inf += int(x.isinf().sum())
        if nan or inf:
            self._fail(name, "finite values (the golden models finite data only)",
                       f"{nan} NaN and {inf} Inf")  # fmt: skip

    def absent(self, name: str, value: object, why: str) -> None:
        if value is not None:
            self._fail(name, f"None ({why})", _describe(value))

    def weight(self, name: str, w: object, e: int, n: int, k: int) -> None:
        """A QuantizedWeight [e, n, k] as `quantize_weight` makes it for the recipe."""
        if not isinstance(w, QuantizedWeight):
            self._fail(name, f"a QuantizedWeight [{e}, {n}, {k}]", _describe(w))
            return
        recipe = self.p.recipe
        if recipe is Recipe.FP8_BLOCK:
            q = ((e, n, k), torch.float8_e4m3fn)
            scale = ((e, ceil_div(n, 128), ceil_div(k, 128)), torch.float32)
            block = (128, 128)
        else:
            fp4 = recipe is Recipe.MXFP4_W4A8
            q = ((e, n, k // 2), torch.uint8) if fp4 else ((e, n, k), torch.float8_e4m3fn)
            scale = ((e, n, k // 32), torch.uint8)
            block = (1, 32)
        if tuple(w.block) != block:
            self._fail(f"{name}.block", f"{block} ({recipe})", w.block)
        self.tensor(f"{name}.q", w.q, q[0], (q[1],))
        self.tensor(f"{name}.scale", w.scale, scale[0], (scale[1],))
        if w.scale.dtype == torch.uint8:  # E8M0 bytes: 0xFF is their NaN
            nan = int((w.scale == 0xFF).sum())
            if nan:
                self._fail(f"{name}.scale", "E8M0 bytes other than 0xFF (NaN)", f"{nan} NaN")
