"""vLLM's installed kernels under `moe-verify graph`: the same adapter class `run` verifies, run
through the production op with routing that changes between replays (on a CPU each replay is an
eager op call on the graph's static buffers, vLLM's Triton kernels under the interpreter).

Full replays pass, in both grouped layouts. A replay with CUDA-graph padding rows (fewer live
tokens than the bound, stale positive ids planted in the padding as vLLM's
tests/kernels/moe/test_expert_map_bounds.py does) is a finding: under EP, vLLM 0.32's
`_count_expert_num_tokens` (vllm/model_executor/layers/fused_moe/utils.py) masks its
`expert_map + expert_ids` load by `expert_ids >= 0` only, so id 123456789 reads far past the
expert map; without an expert map `_fwd_kernel_ep_scatter_2`
(fused_moe/deep_gemm_utils.py) bounds its `atomic_add(expert_start_loc + expert_id, 1)` the same
way. Under the interpreter those accesses are segfaults, in align (EP) and permute (TP), which the
contained graph reports with their replay, rank and stage (docs/implementations.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_verify.cli import main

pytestmark = pytest.mark.vllm

# A = 128 is DeepGEMM's contiguous-layout BLOCK_M, the one vLLM pads to.
TINY = ["-T", "16", "-H", "256", "-I", "256", "-E", "4", "-k", "2", "--alignment", "128"]


def graph_args(backend: str = "vllm") -> list[str]:
    return ["graph", *TINY, "--engine", "triton", "--backend", backend]


GRAPH = graph_args()


@pytest.mark.parametrize(
    "flags",
    [
        ["--topology", "tp:1"],  # no expert map
        ["--topology", "ep:2", "--grouped-layout", "m_indices"],  # an expert map, per-row layout
        ["--topology", "ep:2", "--grouped-layout", "psum"],  # expert_ends, vLLM 0.32's SM90 one
    ],
    ids=["tp1", "ep2-m_indices", "ep2-psum"],
)
def test_vllm_passes_full_replays_under_graph(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*GRAPH, *flags, "--replays", "skew,empty-middle"]) == 0
    out = capsys.readouterr().out
    assert "backend vllm" in out and "PASS: 3 of 3 replays agree with the golden" in out, out
    assert "NOT GRAPH-SAFE" not in out


# (topology, the vLLM stage that indexes by the stale id first)
STALE_ID_READS = [
    ("ep:2", "align"),  # _count_expert_num_tokens: expert_map + id, masked by id >= 0 only
    ("tp:1", "permute"),  # _fwd_kernel_ep_scatter_2: atomic_add(expert_start_loc + id), id >= 0
]


def half_live_replay(topology: str, json_path: Path, backend: str = "vllm") -> tuple[int, dict]:
    """`moe-verify graph --replays half-live` of `backend` (the capture, then 8 live rows and 8
    padding rows of stale ids): its exit code and its JSON report (the crash form names the
    replay, rank and stage in flight). Finding 1's check (test_vllm_findings.py) runs it too."""
    flags = ["--topology", topology, "--replays", "half-live", "--json", str(json_path)]
    return main([*graph_args(backend), *flags]), json.loads(json_path.read_text())


@pytest.mark.parametrize(("topology", "stage"), STALE_ID_READS, ids=[t for t, _ in STALE_ID_READS])
def test_vllm_indexes_by_stale_padding_ids(
    topology: str, stage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, report = half_live_replay(topology, tmp_path / "graph.json")
    assert rc == 1
    out = capsys.readouterr().out
    assert "CRASH graph" in out and "killed by SIGSEGV" in out, out
    assert report["at"] == {
        "case": report["case"],
        "replay": "half-live",
        "rank": 0,
        "stage": stage,
    }, report
