"""The tolerance policy: one table (stage, recipe, scale_fmt, mode) -> Check, every number with
its reason.

This is the only place in the suite where a tolerance number is written down. `compare` asks
`policy_for(stage, problem, mode)`; tests ask the same function instead of writing literals.

Each reason says in a sentence or two why its number is what it is, and cites the heading of
docs/tolerance.md that derives it and lists what was measured (`moe-verify calibrate` on the CPU,
docs/calibration-cpu.md; the H200, docs/gpu-results.md). Numbers marked "provisional" wait for a
GPU calibration; when a number changes, change its reason and that page with it.

Row matching: a row applies when each of its columns equals the query or is ANY. The most specific
row wins, columns ranked mode > recipe > scale_fmt (a chained row beats a recipe row), and on a
tie the earlier row. Every stage has a fully wildcarded row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Literal

from moe_verify.spec import Mode, MoEProblem, Stage, check_enum, check_type

Kind = Literal["exact", "gemm", "act_quant", "act_quant_values", "gather", "reduce"]
ANY = "*"


@dataclass(frozen=True)
class Limit:
    """One threshold and where it comes from."""

    value: float
    reason: str


@dataclass(frozen=True)
class Check:
    """What a stage comparison demands.

    kind:
      exact      every compared element bit-for-bit / integer-equal (ids, indices, copies,
                 packing, quantization codes); `ulp` bounds the route weights.
      gemm       live rows only: per element |a-b| <= atol*rowmax|golden| + rtol*|golden| for
                 all but `mismatch_frac` of the elements, per (token, k) row worst error
                 (max|a-b| / rowmax|golden|) <= row_err, calc_diff <= calc_diff, no NaN/Inf.
      act_quant  fp8 codes and their scales per live row: scales may differ in at most
                 `scale_flip_frac` of the groups, each by at most `scale_step` (relative to the
                 smaller); codes within `code_dist` (code steps, or e4m3 ulps at the coarser scale
                 where the scale flipped) and differing in at most `code_frac` of the elements.
                 All four at 0 means bitwise.
      gather     per element <= `ulp` bf16 ulps; per token worst error <= row_err; no NaN/Inf.
      reduce     as gemm, on the [T, H] output summed over ranks.
    atol is in units of the golden row's max |value| (one number serves any input scale; a
    golden row of zeros must then match exactly).
    """

    kind: Kind
    reason: str
    atol: Limit | None = None
    rtol: Limit | None = None
    mismatch_frac: Limit | None = None
    row_err: Limit | None = None
    calc_diff: Limit | None = None
    ulp: Limit | None = None
    code_dist: Limit | None = None
    code_frac: Limit | None = None
    scale_flip_frac: Limit | None = None
    scale_step: Limit | None = None

    def limits(self) -> dict[str, Limit]:
        """The thresholds this check sets, by name."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Limit):
                out[f.name] = value
        return out

    def limit(self, name: str) -> Limit:
        """The named threshold; a clear error when the policy row does not set it."""
        value = getattr(self, name, None)
        if not isinstance(value, Limit):
            raise LookupError(
                f"{self.kind} check sets no {name!r} limit; it sets {list(self.limits())}"
            )
        return value


@dataclass(frozen=True)
class Rule:
    """One table row; ANY in a column matches every value."""

    stage: Stage | str
    recipe: str
    scale_fmt: str
    mode: Mode | str  # a Mode, or ANY
    check: Check

    def matches(self, stage: str, recipe: str, scale_fmt: str, mode: str) -> bool:
        return (
            self.stage == stage
            and self.recipe in (ANY, recipe)
            and self.scale_fmt in (ANY, scale_fmt)
            and self.mode in (ANY, mode)
        )

    @property
    def specificity(self) -> int:
        return 4 * (self.mode != ANY) + 2 * (self.recipe != ANY) + (self.scale_fmt != ANY)


# Reasons ----------------------------------------------------------------------------------------
# One or two sentences each; the derivations and the measurements behind them are in
# docs/tolerance.md, under the heading each reason cites.

