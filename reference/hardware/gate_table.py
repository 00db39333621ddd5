"""act_quant's gate as the H200's compiled Triton computes it, read from a recorded table.

The Triton act_quant kernels compute glu = g / (1 + tl.exp(-alpha * g)) in fp32 with an
approximate exp and division: not IEEE arithmetic, but a function of one bf16 value g. Its value
for all 65,536 bf16 bit patterns was recorded on an H200 (moe_verify/hw_vectors.py
`record_gate_tables`) into reference/data/sm90_triton_gate.safetensors, one fp32 [65536] tensor
per alpha (entry i is the gate of the bf16 whose bits are i; tensors `gate_key(alpha)`), with the
GPU, triton, torch and deep_gemm versions and the date as the file's metadata. It equals torch's
fp32 g / (1 + exp(-alpha * g)) in 96.4% of entries (at most 53 fp32 ulps apart).

The file ships with the package and is read once per process.
"""

from __future__ import annotations

import functools
import math
from importlib import resources

import torch
from torch import Tensor

__all__ = [
    "GATE_FILE",
    "bf16_index",
    "every_bf16",
    "gate_from_table",
    "gate_key",
    "gate_table",
    "gate_table_provenance",
    "read_recorded",
    "tabulated_alphas",
]

GATE_FILE = "sm90_triton_gate.safetensors"
_ENTRIES = 1 << 16  # one per bf16 bit pattern


def gate_key(alpha: float) -> str:
    """The tensor name of alpha's table ('gate_alpha_1.702')."""
    if not math.isfinite(alpha):
        raise ValueError(f"alpha must be finite, got {alpha}")
    return f"gate_alpha_{alpha!r}"


def read_recorded(file: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tensors by name, metadata) of the recorded file reference/data/`file` in the package."""
    from safetensors import safe_open

    with resources.as_file(resources.files("reference") / "data" / file) as path:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


@functools.cache
def _load() -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tables by key, the file's metadata), read from the package once."""
    tables, metadata = read_recorded(GATE_FILE)
    for key, table in tables.items():
        if table.dtype != torch.float32 or tuple(table.shape) != (_ENTRIES,):
            raise ValueError(
                f"{GATE_FILE}: table {key!r} must be fp32 [{_ENTRIES}] (one entry per bf16 bit "
                f"pattern), got {table.dtype} {tuple(table.shape)}"
            )
    return tables, metadata


def gate_table(alpha: float) -> Tensor | None:
    """fp32 [65536] CPU: the recorded gate for every bf16 input at `alpha`, or None when no
    table was recorded for it (`tabulated_alphas`)."""
    return _load()[0].get(gate_key(float(alpha)))


def tabulated_alphas() -> tuple[float, ...]:
    """The alphas a table exists for (silu's 1.0, gpt-oss swigluoai's 1.702)."""
    return tuple(float(k.removeprefix("gate_alpha_")) for k in _load()[0])


def gate_table_provenance() -> dict[str, str]:
    """Where the table's bits come from: the file and its metadata (gpu, capability, cuda, torch,
    triton, deep_gemm, date)."""
    return {"file": f"reference/data/{GATE_FILE}", **_load()[1]}


def every_bf16(device: torch.device | str = "cpu") -> Tensor:
    """fp32 [65536]: entry i is the bf16 number whose bits are i (NaN patterns included), the
    inputs a recorded table holds in its order (`bf16_index` is the inverse)."""
    bits = torch.arange(_ENTRIES, dtype=torch.int32, device=device).to(torch.int16)
    return bits.view(torch.bfloat16).float()


def bf16_index(x: Tensor, what: str) -> Tensor:
    """int64 [...]: the bf16 bit pattern of each element of x (fp32 holding bf16 numbers), the
    index of its entry in a table recorded per bf16 input; anything else has no entry and is
    refused with its first position."""
    if x.dtype != torch.float32:
        raise ValueError(f"{what}: expected fp32 holding bf16 values, got {x.dtype}")
    as_bf16 = x.to(torch.bfloat16)
    off_grid = as_bf16.float().view(torch.int32) != x.view(torch.int32)
    if bool(off_grid.any()):
        at = tuple(int(i) for i in off_grid.nonzero()[0])
        raise ValueError(
            f"{what}: {int(off_grid.sum())} values are not bf16 numbers, first {float(x[at])} "
            f"at {at}: the recorded table holds bf16 inputs only"
        )
    return as_bf16.view(torch.int16).to(torch.int64) & (_ENTRIES - 1)


def gate_from_table(g: Tensor, table: Tensor) -> Tensor:
    """fp32 [...]: table[bits(g)], the recorded gate of each element of g.

    g: fp32 [...] whose values are all bf16 numbers (the kernels' gate input, the bf16 mm1 value
    after the clamp); anything else has no entry, and is refused with its first position (a clamp
    limit that is not a bf16 value moves a clamped fp32 gate off the grid).
    """
    return table.to(g.device)[bf16_index(g, "gate input")]
