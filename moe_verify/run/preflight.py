"""Memory pre-flight: refuse a case that cannot fit on its device before anything is allocated.

A case too large for the device used to fail deep inside make_inputs or a stage with a bare CUDA
out-of-memory error (or, on the CPU, be killed by the OOM killer with no report at all).
`preflight(problem, device)` estimates the bytes the case needs from its shapes alone and raises
`DoesNotFit` (a ValueError, so the CLI reports it as bad input) naming the largest tensor, the
estimate and what the device has free.

The estimate is deliberately generous (it should refuse only cases that truly cannot run): it
counts, at their largest,
- the inputs `make_inputs` returns (master bf16 weights, quantized weights and their scales, the
  checkpoint copy kept for UE8M0 requantization, shared experts), plus the fp32 chunk temporaries
  it quantizes through;
- one rank's weight shards, once for the golden and once for the tested backend;
- three traces of one rank (the golden's, the tested backend's chained and isolated ones), each
  with every stage output sized for the largest legitimate M_sum; a fourth for the fp8_block
  recipe with SM90 scales, whose chained run may be held to the golden's SM90 chain, and for it
  the GEMM outputs of the tensor-core recipe beside the fp32 ones (the isolated golden's too);
- the golden's fp32 temporaries (dequantized activations and one expert's weight, the activation's
  fp32 halves);
- comparison temporaries: four fp32 copies of the largest stage tensor;
- the per-rank partial outputs the cross-rank reduce keeps, for every rank of the three traces.
Ranks run one after another in one process, so only one rank's intermediates count.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from moe_verify.spec import (
    MoEProblem,
    Placement,
    Recipe,
    ScaleFmt,
    Stage,
    TopologyKind,
    ceil_div,
    round_up,
)

_FP32, _BF16, _FP8 = 4, 2, 1
# Golden, tested chained, tested isolated: the traces one rank holds at once.
_TRACES = 3
# Upcast copies a stage comparison makes of the largest stage tensor (both sides, diff, mask).
_COMPARE_COPIES = 4
# make_inputs quantizes weights in chunks of this many elements (moe_verify/run/inputs.py), through
# about this many fp32 temporaries of a chunk (w.float(), the padded blocks, the scaled copy, the
# dequantized one of a UE8M0 requantization).
_QUANT_CHUNK_ELEMENTS = 1 << 28
_QUANT_TEMPORARIES = 4


class DoesNotFit(ValueError):
    """The case's memory estimate exceeds what its device has free."""


@dataclass(frozen=True)
class Item:
    """One tensor of the estimate: `copies` tensors of `shape`, `itemsize` bytes per element."""

    name: str
    shape: tuple[int, ...]
    itemsize: float
    copies: int = 1

    @property
    def bytes_each(self) -> int:
        return math.ceil(math.prod(self.shape) * self.itemsize)

    @property
    def bytes(self) -> int:
        return self.bytes_each * self.copies


@dataclass(frozen=True)
class Estimate:
    """Every tensor counted for one case; `total` bytes."""

    items: tuple[Item, ...]

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def largest(self) -> Item:
        return max(self.items, key=lambda i: i.bytes_each)


def _local_experts(p: MoEProblem) -> int:
    """The most experts one rank holds."""
    topo = p.topology
    if topo.kind is TopologyKind.TP:
        return p.num_experts
    if topo.placement is Placement.EXPLICIT:
        return max(len(r) for r in topo.explicit or ((),))
    return ceil_div(p.num_experts, topo.size)


def _max_m_sum(p: MoEProblem, e_l: int) -> int:
    """Rows of one rank's expert-contiguous buffer at their largest: the loosest legitimate M_sum
    (every local expert charged A-1 rows), or the ep+ll batches."""
    if p.batched:
        return e_l * p.ll_max_tokens
    rows = p.tokens * p.topk + e_l * (p.alignment - 1)
    return round_up(rows, p.alignment)