NONFINITE_REASON = (
    "NaN/Inf in a live row always fails: it is garbage or an overflow that would reach the "
    "gather; padding rows are never compared (docs/tolerance.md#nan-and-inf)"
)
CONTRACT_REASON = (
    "stage contract (docs/stage-contract.md): names, dtypes and shapes every backend returns"
)
COLUMN_ORDER_REASON = (
    "gemm1's column order (docs/stage-contract.md#gemm1-column-order): [gate | up] unless the "
    "backend declares up_first"
)
ROUTER_WEIGHT_REASON = (
    "where the top-k router weight is applied is the problem's convention "
    "(docs/stage-contract.md#router-weight): in the gather, or on the input before quantization"
)
LAYOUT_REASON = (
    "the grouped layout a GEMM reads (m_indices, or psum expert_ends) defines which rows it "
    "computes: a live slot on a row it leaves to no expert (a -1 row, a psum gap) or gives "
    "another expert has no defined output there, so that row is not compared as one "
    "(docs/stage-contract.md)"
)
PROVENANCE_REASON = (
    "provenance-tagged tokens: each live slot's permuted row must carry its own token index "
    "(exact in every recipe, tolerance/provenance.py)"
)
RANKS_AGREE_REASON = (
    "an all-reduce leaves every rank the same sum; a rank holding other bits has a broken "
    "collective (or reduces in another order)"
)
_COPY = (
    "a copy/index/packing stage only moves bytes and writes integers, so any difference is a bug "
    "(docs/tolerance.md#copy-stages)"
)
_ROW_ERR_GEMM = (
    "per (token, k) row: max|a-b| / rowmax|golden|, where a misrouted or stale row is O(1) while "
    "calc_diff over the tensor moves by only ~1/rows (docs/tolerance.md#per-row-error)"
)
_CALC_DIFF = (
    "a global sanity ceiling: every element one bf16 ulp off gives ~1.5e-5, so 5e-5; the "
    "per-element and per-token checks localize (docs/tolerance.md#calc_diff)"
)
_NO_OUTLIERS = (
    "no element may leave the per-element bound: the noise measured so far is one bf16 rounding "
    "flip, which uses at most 40% of it (docs/tolerance.md#gemm-outliers)"
)
_RTOL_GEMM = (
    "each side rounds its fp32 accumulator to bf16 once (one ulp between them, up to 2^-7 "
    "relative), and one more ulp for accumulation order: 2^-6 (docs/tolerance.md#gemm-rtol)"
)
_ATOL_SM90 = (
    "Hopper's FP8 tensor core accumulates with ~14 bits, so the noise scales with the row's "
    "sum|a*b| and cancelling outputs need a floor relative to the row max: 2^-8, provisional "
    "until calibrated on a GPU (docs/tolerance.md#gemm-atol)"
)
_ATOL_SM100 = (
    "SM100 accumulates in fp32; provisional: the same 2^-8 row-max floor as SM90 until "
    "calibrated (docs/tolerance.md#gemm-atol)"
)
_CHAINED_ACT = (
    "chained: GEMM2 consumes the backend's own act_quant, whose codes may sit one e4m3 step "
    "(2^-4..2^-3 relative) away where GEMM1 moved by a bf16 ulp: provisional 4x the isolated "
    "bound (docs/tolerance.md#chained-gemm)"
)


def _gemm(atol_reason: str) -> Check:
    return Check(
        "gemm",
        "live rows vs the golden's fp32 math on the same fp8/fp4 operands and scales "
        "(docs/tolerance.md#gemms)",
        atol=Limit(2**-8, atol_reason),
        rtol=Limit(2**-6, _RTOL_GEMM),
        mismatch_frac=Limit(0.0, _NO_OUTLIERS),
        row_err=Limit(2**-5, _ROW_ERR_GEMM),
        calc_diff=Limit(5e-5, _CALC_DIFF),
    )


