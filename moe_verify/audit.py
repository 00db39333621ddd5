"""`moe-verify audit-e8m0 CHECKPOINT`: what E8M0 (power-of-two) scales cost a model's FP8 weights.

With E8M0 on (Blackwell always, Hopper with VLLM_USE_DEEP_GEMM_E8M0), vLLM requantizes every
block-scaled FP8 weight to power-of-two scales (`requant_weight_ue8m0_inplace`: dequantize, then
quantize again with s' = 2^ceil(log2 s)) and quantizes activations with ceil-UE8M0 group scales.
A checkpoint whose scales already are powers of two loses nothing on the weight side; any other
loses up to one bit per block to the ceil and re-rounds every code. The audit measures, on the
checkpoint's own tensors (ref/anchors.md, gap 6):

- every block's ceil factor r = ceil_ue8m0(s) / s in [1, 2) and log2(r), the bits of range lost
  (scales only, so every FP8 weight of the model is covered). Requantization really computes
  s' = ceil_ue8m0(amax / 448) from the dequantized block, which is ceil_ue8m0(s) when the block's
  largest code is 448, as amax-scaled quantizers (DeepSeek's, vLLM's) leave it;
- for a sample of weights per layer: the requantized weight's error and changed codes, and the
  GEMM output error against an exact float64 product on synthetic activations, three ways: fp32
  scales (what SM90 runs by default), E8M0 activation scales with the checkpoint's weights, and
  full E8M0 (the weights requantized too);
- the per-layer errors compounded over the model's layers as a root-sum-square (independent
  errors adding up along the residual stream). The verdict is on what requantizing the weights
  multiplies E8M0's error by (full E8M0 over E8M0 activations alone); its denominator depends on
  the synthetic activations, so compare models by the same command's numbers.

The verdict is about numerics, not task accuracy: an `at-risk` model is a candidate for vLLM's
E8M0 auto-disable list, to be confirmed with a task A/B (as vLLM did for Qwen3.5, anchors #10).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from moe_verify.spec import ScaleFmt
from reference.formats import (
    ceil_ue8m0,
    dequantize_fp8_blocks,
    dequantize_fp8_groups,
    quantize_fp8_groups,
    requantize_blocks_ue8m0,
)

# Scale tensors beside an FP8 `<name>.weight`: DeepSeek-V3 / Qwen FP8 checkpoints name the
# dequantization multiplier `weight_scale_inv` (W = q * s despite the name); others `weight_scale`.
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
DEFAULT_BLOCK = (128, 128)
ACT_GROUP = 128  # the 1 x 128 activation groups of the FP8 block recipe
# Default verdict limit: requantizing the weights may raise E8M0's compounded output error to at
# most 1.25x what E8M0 activation scales alone give. Power-of-two weight scales requantize to the
# same values (exactly 1x); any other scale re-rounds every code, an error as large as an FP8
# rounding of the weight itself: ~1.4x on synthetic Gaussian weights (tests/harness/test_audit.py).
# So with this limit every checkpoint whose scales are not powers of two comes out at-risk, which
# is what requantization does to it; how much is in the ratio and the compounded errors.
# Provisional: not calibrated against task accuracy (no real checkpoint audited yet).
DEFAULT_MAX_RATIO = 1.25
HIST_BINS = 10  # ceil-factor histogram over [1, 2)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class AuditError(ValueError):
    """The checkpoint cannot be audited as given (the message names the file or tensor)."""


@dataclass(frozen=True)
class FP8Weight:
    """One block-scaled FP8 linear weight of the checkpoint (a 3-D tensor holds all experts)."""

    name: str  # the module, e.g. "model.layers.3.mlp.experts.17.down_proj"
    file: Path
    weight_key: str
    scale_file: Path
    scale_key: str
    shape: tuple[int, ...]
    layer: int | None
    kind: str  # "expert", "shared_expert", "mlp", "attention" or "other"


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
    weight_rel_err: float  # ||W_e8m0 - W|| / ||W||
    codes_changed: float  # fraction of fp8 codes the requantization changed
    out_err_fp32: float  # ||deq(X_q) @ W^T - X @ W^T|| / ||X @ W^T||, fp32 activation scales
    out_err_e8m0_act: float  # the same with ceil-UE8M0 activation scales
    out_err_e8m0: float  # ceil-UE8M0 activation scales and the requantized weight W_e8m0


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
        return (
            f"{weights}{left_out}; compounded over {layers}, requantizing the weights gives "
            f"{self.ratio:.3f}x the output error of E8M0 activation scales alone (limit "
            f"{self.max_ratio:g}x); output error fp32 scales {self.compounded_fp32:.4g}, E8M0 "
            f"activations {self.compounded_e8m0_act:.4g}, full E8M0 {self.compounded_e8m0:.4g}"
        )

    def to_json(self) -> str:
        out = asdict(self)
        out.update(
            verdict=self.verdict,
            reason=self.reason,
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


def _rss(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values))


# Reading a checkpoint -----------------------------------------------------------------------------


def _files(checkpoint: Path) -> list[Path]:
    if not checkpoint.exists():
        raise AuditError(f"checkpoint {checkpoint} does not exist")
    if checkpoint.is_file():
        if checkpoint.suffix != ".safetensors":
            raise AuditError(f"checkpoint {checkpoint} is not a .safetensors file")
        return [checkpoint]
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise AuditError(f"checkpoint directory {checkpoint} holds no *.safetensors files")
    return files


def _config(checkpoint: Path) -> dict[str, object]:
    path = (checkpoint if checkpoint.is_dir() else checkpoint.parent) / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AuditError(f"{path} is not valid JSON: {exc}") from exc
    return config if isinstance(config, dict) else {}


def _block(config: dict[str, object]) -> tuple[int, int]:
    quant = config.get("quantization_config")
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if block is None:
        return DEFAULT_BLOCK
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise AuditError(
            f"config.json quantization_config.weight_block_size must be [bm, bk], got {block!r}"
        )
    return block[0], block[1]


def _kind(name: str) -> str:
    if "shared_expert" in name:
        return "shared_expert"
    if ".experts." in name + ".":
        return "expert"
    if "attn" in name:
        return "attention"
    if ".mlp." in name + ".":
        return "mlp"
    return "other"


def _index(checkpoint: Path) -> dict[str, str] | None:
    """The weight map of a sharded HF checkpoint (tensor -> file), when it has one."""
    path = checkpoint / "model.safetensors.index.json" if checkpoint.is_dir() else None
    if path is None or not path.is_file():
        return None
    try:
        weight_map = json.loads(path.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise AuditError(f"{path} is not a safetensors index: {exc}") from exc
    if not isinstance(weight_map, dict):
        raise AuditError(f"{path} has no 'weight_map' object")
    return weight_map


def find_fp8_weights(checkpoint: Path) -> tuple[list[FP8Weight], list[str]]:
    """Every FP8 (e4m3) `<module>.weight` of the checkpoint with its block scale tensor (which a
    sharded checkpoint may keep in another file), and the FP8 tensors that are not such weights,
    each with why (listed in the report, never dropped silently)."""
    index = _index(checkpoint)
    where: dict[str, Path] = {}
    dtypes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in _files(checkpoint):
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error type for a corrupt header
            raise AuditError(f"{path} cannot be read as safetensors: {exc}") from exc
        with handle as f:
            for key in f.keys():
                if index is not None and index.get(key) != path.name:
                    continue  # the index names another file (e.g. a consolidated copy)
                if key in where:
                    raise AuditError(
                        f"tensor {key} is in both {where[key].name} and {path.name}, and no "
                        "model.safetensors.index.json says which one the model loads"
                    )
                where[key] = path
                sl = f.get_slice(key)
                dtypes[key] = (sl.get_dtype(), tuple(sl.get_shape()))
    fp8 = {k: shape for k, (dtype, shape) in dtypes.items() if dtype == "F8_E4M3"}
    weights = {k: shape for k, shape in fp8.items() if k.endswith(".weight")}
    unaudited = [
        f"{k} ({dtype}): not an e4m3 '*.weight' with a block scale"
        for k, (dtype, _) in sorted(dtypes.items(), key=lambda item: _natural(item[0]))
        if dtype.startswith("F8_") and k not in weights and not _is_scale(k)
    ]
    if not weights:
        raise AuditError(
            f"{checkpoint} holds no FP8 (float8_e4m3fn) '*.weight' tensors: nothing to audit"
        )
    found = []
    for key in sorted(weights, key=_natural):
        module, shape = key[: -len(".weight")], weights[key]
        scale = next((f"{module}.{s}" for s in SCALE_SUFFIXES if f"{module}.{s}" in where), None)
        if scale is None:
            raise AuditError(
                f"{where[key].name}: FP8 weight {key} has no block scale "
                f"(looked for {' or '.join(f'{module}.{s}' for s in SCALE_SUFFIXES)})"
            )
        if len(shape) not in (2, 3):
            raise AuditError(
                f"{where[key].name}: FP8 weight {key} is {shape}, not [N, K] or [E, N, K]"
            )
        match = _LAYER.search(module)
        layer = int(match.group(1)) if match else None
        found.append(
            FP8Weight(module, where[key], key, where[scale], scale, shape, layer, _kind(module))
        )
    return found, unaudited


def _is_scale(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in SCALE_SUFFIXES


def _natural(key: str) -> list[object]:
    """Sort key that puts layer 10 after layer 9."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def _load(file: Path, key: str, device: torch.device, expert: int | None = None) -> torch.Tensor:
    """One tensor, or one expert (leading index) of it, read alone from its shard."""
    with safe_open(str(file), framework="pt", device="cpu") as f:
        t = f.get_tensor(key) if expert is None else f.get_slice(key)[expert]
    return t.to(device)


