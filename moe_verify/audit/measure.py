"""The E8M0 audit's measurements and verdict: what power-of-two scales cost a model's FP8 weights.

With E8M0 on (Blackwell always, Hopper with VLLM_USE_DEEP_GEMM_E8M0), vLLM requantizes every
block-scaled FP8 weight to power-of-two scales (`requant_weight_ue8m0_inplace`: dequantize, then
quantize again with s' = 2^ceil(log2 s)) and quantizes activations with ceil-UE8M0 group scales.
A checkpoint whose scales already are powers of two loses nothing on the weight side; any other
loses up to one bit per block to the ceil and re-rounds every code. The audit measures, on the
checkpoint's own tensors (no peer suite measures this on a checkpoint):

- every block's ceil factor r = ceil_ue8m0(s) / s in [1, 2) and log2(r), the bits of range lost
  (scales only, so every FP8 weight of the model is covered). Requantization really computes
  s' = ceil_ue8m0(amax / 448) from the dequantized block, which is ceil_ue8m0(s) when the block's
  largest code is 448, as amax-scaled quantizers (DeepSeek's, vLLM's) leave it;
- for a sample of weights per layer: the requantized weight's relative Frobenius error and
  1 - cos against the checkpoint's (the two figures published for a real checkpoint,
  moe_verify/audit/published.py), the codes it changed, and the GEMM output error against an
  exact float64 product, three ways: fp32 scales (what SM90 runs by default), E8M0 activation
  scales with the checkpoint's weights, and full E8M0 (the weights requantized too). The
  activations are the model's own where `activations=` dumps cover a layer (audit/activations.py),
  synthetic probes elsewhere;
- the per-layer errors compounded over the model's layers as a root-sum-square (independent
  errors adding up along the residual stream). The verdict is on what requantizing the weights
  multiplies E8M0's error by (full E8M0 over E8M0 activations alone); its denominator depends on
  the synthetic activations, so compare models by the same command's numbers.

The verdict is about numerics, not task accuracy, and on the synthetic probes it cannot tell models
apart (VERDICT_CAVEAT says why and what would).

A malformed tensor (checkpoint.Skipped) is left out of every figure and listed; the audit fails
only when nothing is left to measure.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moe_verify.audit.activations import ActivationDumps, Dump
from moe_verify.audit.checkpoint import (
    AuditError,
    FP8Weight,
    Skipped,
    block_size,
    find_fp8_weights,
    load_scales,
    load_tensor,
    read_config,
)
from moe_verify.audit.published import QWEN38_FLASH_NEXT, PublishedRequant
from moe_verify.common import progress
from moe_verify.common.safe_io import UntrustedFileError
from moe_verify.spec import ScaleFmt
from reference.formats import (
    ceil_ue8m0,
    dequantize_fp8_blocks,
    dequantize_fp8_groups,
    quantize_fp8_groups,
    requantize_blocks_ue8m0,
)

ACT_GROUP = 128  # the 1 x 128 activation groups of the FP8 block recipe
# Default verdict limit: requantizing the weights may raise E8M0's compounded output error to at
# most 1.25x what E8M0 activation scales alone give. Power-of-two weight scales requantize to the
# same values (exactly 1x); any other scale re-rounds every code, an error as large as an FP8
# rounding of the weight itself: ~1.4x on synthetic Gaussian weights (tests/audit/test_e8m0.py).
# So with this limit every checkpoint whose scales are not powers of two comes out at-risk, which
# is what requantization does to it; how much is in the ratio and the compounded errors.
# Provisional: not calibrated against task accuracy (no real checkpoint audited yet).
DEFAULT_MAX_RATIO = 1.25
HIST_BINS = 10  # ceil-factor histogram over [1, 2)
SYNTHETIC = "synthetic"  # WeightError.activations of a GEMM measured on the synthetic probe

# What the verdict can and cannot say, in report.md and the docs.
VERDICT_CAVEAT = (
    "On the synthetic probes the ratio verdict flags every checkpoint whose weight scales are not "
    "powers of two: requantization re-rounds every such weight, about one more e4m3 rounding "
    "(relative error ~0.026, as published for a real checkpoint), and that alone puts the ratio "
    "near 1.4x, above the default limit, whatever the model. So `at-risk` says the scales are not "
    "powers of two; it does not tell a model E8M0 leaves neutral (Qwen3-30B-A3B-FP8: GSM8K within "
    "one stderr, vLLM PRs #20087, #21968) from one it harms (Qwen3.5-35B-A3B-FP8: 4 to 9 points "
    "lost, vLLM PRs #37806, #38083). What would discriminate: the model's activation outliers "
    "(audit on real activations, `--activations`: ceil-UE8M0 activation scales cost most where "
    "one large value sets a group's scale, which the synthetic probe models the same for every "
    "checkpoint), and a task-level A/B (e.g. GSM8K with E8M0 on and off, three runs per arm)."
)


@dataclass(frozen=True)
class ScaleStats:
    """Ceil factors r = ceil_ue8m0(s) / s over a set of blocks (scales only)."""

    blocks: int
    pow2_fraction: float  # blocks whose scale already is a power of two (r = 1)
    mean_bits_lost: float  # mean log2(r)
    max_bits_lost: float
    histogram: list[int]  # blocks with r in [1 + i/HIST_BINS, 1 + (i+1)/HIST_BINS)

    @staticmethod
    def of(log2_r: torch.Tensor) -> ScaleStats:
        flat = log2_r.reshape(-1).double()
        if flat.numel() == 0:
            return ScaleStats(0, 1.0, 0.0, 0.0, [0] * HIST_BINS)
        r = torch.exp2(flat)
        bins = ((r - 1) * HIST_BINS).floor().clamp(0, HIST_BINS - 1).long()
        return ScaleStats(
            blocks=flat.numel(),
            pow2_fraction=float((flat == 0).double().mean()),
            mean_bits_lost=float(flat.mean()),
            max_bits_lost=float(flat.max()),
            histogram=torch.bincount(bins.cpu(), minlength=HIST_BINS).tolist(),
        )


@dataclass(frozen=True)
class WeightError:
    """One sampled weight: what requantizing it to E8M0 does, and the GEMM output error of each
    scale format against the exact product X @ W^T (W the checkpoint's fp32-scale weight)."""

    name: str
    kind: str
    family: str  # kind.projection, e.g. "attention.o_proj" (FP8Weight.family)
    shape: tuple[int, int]  # [N, K]
    weight_rel_err: float  # ||W_e8m0 - W||_F / ||W||_F (published: ~0.0265)
    weight_one_minus_cos: float  # 1 - cos(W_e8m0, W) (published: ~3.5e-4)
    codes_changed: float  # fraction of fp8 codes the requantization changed
    activations: str  # SYNTHETIC, or the name of the activation dump X came from
    tokens: int  # rows of X
    out_err_fp32: float  # ||deq(X_q) @ W^T - X @ W^T|| / ||X @ W^T||, fp32 activation scales
    out_err_e8m0_act: float  # the same with ceil-UE8M0 activation scales
    out_err_e8m0: float  # ceil-UE8M0 activation scales and the requantized weight W_e8m0


@dataclass(frozen=True)
class KindErrors:
    """RMS over the sampled GEMMs of one weight kind."""

    gemms: int
    out_err_fp32: float
    out_err_e8m0_act: float
    out_err_e8m0: float
    weight_rel_err: float

    @property
    def ratio(self) -> float:
        """Full E8M0 over E8M0 activation scales alone, as the model verdict's ratio."""
        return _ratio(self.out_err_e8m0, self.out_err_e8m0_act)


@dataclass(frozen=True)
class RequantFigures:
    """The published pair over a set of requantized weights (mean, min, max of each), to hold
    against PublishedRequant."""

    tensors: int
    rel_frobenius_mean: float
    rel_frobenius_min: float
    rel_frobenius_max: float
    one_minus_cos_mean: float
    one_minus_cos_min: float
    one_minus_cos_max: float

    @staticmethod
    def of(ws: list[WeightError]) -> RequantFigures:
        rel = [w.weight_rel_err for w in ws]
        cos = [w.weight_one_minus_cos for w in ws]
        return RequantFigures(
            len(ws),
            sum(rel) / len(rel),
            min(rel),
            max(rel),
            sum(cos) / len(cos),
            min(cos),
            max(cos),
        )


@dataclass
class LayerAudit:
    layer: int | None  # None: weights outside the numbered layers
    scales: ScaleStats
    weights: list[WeightError] = field(default_factory=list)

    @property
    def out_err_fp32(self) -> float:
        return _rms([w.out_err_fp32 for w in self.weights])

    @property
    def out_err_e8m0_act(self) -> float:
        return _rms([w.out_err_e8m0_act for w in self.weights])

    @property
    def out_err_e8m0(self) -> float:
        return _rms([w.out_err_e8m0 for w in self.weights])

    @property
    def ratio(self) -> float:
        return _ratio(self.out_err_e8m0, self.out_err_e8m0_act)


@dataclass
class AuditReport:
    checkpoint: str
    model_type: str | None
    block: tuple[int, int]
    tokens: int
    experts_per_layer: int
    fp8_weights: int
    model: ScaleStats
    layers: list[LayerAudit]
    max_ratio: float
    unaudited: list[str] = field(default_factory=list)  # FP8 tensors or GEMMs left out, and why
    skipped: list[Skipped] = field(default_factory=list)  # malformed tensors and shards
    activations_path: str | None = None  # the dumps given, if any
    activations_unused: list[str] = field(default_factory=list)  # dumps no measured GEMM read
    published: PublishedRequant = QWEN38_FLASH_NEXT

    @property
    def compounded_fp32(self) -> float:
        return _rss([layer.out_err_fp32 for layer in self.layers if layer.weights])

    @property
    def compounded_e8m0_act(self) -> float:
        return _rss([layer.out_err_e8m0_act for layer in self.layers if layer.weights])

    @property
    def compounded_e8m0(self) -> float:
        return _rss([layer.out_err_e8m0 for layer in self.layers if layer.weights])

    @property
    def ratio(self) -> float:
        """What requantizing the weights multiplies E8M0's compounded output error by (1.0 when
        both are 0: nothing to multiply)."""
        base, full = self.compounded_e8m0_act, self.compounded_e8m0
        if base == 0:
            return 1.0 if full == 0 else math.inf
        return full / base

    @property
    def verdict(self) -> str:
        return "low-risk" if self.ratio <= self.max_ratio else "at-risk"

    @property
    def reason(self) -> str:
        m = self.model
        numbered = sum(1 for layer in self.layers if layer.weights and layer.layer is not None)
        others = any(layer.weights and layer.layer is None for layer in self.layers)
        layers = f"{numbered} layers" + (" and the weights outside them" if others else "")
        weights = (
            f"all {m.blocks} weight blocks have power-of-two scales already (requantization keeps "
            "every weight value)"
            if m.pow2_fraction == 1.0
            else f"{1 - m.pow2_fraction:.1%} of {m.blocks} weight blocks lose "
            f"{m.mean_bits_lost:.3f} bits on average to the ceil"
        )
        left_out = (
            f"; {len(self.unaudited)} FP8 tensors or GEMMs not audited" if self.unaudited else ""
        )
        if self.skipped:
            left_out += f"; {len(self.skipped)} malformed tensors or shards skipped"
        sampled = self.sampled()
        dumped = sum(1 for w in sampled if w.activations != SYNTHETIC)
        probes = f"; {dumped} of {len(sampled)} GEMMs on activation dumps" if dumped else ""
        return (
            f"{weights}{left_out}{probes}; compounded over {layers}, requantizing the weights "
            f"gives {self.ratio:.3f}x the output error of E8M0 activation scales alone (limit "
            f"{self.max_ratio:g}x); output error fp32 scales {self.compounded_fp32:.4g}, E8M0 "
            f"activations {self.compounded_e8m0_act:.4g}, full E8M0 {self.compounded_e8m0:.4g}"
        )

    def sampled(self) -> list[WeightError]:
        return [w for layer in self.layers for w in layer.weights]

    def requant(self) -> RequantFigures:
        """The published pair over every sampled weight."""
        return RequantFigures.of(self.sampled())

    def requant_by(self, key: str) -> dict[str, RequantFigures]:
        """The published pair per "kind" (attention, expert, ...) or per "family"
        (attention.o_proj, expert.down_proj, ...)."""
        grouped: dict[str, list[WeightError]] = defaultdict(list)
        for w in self.sampled():
            grouped[getattr(w, key)].append(w)
        return {name: RequantFigures.of(ws) for name, ws in sorted(grouped.items())}

    def by_kind(self) -> dict[str, KindErrors]:
        """RMS output errors of the sampled GEMMs per weight kind (attention, expert, ...): which
        part of the model E8M0 costs most."""
        grouped: dict[str, list[WeightError]] = defaultdict(list)
        for layer in self.layers:
            for w in layer.weights:
                grouped[w.kind].append(w)
        return {
            kind: KindErrors(
                len(ws),
                _rms([w.out_err_fp32 for w in ws]),
                _rms([w.out_err_e8m0_act for w in ws]),
                _rms([w.out_err_e8m0 for w in ws]),
                _rms([w.weight_rel_err for w in ws]),
            )
            for kind, ws in sorted(grouped.items())
        }

    def to_json(self) -> str:
        out = asdict(self)
        out.update(
            by_kind={kind: asdict(errors) for kind, errors in self.by_kind().items()},
            requant=asdict(self.requant()),
            requant_by_kind={k: asdict(f) for k, f in self.requant_by("kind").items()},
            requant_by_family={k: asdict(f) for k, f in self.requant_by("family").items()},
            verdict=self.verdict,
            reason=self.reason,
            verdict_caveat=VERDICT_CAVEAT,
            ratio=self.ratio,
            compounded_fp32=self.compounded_fp32,
            compounded_e8m0_act=self.compounded_e8m0_act,
            compounded_e8m0=self.compounded_e8m0,
        )
        for entry, layer in zip(out["layers"], self.layers, strict=True):
            entry.update(
                out_err_fp32=layer.out_err_fp32,
                out_err_e8m0_act=layer.out_err_e8m0_act,
                out_err_e8m0=layer.out_err_e8m0,
            )
        return json.dumps(out, indent=2, allow_nan=False)


def _rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else 0.0


def _ratio(full: float, activations: float) -> float:
    return full / activations if activations else math.nan


def _rss(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values))