# Not a table row: the golden carries this recipe only where the harness computed it (the stage
# ran DeepGEMM on an SM90 GPU, or declares the recipe, or it was asked for), so it is chosen by
# the trace, not the problem.
TENSOR_CORE_GEMM = Check(
    "exact",
    "where the tested GEMM ran DeepGEMM's SM90 kernel, or declares the recipe (the Triton engine "
    "compiled for SM90), or the recipe was asked for: live rows bit for bit against the golden's "
    "tensor-core recipe, in isolated mode on the same fp8 operands, chained against the golden's "
    "SM90 chain (reference/hardware/tensor_core.py: the Hopper FP8 block accumulation, 100% of the "
    "recorded H200 outputs), with the fp32-dequant bound reported beside it as the distance to "
    "exact math. "
    "The Triton engine under the CPU interpreter computes exact fp32 math (tl.dot is numpy's "
    "dot), not the tensor core's, so asked for there it fails "
    "(docs/tolerance.md#zero-tolerance-on-sm90)",
)


# Zero tolerance on SM90 (docs/tolerance.md#zero-tolerance-on-sm90): not table rows either. They
# replace a stage's row where the golden computed the hardware's recipe (tolerance/stages/recipes.py
# `hardware_check`): act_quant declared as the H200 Triton kernel, and every stage of a chained
# run compared against the golden's SM90 chain.
_ZERO_DOC = "docs/tolerance.md#zero-tolerance-on-sm90"
ACT_QUANT_BITWISE = Check(
    "act_quant",
    "bit for bit: the kernel declares the recipe whose gate the H200's compiled Triton computes "
    "(the recorded table), or the run is chained against the golden's SM90 chain; everything "
    f"after the gate (x up, amax, scale, quantize) is IEEE, so nothing may differ ({_ZERO_DOC})",
    code_dist=Limit(0, f"bit for bit ({_ZERO_DOC})"),
    code_frac=Limit(0, f"bit for bit ({_ZERO_DOC})"),
    scale_flip_frac=Limit(0, f"bit for bit ({_ZERO_DOC})"),
    scale_step=Limit(0, f"bit for bit ({_ZERO_DOC})"),
)


def _bitwise_output(why: str) -> Check:
    """A [T, H] output held bit for bit: 0 bf16 ulps, 0 per-token error."""
    return Check(
        "gather",
        f"{why}: bit for bit ({_ZERO_DOC})",
        ulp=Limit(0, f"bit for bit ({_ZERO_DOC})"),
        row_err=Limit(0, f"bit for bit ({_ZERO_DOC})"),
    )


SHARED_BITWISE = _bitwise_output(
    "chained against the golden's SM90 chain, the shared experts computed as SM90 computes them "
    "(both GEMMs by the tensor-core recipe, act_quant with the H200 Triton gate)"
)
GATHER_BITWISE = _bitwise_output(
    "chained against the golden's SM90 chain: the same mm2 bits and route weights, summed in the "
    "same k order with the recipe's fp32 steps (mul_add or fma), rounded once"
)


_GEMM_CHAINED = Check(
    "gemm",
    "chained: live rows vs the golden, each side on its own upstream",
    atol=Limit(2**-5, _CHAINED_ACT),
    rtol=Limit(2**-5, _CHAINED_ACT),
    mismatch_frac=Limit(
        1e-3,
        "chained outliers are tolerated up to 0.1%: on the H200 a flipped act_quant scale moved "
        "up to 2.2e-4 of a case's elements past the bound, while a misrouted row still fails per "
        "token (docs/tolerance.md#chained-outliers)",
    ),
    row_err=Limit(
        2**-3,
        "chained: a UE8M0 act_quant scale flipped by tl.exp requantizes its group at twice the "
        "step (up to 2^-3 relative per element); with K = I = 256 that group is half a GEMM2 row's "
        "sum: measured 0.066 on the H200 (nightly, E=384, I=256, T=4096); a misrouted row is "
        "still O(1) (docs/tolerance.md#chained-gemm)",
    ),
    calc_diff=Limit(
        1e-3,
        "chained: one act_quant scale flipped by tl.exp (a factor 2 on a UE8M0 group) requantizes "
        "its group at twice the step (rms ~2^-4/sqrt(3)), so a tensor of one or a few tokens "
        "reaches calc_diff ~ rms^2/2 ~ 6e-4: measured up to 5.1e-4 on the H200 (nightly, T=1), "
        "hence 1e-3 as for the recipe rows; per token and per element still localize "
        "(docs/tolerance.md#calc_diff)",
    ),
)