def _weight_items(prefix: str, p: MoEProblem, e: int, n: int, k: int, copies: int) -> list[Item]:
    """The quantized weight stack [e, n, k] the kernel sees: codes and scales."""
    if p.recipe is Recipe.FP8_BLOCK:
        scale = Item(f"{prefix}.scale", (e, ceil_div(n, 128), ceil_div(k, 128)), _FP32, copies)
    else:
        scale = Item(f"{prefix}.scale", (e, n, k // 32), 1, copies)
    code = 0.5 if p.recipe is Recipe.MXFP4_W4A8 else _FP8
    return [Item(f"{prefix}.q", (e, n, k), code, copies), scale]


def estimate(problem: MoEProblem) -> Estimate:
    """The bytes `problem` needs on its device, item by item (see the module docstring)."""
    p = problem
    t, h, i, e = p.tokens, p.hidden, p.intermediate_per_rank, p.num_experts
    i_full = p.intermediate
    group = p.recipe.act_group
    ckpt = 2 if p.recipe is Recipe.FP8_BLOCK and p.scale_fmt.is_ue8m0 else 1
    items = [
        Item("inputs.hidden_states", (t, h), _BF16),
        Item("inputs.router_logits", (t, e), _FP32),
        Item("inputs.w13", (e, 2 * i_full, h), _BF16),
        Item("inputs.w2", (e, h, i_full), _BF16),
        *_weight_items("inputs.w13_q", p, e, 2 * i_full, h, ckpt),
        *_weight_items("inputs.w2_q", p, e, h, i_full, ckpt),
        Item(
            "make_inputs quantization chunk (fp32)",
            (min(_QUANT_CHUNK_ELEMENTS, max(1, 2 * i_full * h) * e),),
            _FP32,
            _QUANT_TEMPORARIES,
        ),
    ]
    if p.shared_experts:
        i_s = i_full * p.shared_experts
        items += [
            Item("shared expert draw (fp32)", (2 * i_s, h), _FP32, 2),
            *_weight_items("inputs.shared_w13", p, 1, 2 * i_s, h, 1),
            *_weight_items("inputs.shared_w2", p, 1, h, i_s, 1),
        ]
    e_l = _local_experts(p)
    # Two sides shard the weights: the golden and the tested backend.
    items += _weight_items("rank weight shard w13", p, e_l, 2 * i, h, 2)
    items += _weight_items("rank weight shard w2", p, e_l, h, i, 2)

    m = _max_m_sum(p, e_l)
    sm90 = p.recipe is Recipe.FP8_BLOCK and p.scale_fmt is not ScaleFmt.UE8M0_PACKED
    traces = _TRACES + 1 if sm90 else _TRACES
    stages = [
        Item(f"{Stage.QUANT_INPUT} a1q", (t, h), _FP8 + _FP32 / group, traces),
        Item(f"{Stage.PERMUTE} a1q", (m, h), _FP8 + _FP32 / group, traces),
        Item(f"{Stage.GEMM1} out (bf16)", (m, 2 * i), _BF16, traces),
        Item(f"{Stage.ACT_QUANT} a2q", (m, i), _FP8 + _FP32 / group, traces),
        Item(f"{Stage.GEMM2} out (bf16)", (m, h), _BF16, traces),
        Item(f"{Stage.GATHER} out", (t, h), _FP32, traces),
    ]
    if p.shared_experts:
        stages.append(Item(f"{Stage.SHARED} out", (t, h), _FP32, traces))
    items += stages
    if sm90:  # the tensor-core mm1 / mm2 beside the fp32 ones, in two goldens
        items += [
            Item(f"{Stage.GEMM1} tensor-core out (bf16)", (m, 2 * i), _BF16, 2),
            Item(f"{Stage.GEMM2} tensor-core out (bf16)", (m, h), _BF16, 2),
        ]
    items += [
        Item("golden gemm1 dequantized a1q (fp32)", (m, h), _FP32),
        Item("golden gemm1 one expert's weight (fp32)", (2 * i, h), _FP32),
        Item("golden act_quant gate and up (fp32)", (m, 2 * i), _FP32, 2),
        Item("golden gemm2 dequantized a2q (fp32)", (m, i), _FP32),
    ]
    widest = max(stages, key=lambda s: math.prod(s.shape))
    items.append(
        Item(
            f"comparison temporaries of {widest.name} (fp32)", widest.shape, _FP32, _COMPARE_COPIES
        )
    )
    items.append(
        Item("per-rank partial outputs for the reduce", (t, h), _FP32, traces * p.topology.size)
    )
    return Estimate(tuple(items))


def free_bytes(device: torch.device | str) -> int | None:
    """Bytes free on `device`: the CUDA allocator's view on a GPU, MemAvailable on the CPU
    (/proc/meminfo, else the free physical pages); None for a device whose memory is unknown."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        # Memory the caching allocator holds but does not use is free to this process too.
        reserved = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return int(free + reserved)
    if dev.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def preflight(problem: MoEProblem, device: torch.device | str) -> None:
    """Raise `DoesNotFit` when `problem`'s estimate exceeds the free memory of `device`.

    A device whose free memory cannot be read (neither CUDA nor the CPU, e.g. "meta") is not
    checked.
    """
    if not isinstance(problem, MoEProblem):
        raise TypeError(f"preflight: problem: expected a MoEProblem, got {type(problem).__name__}")
    if not isinstance(device, (torch.device, str)):
        raise TypeError(
            f"preflight: device: expected a torch.device or a string, got {device!r} "
            f"({type(device).__name__})"
        )
    est = estimate(problem)
    free = free_bytes(device)
    if free is None or est.total <= free:
        return
    big = est.largest
    raise DoesNotFit(
        f"preflight: {problem.id} needs about {_gib(est.total)} on {device} "
        f"({est.total} bytes, a generous estimate: moe_verify/run/preflight.py), but only "
        f"{_gib(free)} ({free} bytes) is free. The largest tensor is {big.name} of shape "
        f"{list(big.shape)} ({_gib(big.bytes_each)}, {big.bytes_each} bytes"
        f"{f' each, {big.copies} copies' if big.copies > 1 else ''}); use fewer tokens, experts "
        "or a smaller hidden/intermediate size, or a device with more memory"
    )
