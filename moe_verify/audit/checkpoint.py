"""Reading an FP8 block-scaled checkpoint (HF safetensors shards) for `moe-verify audit-e8m0`:
its e4m3 weights with their block scales, one tensor or one expert at a time.

A checkpoint is untrusted input: config.json, the index and every shard are read through
moe_verify.common.safe_io, so only regular files inside the checkpoint directory are opened, every
safetensors header is checked before a tensor is read, and a bad file is an UntrustedFileError
naming it (a ValueError, as AuditError is).

What is wrong with the checkpoint as a whole (a path leading out of it, a FIFO among its shards,
a bad config.json or index, a tensor in two shards) stops the audit. What is wrong with one tensor
(a scale of the wrong shape or dtype, a zero/negative/NaN scale, a weight without a scale, a NaN
code) or one shard's contents (a truncated or corrupt header) is a Skipped entry: listed in the
report, left out of every figure, and the rest is audited."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_verify.common.safe_io import (
    SafetensorsFile,
    UntrustedFileError,
    open_safetensors,
    read_json,
    safe_file,
)
from moe_verify.spec import ceil_div

# Scale tensors beside an FP8 `<name>.weight`: DeepSeek-V3 / Qwen FP8 checkpoints name the
# dequantization multiplier `weight_scale_inv` (W = q * s despite the name); others `weight_scale`.
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
DEFAULT_BLOCK = (128, 128)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class AuditError(ValueError):
    """The checkpoint cannot be audited as given (the message names the file or tensor)."""


@dataclass(frozen=True)
class Skipped:
    """A malformed tensor (or an unreadable shard) the audit left out, and why."""

    name: str  # the weight tensor's key, or the shard's file name
    reason: str


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

    @property
    def family(self) -> str:
        """The kind and the projection, e.g. "attention.o_proj", "expert.down_proj": the layer
        families the published requantization figures are flat across."""
        return f"{self.kind}.{self.name.rsplit('.', 1)[-1]}"


def _root(checkpoint: Path) -> Path:
    """The directory every file of the checkpoint must lie in: the directory the user named, or
    the one holding the file they named (their own path is trusted, and resolved; what the
    checkpoint's files and index point to is not)."""
    if not checkpoint.exists():
        raise AuditError(f"checkpoint {checkpoint} does not exist")
    real = checkpoint.resolve()
    return real if real.is_dir() else real.parent


def _within(root: Path) -> Path:
    """Where the checkpoint's symlinks may point: the checkpoint directory itself, or for a
    Hugging Face cache snapshot (`models--org--name/snapshots/<revision>`, whose files link to
    `../../blobs/<hash>`) the cached repository that holds both."""
    snapshots = root.parent
    if snapshots.name == "snapshots" and snapshots.parent.name.startswith(
        ("models--", "datasets--")
    ):
        return snapshots.parent
    return root


def _files(checkpoint: Path) -> list[Path]:
    """The checkpoint's shards, each checked to be a regular file inside it."""
    root = _root(checkpoint)
    if not checkpoint.is_dir():
        if checkpoint.suffix != ".safetensors":
            raise AuditError(f"checkpoint {checkpoint} is not a .safetensors file")
        return [safe_file(root, checkpoint.resolve().name)]
    within = _within(root)
    files = [safe_file(root, p.name, within=within) for p in sorted(root.glob("*.safetensors"))]
    if not files:
        raise AuditError(f"checkpoint directory {checkpoint} holds no *.safetensors files")
    return files


def read_config(checkpoint: Path) -> dict[str, object]:
    """config.json beside the shards, or {} when there is none."""
    root = _root(checkpoint)
    if not os.path.lexists(root / "config.json"):
        return {}
    config = read_json(root, "config.json", within=_within(root))
    if not isinstance(config, dict):
        raise UntrustedFileError(
            f"{root / 'config.json'}: a JSON {type(config).__name__}, not an object"
        )
    return config


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


def _index(checkpoint: Path) -> dict[str, Path] | None:
    """The weight map of a sharded HF checkpoint (tensor -> file), when it has one; every file it
    names checked to be a regular file inside the checkpoint."""
    root = _root(checkpoint)
    name = "model.safetensors.index.json"
    if not checkpoint.is_dir() or not os.path.lexists(root / name):
        return None
    index = read_json(root, name, within=_within(root))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise AuditError(f"{root / name} has no 'weight_map' object of tensor -> file name")
    files: dict[str, Path] = {}
    for file in sorted(set(weight_map.values())):
        try:
            files[file] = safe_file(root, file, within=_within(root))
        except UntrustedFileError as exc:
            raise UntrustedFileError(f"{root / name}: weight_map entry {exc}") from None
    return {key: files[file] for key, file in weight_map.items()}


def find_fp8_weights(checkpoint: Path) -> tuple[list[FP8Weight], list[str], list[Skipped]]:
    """Every FP8 (e4m3) `<module>.weight` of the checkpoint with its block scale tensor (which a
    sharded checkpoint may keep in another file); the FP8 tensors that are not such weights, each
    with why; and the weights and shards skipped as malformed (both lists go in the report,
    nothing is dropped silently)."""
    index = _index(checkpoint)
    where: dict[str, Path] = {}
    dtypes: dict[str, tuple[str, tuple[int, ...]]] = {}
    skipped: list[Skipped] = []
    unreadable: dict[Path, str] = {}
    for path in _files(checkpoint):
        try:
            shard = _open(path)
        except UntrustedFileError as exc:
            unreadable[path] = str(exc).removeprefix(f"{path}: ")
            skipped.append(Skipped(path.name, f"shard not read: {unreadable[path]}"))
            continue
        with shard as f:
            for key, info in f.tensors.items():
                if index is not None and index.get(key) != path:
                    continue  # the index names another file (e.g. a consolidated copy)
                if key in where:
                    raise AuditError(
                        f"tensor {key} is in both {where[key].name} and {path.name}, and no "
                        "model.safetensors.index.json says which one the model loads"
                    )
                where[key] = path
                dtypes[key] = (info.dtype, info.shape)
    fp8 = {k: shape for k, (dtype, shape) in dtypes.items() if dtype == "F8_E4M3"}
    weights = {k: shape for k, shape in fp8.items() if k.endswith(".weight")}
    unaudited = [
        f"{k} ({dtype}): not an e4m3 '*.weight' with a block scale"
        for k, (dtype, _) in sorted(dtypes.items(), key=lambda item: _natural(item[0]))
        if dtype.startswith("F8_") and k not in weights and not _is_scale(k)
    ]
    if not weights:
        read = "" if not skipped else " in the shards it could read"
        raise AuditError(
            f"{checkpoint} holds no FP8 (float8_e4m3fn) '*.weight' tensors{read}: nothing to "
            "audit" + "".join(f"; skipped {s.name}: {s.reason}" for s in skipped)
        )
    found = []
    for key in sorted(weights, key=_natural):
        module, shape = key[: -len(".weight")], weights[key]
        scale = next((f"{module}.{s}" for s in SCALE_SUFFIXES if f"{module}.{s}" in where), None)
        if scale is None:
            skipped.append(Skipped(key, _no_scale(module, index, unreadable)))
            continue
        if len(shape) not in (2, 3):
            skipped.append(Skipped(key, f"FP8 weight {key} is {shape}, not [N, K] or [E, N, K]"))
            continue
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
    return found, unaudited, skipped


def _no_scale(module: str, index: dict[str, Path] | None, unreadable: dict[Path, str]) -> str:
    """Why `<module>.weight` has no block scale: none in the checkpoint, or its index puts the
    scale in a shard that could not be read."""
    names = [f"{module}.{s}" for s in SCALE_SUFFIXES]
    lost = next((n for n in names if index is not None and index.get(n) in unreadable), None)
    if lost is not None and index is not None:
        return f"its block scale {lost} is in {index[lost].name}, which could not be read"
    return f"no block scale (looked for {' or '.join(names)})"


def _is_scale(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in SCALE_SUFFIXES


def _natural(key: str) -> list[object]:
    """Sort key that puts layer 10 after layer 9."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def _open(file: Path) -> SafetensorsFile:
    """A shard found by find_fp8_weights (already a checked path), its header checked again at
    every open: the file may have changed since."""
    return open_safetensors(file.parent, file.name)


def load_tensor(
    file: Path, key: str, device: torch.device, expert: int | None = None
) -> torch.Tensor:
    """One tensor, or one expert (leading index) of it, read alone from its shard."""
    with _open(file) as f:
        t = f.tensor(key, expert)
    return t.to(device)


def load_scales(
    w: FP8Weight, block: tuple[int, int], device: torch.device, expert: int | None = None
) -> torch.Tensor:
    """The weight's block scales (one expert's when `expert` is given), checked: float32, one
    per block, and each a normal fp32 number > 0 (UE8M0 spans 2^-126 .. 2^127)."""
    *lead, n, k = w.shape
    want = (*lead, ceil_div(n, block[0]), ceil_div(k, block[1]))
    with _open(w.scale_file) as f:
        info = f.info(w.scale_key)
        if info.dtype != "F32" or info.shape != want:
            raise AuditError(
                f"{w.scale_key} is {info.dtype} {info.shape}; a {block[0]}x{block[1]}-block "
                f"scale of {w.weight_key} {w.shape} must be float32 (F32) {want}"
            )
        s = f.tensor(w.scale_key, expert).to(device)
    bad = ~torch.isfinite(s) | (s < 2.0**-126) | (s > 2.0**127)
    if bool(bad.any()):
        at = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AuditError(
            f"{w.scale_key} holds {int(bad.sum())} scales outside the normal fp32 range "
            f"[2^-126, 2^127] that UE8M0 spans (or not finite), first {s[at].item()} at {at}"
        )
    return s