_SCALE_STEP_UE8M0 = Limit(
    1.0, "UE8M0 scales are powers of two: a flip is exactly one exponent step (factor 2)"
)
_SCALE_STEP_FP32 = Limit(
    2**-7, "plain fp32 scales are amax/448: one bf16 ulp of amax is <= 2^-7 relative"
)
_ACT_QUANT_CODES = "docs/tolerance.md#act_quant-codes-and-scales"
_ACT_QUANT_CHAINED = "docs/tolerance.md#act_quant-chained"


def _act_quant(step: Limit) -> Check:
    return Check(
        "act_quant",
        "SwiGLU + per-group fp8 quant against the kernel recipe it matches (packed, colmajor, "
        "bf16_steps; the golden follows each one's rounding path, "
        "docs/tolerance.md#act_quant-recipes), but Triton's tl.exp only approximates exp "
        f"({_ACT_QUANT_CODES})",
        code_dist=Limit(
            1,
            "y may differ by one bf16 ulp (tl.exp vs exp), which after RNE moves an e4m3 code by "
            "at most one step, or one ulp at the coarser scale where the scale flipped "
            f"({_ACT_QUANT_CODES})",
        ),
        code_frac=Limit(
            1e-3,
            "rounding-boundary cases are rare: provisional 0.1% of live codes, not measurable on "
            f"the CPU, where tl.exp is exact ({_ACT_QUANT_CODES})",
        ),
        scale_flip_frac=Limit(
            1e-3,
            "a group's amax moving by one bf16 ulp across a power of two flips its scale: rare, "
            f"provisional 0.1% of live groups ({_ACT_QUANT_CODES})",
        ),
        scale_step=step,
    )


def _act_quant_chained() -> Check:
    """Chained act_quant compares dequantized values (q x scale), not codes: after a chained
    GEMM1, code distance is the wrong ruler (docs/tolerance.md#act_quant-chained)."""
    why = (
        "chained: y = silu(g)*u inherits GEMM1's bound, about doubled by the product, and each "
        "side rounds to an e4m3 grid whose step is 2^-3 of the value"
    )
    return Check(
        "act_quant_values",
        "chained: SwiGLU + fp8 quant on the backend's own GEMM1 output, as dequantized values "
        f"({_ACT_QUANT_CHAINED})",
        atol=Limit(
            2**-6, f"{why}; 2^-6 x row max covers GEMM1's 2^-8 floor ({_ACT_QUANT_CHAINED})"
        ),
        rtol=Limit(2**-3 + 2**-5, f"{why}: rtol 2^-3 + 2^-5 ({_ACT_QUANT_CHAINED})"),
        mismatch_frac=Limit(
            1e-4,
            "provisional: rare elements where upstream noise and a scale flip compound "
            f"({_ACT_QUANT_CHAINED})",
        ),
        row_err=Limit(2**-3, "one e4m3 step at the row max; a misrouted row is still O(1)"),
        calc_diff=Limit(
            1e-3,
            "chained fp8 requant noise on top of the 5e-5 ceiling (docs/tolerance.md#calc_diff)",
        ),
    )


