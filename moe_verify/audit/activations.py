"""Activation dumps for `moe-verify audit-e8m0 --activations PATH`: the real inputs of the
checkpoint's linear layers, used in place of the synthetic probes for the layers they cover.

PATH is a safetensors file or a directory of them (`*.safetensors`, not recursive). Each tensor is
the input of one linear layer as a forward pre-hook in a vLLM run records it: [T, K] (T tokens,
K the layer's input features, vLLM's flattened token dimension), F32, BF16 or F16, finite, named
after the module. A dump serves the checkpoint weight `<module>.weight` when its name is, in this
order:
  1. `<module>` itself, e.g. `model.layers.3.self_attn.o_proj`;
  2. vLLM's merged linear layer: `<parent>.qkv_proj` for `<parent>.{q,k,v}_proj`,
     `<parent>.gate_up_proj` for `<parent>.{gate,up}_proj` (dense and shared-expert MLPs);
  3. vLLM's FusedMoE module `<...>.experts` for every routed expert's first GEMM
     (`experts.<e>.{gate_proj,up_proj,w1,w3}`, a fused `experts.gate_up_proj`): its input is the
     layer's hidden states, which every expert's first GEMM reads (for the tokens routed to it).
     The per-expert input of down_proj is not visible to a hook, so it keeps the synthetic probe.
A tensor name in two files is refused, and so is a dump whose shape does not fit a weight it
names: one line naming the dump, the weight and both shapes. Dumps are untrusted files and are
read through moe_verify.common.safe_io only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_verify.audit.checkpoint import AuditError, FP8Weight
from moe_verify.common.safe_io import open_safetensors, safe_file

DUMP_DTYPES = ("F32", "BF16", "F16")  # what quantize_fp8_groups takes, as vLLM's hooks see it
_MERGED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_EXPERT_FIRST_GEMM = re.compile(
    r"^(.*\.experts)\.(?:\d+\.)?(gate_proj|up_proj|w1|w3|gate_up_proj)$"
)


@dataclass(frozen=True)
class Dump:
    """One dumped activation, from its file's checked header."""

    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]


def dump_names(module: str) -> list[str]:
    """The dump names that serve `<module>.weight`, most specific first (see the module doc)."""
    names = [module]
    parent, _, proj = module.rpartition(".")
    fused = _EXPERT_FIRST_GEMM.match(module)
    if fused:
        names.append(fused.group(1))
    elif proj in _MERGED and parent:
        names.append(f"{parent}.{_MERGED[proj]}")
    return names


class ActivationDumps:
    """The dumps under PATH, by name; tensors are read only when a GEMM uses them."""

    def __init__(self, path: Path | str) -> None:
        given = Path(path)
        if not given.exists():
            raise AuditError(f"activations {given} does not exist")
        real = given.resolve()
        root = real if real.is_dir() else real.parent
        if real.is_dir():
            files = [safe_file(root, p.name) for p in sorted(root.glob("*.safetensors"))]
            if not files:
                raise AuditError(f"activations directory {given} holds no *.safetensors files")
        elif real.suffix != ".safetensors":
            raise AuditError(f"activations {given} is not a .safetensors file")
        else:
            files = [safe_file(root, real.name)]
        self.path = given
        self.dumps: dict[str, Dump] = {}
        for file in files:
            with open_safetensors(file.parent, file.name) as f:
                for key, info in f.tensors.items():
                    if key in self.dumps:
                        raise AuditError(
                            f"activation dump {key!r} is in both {self.dumps[key].file.name} and "
                            f"{file.name}: one dump per layer"
                        )
                    self.dumps[key] = Dump(key, file, info.dtype, info.shape)

    def find(self, w: FP8Weight) -> Dump | None:
        """The dump serving weight `w`, its shape checked against the weight's [..., N, K]; None
        when no dump names it."""
        dump = next((self.dumps[n] for n in dump_names(w.name) if n in self.dumps), None)
        if dump is None:
            return None
        k = w.shape[-1]
        if dump.dtype not in DUMP_DTYPES or len(dump.shape) != 2 or dump.shape[1] != k:
            raise AuditError(
                f"activation dump {dump.key!r} in {dump.file.name} is {dump.dtype} "
                f"{list(dump.shape)}; as the input of {w.weight_key} {list(w.shape)} it must be "
                f"[T, {k}] of {', '.join(DUMP_DTYPES)}"
            )
        if dump.shape[0] == 0:
            raise AuditError(
                f"activation dump {dump.key!r} in {dump.file.name} is [0, {k}]: no tokens"
            )
        return dump

    def load(self, dump: Dump, device: torch.device) -> torch.Tensor:
        """The dump's [T, K] tensor on `device`, refused when it holds NaN or Inf."""
        with open_safetensors(dump.file.parent, dump.file.name) as f:
            x = f.tensor(dump.key)
        bad = int((~torch.isfinite(x)).sum())
        if bad:
            raise AuditError(
                f"activation dump {dump.key!r} in {dump.file.name} holds {bad} NaN/Inf values"
            )
        return x.to(device)
