"""Other engines' approximate fp32 steps on the H200, read from recorded tables.

Two engines quantize with codes x * (448 / amax) where the quotient is not the IEEE one:
LMDeploy 0.18's Triton `_quant_fp8_kernel` writes `fp8_max / a_max`, which Triton compiles to
div.full.f32 (an approximation within 2 ulps), and SGLang 0.5.23's JIT CUDA quantizer
(per_token_group_quant.cuh) writes `kMaxValue / amax` under nvcc's `--use_fast_math`. SGLang's
silu_and_mul (activation.cuh, also `--use_fast_math`) computes silu as `v / (1 + expf(-v))`
with the approximate exp and division. Each is a function of one fp32 value that is a bf16
number (amax of bf16 inputs, the bf16 gate) or one of the quantizers' amax floors (`FLOORS`),
so its value for every such input was recorded on an H200 (moe_verify/hw_vectors.py
`record_quotient_tables`) into reference/data/sm90_quotient.safetensors: one fp32 [65536 + 2]
tensor per name in `TABLES`, entry i < 65536 for the bf16 whose bits are i, entry 65536 + j for
`FLOORS[j]`, with the GPU, nvcc, triton and torch versions as the file's metadata.

The file ships with the package and is read once per process.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from reference.hardware.gate_table import bf16_index, read_recorded

__all__ = [
    "FLOORS",
    "QUOTIENT_FILE",
    "TABLES",
    "bf16_entries",
    "quotient_table_provenance",
    "table_value",
]

QUOTIENT_FILE = "sm90_quotient.safetensors"
# The amax floors the two quantizers apply before dividing (as fp32): LMDeploy's
# `tl.maximum(a_max, 1e-6)`, SGLang's `max(..., 1e-10f)` (reference/formats.py applies them).
# Neither is a bf16 number, so each has an entry of its own.
FLOORS = (1e-6, 1e-10)
TABLES = ("quotient_448_triton", "quotient_448_cuda_fast_math", "silu_cuda_fast_math")
_BF16_ENTRIES = 1 << 16


@functools.cache
def _load() -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tables by name, the file's metadata), read from the package once."""
    tables, metadata = read_recorded(QUOTIENT_FILE)
    floors = tables.pop("floors", None)
    expected = torch.tensor(FLOORS, dtype=torch.float32)
    if floors is None or not torch.equal(floors, expected):
        raise ValueError(f"{QUOTIENT_FILE}: its floors must be fp32 {FLOORS}, got {floors}")
    entries = _BF16_ENTRIES + len(FLOORS)
    for name in TABLES:
        table = tables.get(name)
        if table is None or table.dtype != torch.float32 or tuple(table.shape) != (entries,):
            got = "nothing" if table is None else f"{table.dtype} {tuple(table.shape)}"
            raise ValueError(
                f"{QUOTIENT_FILE}: table {name!r} must be fp32 [{entries}] (every bf16 bit "
                f"pattern, then each floor), got {got}"
            )
    return tables, metadata


def quotient_table_provenance() -> dict[str, str]:
    """Where the tables' bits come from: the file and its metadata (gpu, capability, cuda, nvcc,
    torch, triton, date)."""
    return {"file": f"reference/data/{QUOTIENT_FILE}", **_load()[1]}


def table_value(name: str, v: Tensor) -> Tensor:
    """fp32 [...]: the recorded value of table `name` at each element of v.

    v: fp32 [...] whose values are bf16 numbers or one of `FLOORS` (as fp32); anything else has
    no entry and is refused with its first position."""
    if name not in TABLES:
        raise ValueError(f"no recorded table {name!r}; tables: {list(TABLES)}")
    if v.dtype != torch.float32:
        raise ValueError(f"{name}: expected fp32 input, got {v.dtype}")
    table = _load()[0][name].to(v.device)
    index = torch.zeros(v.shape, dtype=torch.int64, device=v.device)
    on_floor = torch.zeros(v.shape, dtype=torch.bool, device=v.device)
    for j, floor in enumerate(FLOORS):
        hit = v == torch.tensor(floor, dtype=torch.float32, device=v.device)
        index[hit] = _BF16_ENTRIES + j
        on_floor |= hit
    rest = ~on_floor
    index[rest] = bf16_index(v[rest], f"{name} input")
    return table[index]


def bf16_entries(name: str) -> Tensor:
    """fp32 [65536]: table `name` at every bf16 bit pattern (a gate table, as
    reference/activation.py `swiglu` reads one)."""
    if name not in TABLES:
        raise ValueError(f"no recorded table {name!r}; tables: {list(TABLES)}")
    return _load()[0][name][:_BF16_ENTRIES]