# Chained, after an upstream stage that matched another legitimate recipe than the golden's own.
_RECIPES_DOC = "docs/tolerance.md#chained-recipe-differences"
_RECIPES_WHY = (
    "with plain fp32 scales the legitimate recipes of quant_input (one e4m3 code apart at ties, "
    "about 1 in 850 elements) and, on ep+ll, of act_quant (bf16_steps re-rounds every group) "
    "differ upstream"
)
_CHAINED_RECIPES = Check(
    "gemm",
    f"chained: live rows vs the golden, each side on its own upstream; {_RECIPES_WHY} "
    f"({_RECIPES_DOC})",
    atol=Limit(
        2**-4,
        "one operand element one e4m3 step apart (<= 2^-3 of it) moves an output by 2^-3 "
        "|a_k w_jk|, at most about 0.69/sqrt(K) of the row max for N(0,1) activations and "
        f"N(0,1/K) weights: 2^-4.03 at K = 128, the smallest contraction ({_RECIPES_DOC})",
    ),
    rtol=Limit(2**-5, _CHAINED_ACT),
    mismatch_frac=Limit(
        1e-3,
        "as chained GEMMs: 0.1% of elements, the H200-measured chained outliers; a misrouted "
        f"row still fails per token ({_RECIPES_DOC})",
    ),
    row_err=Limit(
        2**-3,
        "twice the derived worst single-step move (2^-4.03 of the row max at K = 128); a "
        f"misrouted row is still O(1) ({_RECIPES_DOC})",
    ),
    calc_diff=Limit(
        1e-3,
        "two independent e4m3 roundings of every element differ by rms 2^-4.9 of the values "
        f"(uniform mantissa), so calc_diff ~ rms^2 / 2 <= 5.5e-4 ({_RECIPES_DOC})",
    ),
)


def _act_quant_chained_recipes() -> Check:
    """Chained act_quant after a GEMM1 held to the recipe bound (`_CHAINED_RECIPES`): its
    outliers and per-row move reach y (docs/tolerance.md#chained-recipe-differences)."""
    base = _act_quant_chained()
    return dataclasses.replace(
        base,
        reason=f"{base.reason}; {_RECIPES_WHY} ({_RECIPES_DOC})",
        mismatch_frac=Limit(
            1e-3,
            "GEMM1's chained recipe bound lets 0.1% of mm1 elements out, and each may carry its "
            f"y element out of this bound ({_RECIPES_DOC})",
        ),
        row_err=Limit(
            2**-2,
            "one e4m3 step at the row max (2^-3) plus GEMM1's derived worst single-step move "
            f"(2^-4 of its row max), doubled by the product silu(g) * u: 2^-2 ({_RECIPES_DOC})",
        ),
    )


_EXACT_PERMUTE = Check(
    "exact",
    _COPY + "; m_indices per expert segment (a longer or shorter valid M_sum only adds or drops "
    "tail padding), psum expert_ends exactly and consistent with m_indices; padding rows hold "
    "m_indices -1 or their own segment's expert (DeepGEMM reads a tile's expert from its first "
    "row), the tail -1; under the m_indices layout the padding scales DeepGEMM's SM100 packer "
    "reads pass its device assert (UE8M0 fp32: a power of two or +0.0; packed: no 0xFF byte; "
    "plain fp32 reaches only SM90's per-row scaling, so it is unspecified; psum skips gap rows); "
    "the permute runs with its allocations poisoned (0xFF), so garbage never passes by luck "
    "(docs/tolerance.md#permute-and-padding)",
)
_CHAINED_OUTPUT = "chained: the gather only scales and sums, so GEMM2's chained noise gets out"

# The table ---------------------------------------------------------------------------------------