def bits_lost(scale: torch.Tensor) -> torch.Tensor:
    """log2(ceil_ue8m0(s) / s) per block of normal scales: 0 for a power of two, below 1."""
    return torch.log2(ceil_ue8m0(scale).double() / scale.double())


# Measuring ----------------------------------------------------------------------------------------


def synthetic_activations(tokens: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    """bf16 [tokens, k]: N(0, 1) with 1 in 200 channels 30x larger, the outlier channels LLM
    activations have. An outlier sets its group's scale: with an fp32 scale it lands on code 448
    exactly, with a ceil-UE8M0 scale it is rounded like any value, and it dominates the output
    norm, so E8M0 activation scales about double the activation error here."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    outliers = torch.randperm(k, generator=g)[: max(1, k // 200)]
    x[:, outliers] *= 30.0
    return x.to(torch.bfloat16).to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    norm = float(torch.linalg.vector_norm(b))
    return float(torch.linalg.vector_norm(a - b)) / norm if norm > 0 else 0.0


def requantization_error(requant: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(||requant - exact||_F / ||exact||_F, 1 - cos(requant, exact)) of two dequantized weights
    [..., N, K], in float64: the two figures published for a real checkpoint. Both 0 when the
    weights are equal (two zero weights included)."""
    a, b = requant.double().reshape(-1), exact.double().reshape(-1)
    if torch.equal(a, b):  # na * nb need not round to a @ b: 1 - cos would come out -1e-16
        return 0.0, 0.0
    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    if na == 0 or nb == 0:
        return (0.0, 0.0) if na == nb else (1.0 if nb > 0 else math.inf, 1.0)
    return float(torch.linalg.vector_norm(a - b)) / nb, 1 - float(a @ b) / (na * nb)


def weight_error(
    w: FP8Weight,
    block: tuple[int, int],
    scale: torch.Tensor,
    x: torch.Tensor,
    device: torch.device,
    expert: int = 0,
    activations: str = SYNTHETIC,
) -> WeightError:
    """Requantize one weight (expert `expert` of a 3-D tensor, `scale` its checked block scales,
    all experts' for a 3-D one) to E8M0 and measure both formats on activations x [tokens, K]."""
    one = expert if len(w.shape) == 3 else None
    q = load_tensor(w.file, w.weight_key, device, one)
    s = scale if one is None else scale[one]
    try:
        q2, s2 = requantize_blocks_ue8m0(q, s, block)
    except ValueError as exc:  # e.g. a NaN code (0x7F / 0xFF) in the checkpoint
        raise AuditError(f"{w.weight_key}{'' if one is None else f'[{one}]'}: {exc}") from exc
    exact_w = dequantize_fp8_blocks(q, s, block).double()
    e8m0_w = dequantize_fp8_blocks(q2, s2, block).double()
    rel, one_minus_cos = requantization_error(e8m0_w, exact_w)
    exact = x.double() @ exact_w.T
    x_fp32, x_e8m0 = (
        dequantize_fp8_groups(*quantize_fp8_groups(x, ACT_GROUP, fmt), ACT_GROUP).double()
        for fmt in (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0)
    )
    n, k = w.shape[-2:]
    return WeightError(
        name=f"{w.name}[{expert}]" if len(w.shape) == 3 else w.name,
        kind=w.kind,
        family=w.family,
        shape=(n, k),
        weight_rel_err=rel,
        weight_one_minus_cos=one_minus_cos,
        codes_changed=float((q2.view(torch.uint8) != q.view(torch.uint8)).double().mean()),
        activations=activations,
        tokens=x.shape[0],
        out_err_fp32=_rel(x_fp32 @ exact_w.T, exact),
        out_err_e8m0_act=_rel(x_e8m0 @ exact_w.T, exact),
        out_err_e8m0=_rel(x_e8m0 @ e8m0_w.T, exact),
    )


def _sample(weights: list[FP8Weight], experts: int, seed: int) -> list[tuple[FP8Weight, int]]:
    """Every non-expert weight of a layer, and every projection of `experts` of its experts
    (drawn with `seed`; a 3-D tensor's experts are its leading index)."""
    picked = [(w, 0) for w in weights if w.kind != "expert"]
    ids: dict[int, list[tuple[FP8Weight, int]]] = defaultdict(list)
    for w in weights:
        if w.kind != "expert":
            continue
        if len(w.shape) == 3:
            for e in range(w.shape[0]):
                ids[e].append((w, e))
        else:
            ids[-1 if w.expert is None else w.expert].append((w, 0))
    order = sorted(ids)
    g = torch.Generator().manual_seed(seed)
    chosen = sorted(order[i] for i in torch.randperm(len(order), generator=g)[:experts].tolist())
    return picked + [entry for e in chosen for entry in ids[e]]


def _layer_name(layer: int | None) -> str:
    """A layer as the progress bar names it (None: the weights outside numbered layers)."""
    return "unnumbered weights" if layer is None else f"layer {layer}"


def audit(
    checkpoint: Path | str,
    *,
    experts_per_layer: int = 4,
    tokens: int = 64,
    seed: int = 0,
    device: torch.device | str | None = None,
    max_ratio: float = DEFAULT_MAX_RATIO,
    activations: Path | str | None = None,
) -> AuditReport:
    """Audit every FP8 block-scaled weight's scales, and sample each layer's GEMM errors, on the
    activation dumps under `activations` where they cover a layer and synthetic probes elsewhere.
    Malformed tensors are skipped and listed; AuditError when nothing is left to measure."""
    from moe_verify.common.device import default_device

    if experts_per_layer < 0 or tokens < 1:
        raise AuditError(
            f"experts_per_layer must be >= 0 and tokens >= 1, got {experts_per_layer}, {tokens}"
        )
    if not max_ratio > 0:
        raise AuditError(f"max_ratio must be > 0, got {max_ratio}")
    path = Path(checkpoint)
    config = read_config(path)
    block = block_size(config)
    weights, unaudited, skipped = find_fp8_weights(path)
    dumps = ActivationDumps(activations) if activations is not None else None
    served = _match_dumps(dumps, weights)
    dev = torch.device(device) if device is not None else default_device()
    by_layer: dict[int | None, list[FP8Weight]] = defaultdict(list)
    for w in weights:
        by_layer[w.layer].append(w)
    probes = _Probes(tokens, seed, dev, dumps)
    layers, every_block = [], []
    ordered = sorted(by_layer, key=lambda n: (n is None, n or 0))
    for layer in progress.steps(ordered, "audit-e8m0", "layer", label=_layer_name):
        result = _audit_layer(
            layer, by_layer[layer], block, experts_per_layer, seed, served, probes, dev
        )
        unaudited += result.unaudited
        skipped += result.skipped
        if result.audit is not None:
            every_block.append(result.lost)
            layers.append(result.audit)
    if not any(layer.weights for layer in layers):
        hint = (
            "".join(f"; skipped {s.name}: {s.reason}" for s in skipped)
            if skipped
            else ": raise --experts-per-layer for an expert-only checkpoint"
        )
        raise AuditError(
            f"no GEMM of {path} was measured, nothing to give a verdict on ({len(weights)} FP8 "
            f"weights, {len(skipped)} skipped as malformed, experts_per_layer="
            f"{experts_per_layer}){hint}"
        )
    model_type = config.get("model_type")
    used = {w.activations for layer in layers for w in layer.weights}
    return AuditReport(
        checkpoint=str(path),
        model_type=model_type if isinstance(model_type, str) else None,
        block=block,
        tokens=tokens,
        experts_per_layer=experts_per_layer,
        fp8_weights=len(weights),
        model=ScaleStats.of(torch.cat([b.cpu() for b in every_block])),
        layers=layers,
        max_ratio=max_ratio,
        unaudited=unaudited,
        skipped=skipped,
        activations_path=None if dumps is None else str(dumps.path),
        activations_unused=[] if dumps is None else sorted(set(dumps.dumps) - used),
    )


def _match_dumps(dumps: ActivationDumps | None, weights: list[FP8Weight]) -> dict[str, Dump]:
    """weight key -> the dump that serves it, every match's shape checked before anything is
    measured; an error when dumps were given and none names a weight (a naming mismatch)."""
    if dumps is None:
        return {}
    served = {w.weight_key: d for w in weights if (d := dumps.find(w)) is not None}
    if not served:
        names = ", ".join(sorted(dumps.dumps)[:3])
        raise AuditError(
            f"no activation dump in {dumps.path} names a linear layer of the checkpoint (dumps "
            f"{names}...; layers e.g. {weights[0].name}; docs/audit-e8m0.md gives the naming)"
        )
    return served


class _Probes:
    """The activations of each GEMM: a layer's dump (read once per layer), or the synthetic probe
    of its width (made once per K)."""

    def __init__(
        self, tokens: int, seed: int, device: torch.device, dumps: ActivationDumps | None
    ) -> None:
        self.tokens, self.seed, self.device, self.dumps = tokens, seed, device, dumps
        self.synthetic: dict[int, torch.Tensor] = {}
        self.layer_dumps: dict[str, torch.Tensor] = {}

    def next_layer(self) -> None:
        self.layer_dumps.clear()  # a dump serves one layer: do not hold the whole model's

    def get(self, k: int, dump: Dump | None) -> tuple[torch.Tensor, str]:
        if dump is not None and self.dumps is not None:
            if dump.key not in self.layer_dumps:
                self.layer_dumps[dump.key] = self.dumps.load(dump, self.device)
            return self.layer_dumps[dump.key], dump.key
        if k not in self.synthetic:
            self.synthetic[k] = synthetic_activations(self.tokens, k, self.seed, self.device)
        return self.synthetic[k], SYNTHETIC


@dataclass
class _LayerResult:
    audit: LayerAudit | None  # None: every weight of the layer was skipped
    lost: torch.Tensor  # bits lost per block of the weights kept
    unaudited: list[str]
    skipped: list[Skipped]


def _audit_layer(
    layer: int | None,
    group: list[FP8Weight],
    block: tuple[int, int],
    experts_per_layer: int,
    seed: int,
    served: dict[str, Dump],
    probes: _Probes,
    device: torch.device,
) -> _LayerResult:
    """One layer: every weight's scales, the sampled GEMMs; a weight whose scales or codes are
    malformed is skipped whole (none of its blocks or GEMMs count)."""
    probes.next_layer()
    scales: dict[str, torch.Tensor] = {}
    skipped, unaudited = [], []
    for w in group:
        try:
            scales[w.weight_key] = load_scales(w, block, device)
        except (AuditError, UntrustedFileError) as exc:
            skipped.append(Skipped(w.weight_key, str(exc)))
    measured: list[tuple[str, WeightError]] = []
    for w, expert in _sample(group, experts_per_layer, seed + (0 if layer is None else layer + 1)):
        if w.weight_key not in scales:
            continue
        n, k = w.shape[-2:]
        if n * k == 0 or k % ACT_GROUP:
            why = "empty" if n * k == 0 else f"K = {k} is not a multiple of {ACT_GROUP}"
            unaudited.append(f"{w.weight_key}: GEMM not measured ({why})")
            continue
        x, source = probes.get(k, served.get(w.weight_key))
        try:
            error = weight_error(w, block, scales[w.weight_key], x, device, expert, source)
        except (AuditError, UntrustedFileError) as exc:
            skipped.append(Skipped(w.weight_key, str(exc)))
            del scales[w.weight_key]
            continue
        measured.append((w.weight_key, error))
    if not scales:
        return _LayerResult(None, torch.empty(0), unaudited, skipped)
    lost = torch.cat([bits_lost(s).reshape(-1) for s in scales.values()])
    result = LayerAudit(layer, ScaleStats.of(lost), [e for key, e in measured if key in scales])
    return _LayerResult(result, lost, unaudited, skipped)