def _scales(
    w: FP8Weight, block: tuple[int, int], device: torch.device, expert: int | None = None
) -> torch.Tensor:
    """The weight's block scales (one expert's when `expert` is given), checked: float32, one
    per block, and each a normal fp32 number > 0 (UE8M0 spans 2^-126 .. 2^127)."""
    *lead, n, k = w.shape
    want = (*lead, -(-n // block[0]), -(-k // block[1]))
    with safe_open(str(w.scale_file), framework="pt", device="cpu") as f:
        sl = f.get_slice(w.scale_key)
        dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
    if dtype != "F32" or shape != want:
        raise AuditError(
            f"{w.scale_key} is {dtype} {shape}; a {block[0]}x{block[1]}-block scale of "
            f"{w.weight_key} {w.shape} must be float32 (F32) {want}"
        )
    s = _load(w.scale_file, w.scale_key, device, expert)
    bad = ~torch.isfinite(s) | (s < 2.0**-126) | (s > 2.0**127)
    if bool(bad.any()):
        at = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AuditError(
            f"{w.scale_key} holds {int(bad.sum())} scales outside the normal fp32 range "
            f"[2^-126, 2^127] that UE8M0 spans (or not finite), first {s[at].item()} at {at}"
        )
    return s


def bits_lost(scale: torch.Tensor) -> torch.Tensor:
    """log2(ceil_ue8m0(s) / s) per block of normal scales: 0 for a power of two, below 1."""
    return torch.log2(ceil_ue8m0(scale).double() / scale.double())


# Measuring ----------------------------------------------------------------------------------------


def synthetic_activations(tokens: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    """bf16 [tokens, k]: N(0, 1) with 1 in 200 channels 30x larger, the outlier channels LLM
    activations have (they set a group's scale, pushing the group's other values toward the
    subnormal codes, where ceil scales cost most)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    outliers = torch.randperm(k, generator=g)[: max(1, k // 200)]
    x[:, outliers] *= 30.0
    return x.to(torch.bfloat16).to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    norm = float(torch.linalg.vector_norm(b))
    return float(torch.linalg.vector_norm(a - b)) / norm if norm > 0 else 0.0


def weight_error(
    w: FP8Weight, block: tuple[int, int], x: torch.Tensor, device: torch.device, expert: int = 0
) -> WeightError:
    """Requantize one weight (expert `expert` of a 3-D tensor) to E8M0 and measure both formats
    on activations x [tokens, K]."""
    one = expert if len(w.shape) == 3 else None
    q, s = _load(w.file, w.weight_key, device, one), _scales(w, block, device, one)
    try:
        q2, s2 = requantize_blocks_ue8m0(q, s, block)
    except ValueError as exc:  # e.g. a NaN code (0x7F / 0xFF) in the checkpoint
        raise AuditError(f"{w.weight_key}{'' if one is None else f'[{one}]'}: {exc}") from exc
    exact_w = dequantize_fp8_blocks(q, s, block).double()
    e8m0_w = dequantize_fp8_blocks(q2, s2, block).double()
    exact = x.double() @ exact_w.T
    x_fp32, x_e8m0 = (
        dequantize_fp8_groups(*quantize_fp8_groups(x, ACT_GROUP, fmt), ACT_GROUP).double()
        for fmt in (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0)
    )
    return WeightError(
        name=f"{w.name}[{expert}]" if len(w.shape) == 3 else w.name,
        kind=w.kind,
        weight_rel_err=_rel(e8m0_w, exact_w),
        codes_changed=float((q2.view(torch.uint8) != q.view(torch.uint8)).double().mean()),
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
            match = _EXPERT.search(w.name + ".")
            ids[int(match.group(1)) if match else -1].append((w, 0))
    order = sorted(ids)
    g = torch.Generator().manual_seed(seed)
    chosen = sorted(order[i] for i in torch.randperm(len(order), generator=g)[:experts].tolist())
    return picked + [entry for e in chosen for entry in ids[e]]


def audit(
    checkpoint: Path | str,
    *,
    experts_per_layer: int = 4,
    tokens: int = 64,
    seed: int = 0,
    device: torch.device | str | None = None,
    max_ratio: float = DEFAULT_MAX_RATIO,
) -> AuditReport:
    """Audit every FP8 block-scaled weight's scales, and sample each layer's GEMM errors."""
    from moe_verify.device import default_device

    if experts_per_layer < 0 or tokens < 1:
        raise AuditError(
            f"experts_per_layer must be >= 0 and tokens >= 1, got {experts_per_layer}, {tokens}"
        )
    if not max_ratio > 0:
        raise AuditError(f"max_ratio must be > 0, got {max_ratio}")
    path = Path(checkpoint)
    config = _config(path)
    block = _block(config)
    weights, unaudited = find_fp8_weights(path)
    dev = torch.device(device) if device is not None else default_device()
    by_layer: dict[int | None, list[FP8Weight]] = defaultdict(list)
    for w in weights:
        by_layer[w.layer].append(w)
    activations: dict[int, torch.Tensor] = {}
    layers, every_block = [], []
    for layer in sorted(by_layer, key=lambda n: (n is None, n or 0)):
        group = by_layer[layer]
        lost = torch.cat([bits_lost(_scales(w, block, dev)).reshape(-1) for w in group])
        every_block.append(lost.cpu())
        result = LayerAudit(layer, ScaleStats.of(lost))
        for w, expert in _sample(
            group, experts_per_layer, seed + (0 if layer is None else layer + 1)
        ):
            n, k = w.shape[-2:]
            if n * k == 0 or k % ACT_GROUP:
                why = "empty" if n * k == 0 else f"K = {k} is not a multiple of {ACT_GROUP}"
                unaudited.append(f"{w.weight_key}: GEMM not measured ({why})")
                continue
            if k not in activations:
                activations[k] = synthetic_activations(tokens, k, seed, dev)
            result.weights.append(weight_error(w, block, activations[k], dev, expert))
        layers.append(result)
    if not any(layer.weights for layer in layers):
        raise AuditError(
            f"no GEMM of {path} was measured ({len(weights)} FP8 weights, experts_per_layer="
            f"{experts_per_layer}): raise --experts-per-layer for an expert-only checkpoint"
        )
    model_type = config.get("model_type")
    return AuditReport(
        checkpoint=str(path),
        model_type=model_type if isinstance(model_type, str) else None,
        block=block,
        tokens=tokens,
        experts_per_layer=experts_per_layer,
        fp8_weights=len(weights),
        model=ScaleStats.of(torch.cat(every_block)),
        layers=layers,
        max_ratio=max_ratio,
        unaudited=unaudited,
    )


# Reporting ---------------------------------------------------------------------------------------


def _bar(count: int, most: int, width: int = 30) -> str:
    return "#" * round(width * count / most) if most else ""


def to_markdown(report: AuditReport, plots: list[str] | None = None) -> str:
    m = report.model
    sampled = sum(len(layer.weights) for layer in report.layers)
    lines = [
        f"# E8M0 audit: {report.checkpoint}",
        "",
        f"model_type {report.model_type or '-'}; {report.fp8_weights} FP8 weight tensors in "
        f"{report.block[0]}x{report.block[1]} blocks; {sampled} GEMMs sampled (every non-expert "
        f"weight, {report.experts_per_layer} experts per layer) on {report.tokens} synthetic "
        "tokens (N(0,1), 1 in 200 channels 30x).",
        "",
        f"**Verdict: {report.verdict}**: {report.reason}.",
        "",
        f"## Ceil factor r = ceil_ue8m0(s) / s of all {m.blocks} weight blocks",
        "",
        f"Already powers of two: {m.pow2_fraction:.2%}; bits lost log2(r): mean "
        f"{m.mean_bits_lost:.4f}, max {m.max_bits_lost:.4f} (0 for power-of-two scales, 0.5 for "
        "scales spread evenly on a log scale).",
        "",
        "| r | blocks | share | |",
        "| --- | --- | --- | --- |",
    ]
    most = max(m.histogram) if m.histogram else 0
    for i, count in enumerate(m.histogram):
        lo, hi = 1 + i / HIST_BINS, 1 + (i + 1) / HIST_BINS
        share = count / m.blocks if m.blocks else 0.0
        lines.append(f"| [{lo:.1f}, {hi:.1f}) | {count} | {share:.1%} | `{_bar(count, most)}` |")
    lines += [
        "",
        "## Per layer",
        "",
        "Output errors are ||Y - X W^T|| / ||X W^T|| against the exact float64 product with the "
        "checkpoint's weights: `fp32` quantizes the activations with fp32 scales, `E8M0 act` "
        "with ceil-UE8M0 scales, `E8M0` also requantizes the weight; ratio = E8M0 / E8M0 act. "
        "Layer values are the RMS over the layer's sampled GEMMs. A block whose largest code "
        "is <= 224 requantizes to half the scale and twice the codes: codes change, values "
        "do not.",
        "",
        "| layer | blocks | pow2 | mean bits lost | GEMMs | fp32 | E8M0 act | E8M0 | ratio "
        "| worst GEMM (E8M0) | its weight err | codes changed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for layer in report.layers:
        s = layer.scales
        worst = max(layer.weights, key=lambda w: w.out_err_e8m0, default=None)
        ratio = layer.out_err_e8m0 / layer.out_err_e8m0_act if layer.out_err_e8m0_act else math.nan
        tail = (
            f"{worst.name} | {worst.weight_rel_err:.3g} | {worst.codes_changed:.1%}"
            if worst
            else "- | - | -"
        )
        lines.append(
            f"| {'-' if layer.layer is None else layer.layer} | {s.blocks} | "
            f"{s.pow2_fraction:.1%} | {s.mean_bits_lost:.4f} | {len(layer.weights)} | "
            f"{layer.out_err_fp32:.4g} | {layer.out_err_e8m0_act:.4g} | {layer.out_err_e8m0:.4g} "
            f"| {ratio:.3f} | {tail} |"
        )
    lines += [
        "",
        "## Compounded over the model",
        "",
        "Root-sum-square of the per-layer output errors (independent errors adding up along the "
        f"residual stream): fp32 scales {report.compounded_fp32:.4g}, E8M0 activations "
        f"{report.compounded_e8m0_act:.4g}, full E8M0 {report.compounded_e8m0:.4g}; requantizing "
        f"the weights multiplies E8M0's error by **{report.ratio:.3f}x** (limit "
        f"{report.max_ratio:g}x; `at-risk` above it: a candidate for vLLM's E8M0 auto-disable "
        "list, to confirm with a task A/B). Requantization re-rounds every weight whose scale "
        "is not a power of two, so such checkpoints exceed the default limit; compare models "
        "by the ratio and the compounded errors, whose activation part depends on the "
        "synthetic activations and is the same for every checkpoint.",
    ]
    if report.unaudited:
        lines += ["", f"## Not audited ({len(report.unaudited)})", ""]
        lines += [f"- {entry}" for entry in report.unaudited]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    elif plots is not None:
        lines += ["", "Plots skipped: matplotlib is not installed (`pip install matplotlib`)."]
    return "\n".join(lines) + "\n"


def write_plots(report: AuditReport, out_dir: Path) -> list[str]:
    """PNG plots of the ceil factors and the per-layer errors; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    edges = [1 + i / HIST_BINS for i in range(HIST_BINS)]
    ax.bar(edges, report.model.histogram, width=1 / HIST_BINS, align="edge")
    ax.set_xlabel("ceil factor r = ceil_ue8m0(s) / s")
    ax.set_ylabel("weight blocks")
    ax.set_title(f"Range lost to E8M0 scales, per {report.block[0]}x{report.block[1]} block")
    path = out_dir / "ceil_factor.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    files.append(str(path))

    measured = [layer for layer in report.layers if layer.weights]
    if measured:
        xs = [layer.layer if layer.layer is not None else -1 for layer in measured]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(xs, [layer.out_err_fp32 for layer in measured], "o-", label="fp32 scales")
        ax.plot(xs, [layer.out_err_e8m0_act for layer in measured], "^-", label="E8M0 activations")
        ax.plot(xs, [layer.out_err_e8m0 for layer in measured], "s-", label="E8M0")
        ax.set_xlabel("layer (-1: outside the numbered layers)")
        ax.set_ylabel("relative GEMM output error (RMS)")
        ax.set_title("Per-layer output error on synthetic activations")
        ax.legend()
        path = out_dir / "layer_error.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(str(path))
    return files


def write_report(report: AuditReport, out_dir: Path) -> list[Path]:
    """report.md, report.json and the plots into out_dir; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(report, out_dir)
    (out_dir / "report.md").write_text(to_markdown(report, plots))
    (out_dir / "report.json").write_text(report.to_json())
    return [out_dir / "report.md", out_dir / "report.json", *map(Path, plots)]