POLICY: tuple[Rule, ...] = (
    # -- route: integer selection; weights from the same fp32 softmax/sigmoid math.
    Rule(
        Stage.ROUTE,
        ANY,
        ANY,
        ANY,
        Check(
            "exact",
            "top-k ids compare as a set per token: the order inside a token is not semantic "
            "(docs/stage-contract.md)",
            ulp=Limit(
                1,
                "weights aligned to ids: softmax/sigmoid + renormalize in fp32 on both sides, in a "
                "different op order: <= 1 fp32 ulp (docs/tolerance.md#route)",
            ),
        ),
    ),
    # -- quant_input: deterministic per-group quant of the bf16 input, by one of vLLM's recipes.
    Rule(
        Stage.QUANT_INPUT,
        ANY,
        ANY,
        ANY,
        Check(
            "exact",
            "per-token-group quant is a deterministic function of the bf16 input (amax, /448 or "
            "x(1/448), optional ceil to 2^k, RNE to e4m3) and the golden models each of vLLM's "
            "quantizers (cuda_division, triton_reciprocal), so codes and scale bits match one "
            "of them exactly (docs/tolerance.md#quant_input)",
        ),
    ),
    # -- align: integer bookkeeping.
    Rule(
        Stage.ALIGN,
        ANY,
        ANY,
        ANY,
        Check(
            "exact",
            "A and counts are integers: any difference shifts every later row. M_sum may be any "
            "legitimate size (a multiple of A, >= sum round_up(count_e, A)): the report names "
            "the formula it equals; a declared one must be met (docs/tolerance.md#align)",
        ),
    ),
    # -- permute / dispatch: byte copies and indices.
    Rule(Stage.PERMUTE, ANY, ANY, ANY, _EXACT_PERMUTE),
    Rule(Stage.DISPATCH, ANY, ANY, ANY, _EXACT_PERMUTE),
    # -- gemm1: isolated and chained both consume bit-exact permuted operands.
    Rule(Stage.GEMM1, ANY, ANY, ANY, _gemm(_ATOL_SM90)),
    Rule(Stage.GEMM1, "mxfp8", ANY, ANY, _gemm(_ATOL_SM100)),
    Rule(Stage.GEMM1, "mxfp4_w4a8", ANY, ANY, _gemm(_ATOL_SM100)),
    # -- act_quant: bounded code / scale differences (tl.exp); dequantized values when chained.
    Rule(Stage.ACT_QUANT, ANY, ANY, ANY, _act_quant(_SCALE_STEP_UE8M0)),
    Rule(Stage.ACT_QUANT, ANY, "float32", ANY, _act_quant(_SCALE_STEP_FP32)),
    Rule(Stage.ACT_QUANT, ANY, ANY, Mode.CHAINED, _act_quant_chained()),
    Rule(Stage.ACT_QUANT, "fp8_block", "float32", Mode.CHAINED, _act_quant_chained_recipes()),
    # -- gemm2: as gemm1 in isolation; chained it inherits act_quant's code moves.
    Rule(Stage.GEMM2, ANY, ANY, ANY, _gemm(_ATOL_SM90)),
    Rule(Stage.GEMM2, "mxfp8", ANY, ANY, _gemm(_ATOL_SM100)),
    Rule(Stage.GEMM2, "mxfp4_w4a8", ANY, ANY, _gemm(_ATOL_SM100)),
    Rule(Stage.GEMM2, ANY, ANY, Mode.CHAINED, _GEMM_CHAINED),
    # -- chained with plain fp32 scales, where legitimate recipes differ upstream: GEMM1 may
    #    read a1q one e4m3 step apart at ties, GEMM2 a2q re-rounded (bf16_steps on ep+ll).
    Rule(Stage.GEMM1, "fp8_block", "float32", Mode.CHAINED, _CHAINED_RECIPES),
    Rule(Stage.GEMM2, "fp8_block", "float32", Mode.CHAINED, _CHAINED_RECIPES),
    # -- gather: one final rounding of an fp32 weighted sum.
    Rule(
        Stage.GATHER,
        ANY,
        ANY,
        ANY,
        Check(
            "gather",
            "fp32 weighted sum over k (k ascending, -1 skipped) and one RNE to bf16 "
            "(docs/stage-contract.md)",
            ulp=Limit(
                1,
                "both sides round the same fp32 sum once: <= 1 bf16 ulp (docs/tolerance.md#gather)",
            ),
            row_err=Limit(
                2**-6,
                "per token: max|a-b| / rowmax|golden|; one ulp is <= 2^-7 of an element, while a "
                "misrouted or dropped slot moves the token by O(its weight)",
            ),
        ),
    ),
    Rule(
        Stage.GATHER,
        ANY,
        ANY,
        Mode.CHAINED,
        dataclasses.replace(_GEMM_CHAINED, kind="gemm", reason=_CHAINED_OUTPUT),
    ),
    Rule(
        Stage.GATHER,
        "fp8_block",
        "float32",
        Mode.CHAINED,
        dataclasses.replace(_CHAINED_RECIPES, reason=f"{_CHAINED_OUTPUT}; {_RECIPES_WHY}"),
    ),
    # -- shared: GEMM1 -> SwiGLU + requant -> GEMM2 inside one stage, so its own requant noise
    #    is chained noise even when the stage is fed the golden's inputs.
    Rule(
        Stage.SHARED,
        ANY,
        ANY,
        ANY,
        dataclasses.replace(
            _GEMM_CHAINED,
            kind="gemm",
            reason=(
                "shared experts: a dense two-GEMM MLP with an fp8 requant in between, run in one "
                "stage: its requant may land codes one step apart as in chained mode"
            ),
        ),
    ),
    # -- reduce: sum over ranks of bf16 partials (TP all-reduce / EP combine).
    Rule(
        Stage.REDUCE,
        ANY,
        ANY,
        ANY,
        Check(
            "reduce",
            "sum over ranks of each rank's bf16-rounded partial (docs/stage-contract.md): not "
            "bit-equal to one rank's math, bounded",
            atol=Limit(
                2**-5,
                "partials of different ranks cancel and each carries <= 1 bf16 ulp of its own "
                "magnitude: a floor relative to the token's max, provisional for up to 8 ranks "
                "(docs/tolerance.md#reduce)",
            ),
            rtol=Limit(2**-6, "<= 1 ulp per partial plus the final rounding; provisional"),
            mismatch_frac=Limit(0.0, _NO_OUTLIERS),
            row_err=Limit(2**-5, "per token, as the gather; a rank that drops its slots is O(1)"),
            calc_diff=Limit(5e-5, _CALC_DIFF),
        ),
    ),
    Rule(
        Stage.REDUCE,
        ANY,
        ANY,
        Mode.CHAINED,
        dataclasses.replace(
            _GEMM_CHAINED,
            kind="reduce",
            reason="chained: each rank's output carries its own chained GEMM noise",
        ),
    ),
    Rule(
        Stage.REDUCE,
        "fp8_block",
        "float32",
        Mode.CHAINED,
        dataclasses.replace(
            _CHAINED_RECIPES,
            kind="reduce",
            reason=f"chained: each rank's output carries its own chained noise; {_RECIPES_WHY}",
        ),
    ),
)


