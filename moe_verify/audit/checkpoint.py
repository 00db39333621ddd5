"""Reading an FP8 block-scaled checkpoint (HF safetensors shards) for `moe-verify audit-e8m0`:
its e4m3 weights with their block scales, one tensor or one expert at a time, and a clear error
naming the file or tensor for anything malformed."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

# Scale tensors beside an FP8 `<name>.weight`: DeepSeek-V3 / Qwen FP8 checkpoints name the
# dequantization multiplier `weight_scale_inv` (W = q * s despite the name); others `weight_scale`.
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
DEFAULT_BLOCK = (128, 128)

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
    expert: int | None = None  # a 2-D routed expert's id (a 3-D tensor's experts: its rows)


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


def read_config(checkpoint: Path) -> dict[str, object]:
    path = (checkpoint if checkpoint.is_dir() else checkpoint.parent) / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AuditError(f"{path} is not valid JSON: {exc}") from exc
    return config if isinstance(config, dict) else {}


def block_size(config: dict[str, object]) -> tuple[int, int]:
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
        layer, expert = _LAYER.search(module), _EXPERT.search(module + ".")
        found.append(
            FP8Weight(
                module,
                where[key],
                key,
                where[scale],
                scale,
                shape,
                int(layer.group(1)) if layer else None,
                _kind(module),
                int(expert.group(1)) if expert else None,
            )
        )
    return found, unaudited


def _is_scale(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in SCALE_SUFFIXES


def _natural(key: str) -> list[object]:
    """Sort key that puts layer 10 after layer 9."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def load_tensor(
    file: Path, key: str, device: torch.device, expert: int | None = None
) -> torch.Tensor:
    """One tensor, or one expert (leading index) of it, read alone from its shard."""
    with safe_open(str(file), framework="pt", device="cpu") as f:
        t = f.get_tensor(key) if expert is None else f.get_slice(key)[expert]
    return t.to(device)


def load_scales(
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
    s = load_tensor(w.scale_file, w.scale_key, device, expert)
    bad = ~torch.isfinite(s) | (s < 2.0**-126) | (s > 2.0**127)
    if bool(bad.any()):
        at = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AuditError(
            f"{w.scale_key} holds {int(bad.sum())} scales outside the normal fp32 range "
            f"[2^-126, 2^127] that UE8M0 spans (or not finite), first {s[at].item()} at {at}"
        )
    return s
