"""Deliberately wrong kernels, shipped to demonstrate the suite: each is the optimized path
(`optimized.OptimizedBackend`) with one stage method overridden the way a real bug sat in a real
kernel, so `moe-verify` has something to catch from any directory, with nothing but the package
installed (the README's examples name them as `moe_verify.examples:Class`). None of them is a
kernel to use.

- `SwappedExpertRows` (permute): two slots' rows trade places in the permuted buffer;
- `PaddingInfBleedsIntoTile` (gemm1): padding rows' overflow bleeds NaN into live rows of their
  tile (FlashInfer PR #3650), caught under `--poison-padding`;
- `NoFmaPromotion` (gemm1, gemm2): DeepGEMM's SM90 promotion done without the FMA, a few bf16
  outputs one ulp off, caught bit for bit under `--gemm-recipe tensor_core` and passed by the
  bounds; built on `Sm90Chain` (the SM90 chain as the hardware computes it, a correct backend)
  and `TensorCoreGemm` (its GEMMs by the golden's tensor-core model);
- `StaleCounts` (permute, production mode): the segments laid out with the previous call's
  counts, caught by `moe-verify graph` when a replay's routing changes.

Beside them, one module per contract form a kernel may take, each with a correct backend and a
wrong twin that fails where its docstring says: `columns` (gemm1 declared up-first), `fused`
(stages fused into one method), `masked` (the masked layout outside ep:N+ll).

The suite's own test-the-tester folder (tests/tester in the repository) holds many more, and
checks that every one of these fails where its docstring says.
"""

from __future__ import annotations

from moe_verify.examples.padding import PaddingInfBleedsIntoTile, accumulators
from moe_verify.examples.permute import SwappedExpertRows, row_view
from moe_verify.examples.stale_counts import StaleCounts
from moe_verify.examples.tensor_core import (
    NoFmaPromotion,
    Sm90Chain,
    TensorCoreGemm,
    table_gate_facts,
)

__all__ = [
    "NoFmaPromotion",
    "PaddingInfBleedsIntoTile",
    "Sm90Chain",
    "StaleCounts",
    "SwappedExpertRows",
    "TensorCoreGemm",
    "accumulators",
    "row_view",
    "table_gate_facts",
]