def comparison_mode(mode: Mode | str) -> Mode:
    """`mode` as a Mode; an error naming the argument and the modes for anything else."""
    return check_enum("mode", mode, Mode)


def policy_for(stage: str, problem: MoEProblem, mode: Mode | str = Mode.ISOLATED) -> Check:
    """The Check for one stage of `problem` under comparison `mode` (isolated or chained)."""
    check_type("problem", problem, MoEProblem)
    mode = comparison_mode(mode)
    recipe, fmt = problem.recipe.value, problem.scale_fmt.value
    best: Rule | None = None
    for rule in POLICY:
        if rule.matches(stage, recipe, fmt, mode) and (
            best is None or rule.specificity > best.specificity
        ):
            best = rule
    if best is None:
        stages = sorted({str(r.stage) for r in POLICY})
        raise LookupError(f"no tolerance policy for stage '{stage}'; the table covers {stages}")
    if stage == Stage.ROUTE and problem.renormalize and problem.topk > 1:
        return dataclasses.replace(best.check, ulp=renormalized_weight_ulps(problem.topk))
    return best.check


def renormalized_weight_ulps(topk: int) -> Limit:
    """The route weights' bound when each token's k weights are divided by their sum.

    Each side sums the k weights in its own order (the order its top-k returned them), and a
    recursive sum of k positive terms is within (k-1) u of the exact one (u = 2^-24), so the two
    sums differ by up to 2(k-1) u relative; each side's division and the routed scaling factor
    add one rounding each. An fp32 ulp is more than u relative, so the weights lie within
    2(k-1) + 3 = 2k + 1 ulps: 17 at k = 8. Measured on the H200: 2 ulps at k = 8 (grouped
    routing, T = 4096; the golden breaks ties by the lowest id, torch.topk need not). A wrong
    weight (another expert's score, a missing or doubled renormalization, the scaling factor
    applied twice) is off by far more, and ids are compared exactly apart."""
    return Limit(
        2 * topk + 1,
        f"renormalized weights: each side divides by a sum of the k = {topk} weights in its own "
        "order, so up to 2(k-1) roundings apart, plus the division and scaling factor: 2k + 1 "
        "fp32 ulps (docs/tolerance.md#route)",
    )
