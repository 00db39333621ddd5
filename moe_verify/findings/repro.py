"""`moe-verify repro`: a standalone reproduction of an engine kernel's bug, from a finding of the
registry or from a failing case's dump.

It writes two files into the output directory: `repro.py`, a copy of
moe_verify/findings/standalone.py (torch, safetensors and the engine; nothing of moe-verify), and
`inputs.safetensors`, the calls it makes, each with what it is about in the file's metadata. The
script calls the engine's public function on those inputs, computes the right answer in plain
torch, prints both where they differ and exits 1 while the bug is there (docs/repro.md).

What it knows how to call, by engine and stage:

| engine   | stage  | the kernel                                                          |
| -------- | ------ | ------------------------------------------------------------------- |
| vllm     | align  | vllm.model_executor.layers.fused_moe.utils.count_expert_num_tokens  |
| lmdeploy | gather | lmdeploy.pytorch.kernels.cuda.moe.ep.ep_gather                      |

Findings with a repro: 1 (vLLM's count by stale ids) and 6 (LMDeploy's bf16 gather).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe_verify.findings import standalone
from moe_verify.findings.registry import Finding, finding
from moe_verify.spec import Mode, MoEProblem, Stage, Trace

SCRIPT = "repro.py"
INPUTS = standalone.INPUTS
COUNT = "vllm.model_executor.layers.fused_moe.utils:count_expert_num_tokens"
GATHER = "lmdeploy.pytorch.kernels.cuda.moe.ep:ep_gather"


@dataclass(frozen=True)
class Call:
    """One call of the kernel: its tensors, the host parameters the check needs, and a line
    saying what it is about."""

    name: str
    about: str
    tensors: dict[str, torch.Tensor]
    params: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Repro:
    title: str
    check: str  # a key of standalone.CHECKS
    kernel: str  # module:function, the engine's public path
    calls: tuple[Call, ...]


def write(repro: Repro, out: Path) -> Path:
    """repro.py and inputs.safetensors in `out` (made if missing); the script's path."""
    out.mkdir(parents=True, exist_ok=True)
    about = {
        "title": repro.title,
        "check": repro.check,
        "kernel": repro.kernel,
        "calls": {c.name: {"about": c.about, **c.params} for c in repro.calls},
    }
    tensors = {f"{c.name}/{k}": v.cpu().clone() for c in repro.calls for k, v in c.tensors.items()}
    save_file(tensors, str(out / INPUTS), metadata={"repro": json.dumps(about)})
    script = out / SCRIPT
    script.write_text(Path(standalone.__file__).read_text())
    return script


# -- from a finding ------------------------------------------------------------------------------


def _title(f: Finding) -> str:
    return (
        f"moe-verify finding {f.id} ({f.engine_name}, seen in {', '.join(f.seen_in)}; "
        f"{', '.join(f.stages)}): {f.what}"
    )


def _stale_id_counts(f: Finding) -> Repro:
    """Finding 1 at align: rank 0 of ep:2 over 4 experts (map [0, 1, -1, -1]), 8 tokens of which
    4 are live and 4 are CUDA-graph padding rows holding stale ids. The map is a view of a
    5-element storage whose fifth element is 0, a local expert: an id one past the map reads it,
    the same on every run, and is counted for expert 0. The stale ids vLLM's own test uses read
    far past the map (under the interpreter a segfault)."""
    from moe_verify.production.graph import STALE_IDS

    storage = torch.tensor([0, 1, -1, -1, 0], dtype=torch.int32)
    live = [[0, 1], [2, 3], [1, 0], [3, 2]]  # experts 0 and 1 are local: two slots each

    def call(name: str, about: str, pad: list[int]) -> Call:
        ids = torch.tensor(live + [pad] * 4, dtype=torch.int32)
        params = {"num_local_experts": 2, "map_length": 4}
        return Call(name, about, {"topk_ids": ids, "expert_map_storage": storage}, params)

    past = storage.numel() - 1
    far = list(STALE_IDS)
    return Repro(
        _title(f),
        "count_expert_num_tokens",
        COUNT,
        (
            call(
                "one_past_the_map",
                f"ep:2 rank 0, expert map [0, 1, -1, -1]; rows 4-7 are padding holding id {past} "
                "(one past the map, whose next int32 in memory is 0)",
                [past, past],
            ),
            call(
                "stale_ids",
                f"the same rows 4-7 holding {far[0]} and {far[1]}, the stale ids of vLLM's "
                "tests/kernels/moe/test_expert_map_bounds.py",
                far,
            ),
        ),
    )


def _bf16_gather(f: Finding) -> Repro:
    """Finding 6: 8 tokens, 4 slots each (one slot -1), H = 1024 (ep_gather's BLOCK_D), each slot
    its own permuted row; seeded normal rows and softmax weights."""
    g = torch.Generator().manual_seed(f.id)
    tokens, k, hidden, experts = 8, 4, 1024, 4
    ids = torch.randint(0, experts, (tokens, k), generator=g)
    ids[0, -1] = -1  # a skipped slot
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    rows = torch.randn(tokens * k, hidden, generator=g).to(torch.bfloat16)
    inv = torch.arange(tokens * k).reshape(tokens, k)
    tensors = {"input": rows, "topk_ids": ids, "topk_weights": weights, "inv_perm": inv}
    about = f"{tokens} tokens x {k} slots over {experts} local experts, H = {hidden}, token 0's "
    about += "last slot -1"
    return Repro(_title(f), "ep_gather", GATHER, (Call("gather", about, tensors),))


FROM_FINDING: dict[int, Callable[[Finding], Repro]] = {1: _stale_id_counts, 6: _bf16_gather}


def from_finding(finding_id: int) -> Repro:
    f = finding(finding_id)
    if f.id not in FROM_FINDING:
        known = ", ".join(str(i) for i in FROM_FINDING)
        raise ValueError(
            f"no repro for finding {f.id} ({f.engine_name} {', '.join(f.stages)}) yet; findings "
            f"with one: {known}"
        )
    return FROM_FINDING[f.id](f)


# -- from a dump ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dumped:
    """What a dump's failing stage was handed: the problem, the rank, the mode and the trace its
    upstream came from (the golden's in isolated mode, the tested side's own in chained)."""

    problem: MoEProblem
    rank: int
    mode: str
    upstream: Trace
    case: str


def _align_counts(d: Dumped) -> Repro:
    """vLLM's align as the adapter calls it: count_expert_num_tokens(route ids, E_l, map)."""
    from optimized.topology import build_expert_map, hosted_experts

    ids = d.upstream["route"]["topk_ids"]
    emap = build_expert_map(d.problem, d.rank, torch.device("cpu"))
    tensors = {"topk_ids": ids}
    params = {"num_local_experts": len(hosted_experts(d.problem, d.rank))}
    if emap is not None:
        tensors["expert_map_storage"] = emap
        params["map_length"] = emap.numel()
    title = f"vLLM align on dumped case {d.case}, rank {d.rank} ({d.mode}): count_expert_num_tokens"
    about = f"the route's topk_ids {tuple(ids.shape)} as the {d.mode} run handed them to align"
    return Repro(title, "count_expert_num_tokens", COUNT, (Call("align", about, tensors, params),))


def _gather_sum(d: Dumped) -> Repro:
    """LMDeploy's gather as the adapter calls it: ep_gather(mm2, local ids, weights, inv_perm)."""
    from moe_verify.adapters.lmdeploy import local_ids
    from optimized.topology import build_expert_map

    route = d.upstream["route"]
    emap = build_expert_map(d.problem, d.rank, torch.device("cpu"))
    tensors = {
        "input": d.upstream["gemm2"]["mm2"],
        "topk_ids": local_ids(route["topk_ids"], emap),
        "topk_weights": route["topk_weights"],
        "inv_perm": d.upstream["permute"]["inv_perm"],
    }
    title = f"LMDeploy gather on dumped case {d.case}, rank {d.rank} ({d.mode}): ep_gather"
    about = f"gemm2's rows, the route and the permute's inv_perm as the {d.mode} run handed them"
    return Repro(title, "ep_gather", GATHER, (Call("gather", about, tensors),))


FROM_DUMP: dict[tuple[str, Stage], Callable[[Dumped], Repro]] = {
    ("vllm", Stage.ALIGN): _align_counts,
    ("lmdeploy", Stage.GATHER): _gather_sum,
}


def supported() -> str:
    return "; ".join(f"{engine} {stage}" for engine, stage in FROM_DUMP)


def from_dump(directory: Path) -> Repro:
    """The repro of a dumped case's first failing stage (a dump of `run --backend <engine>`)."""
    from moe_verify.common.safe_io import read_json
    from moe_verify.run.dump import RUN_FILE, case_directory, load_case, load_trace
    from tolerance.report import Report

    case = load_case(directory, device="cpu")
    engine = case.options.backend if case.options is not None else None
    if not isinstance(engine, str) or engine not in {e for e, _ in FROM_DUMP}:
        made = f"--backend {engine}" if engine else f"no backend recorded ({RUN_FILE})"
        raise ValueError(
            f"repro --dump: {case.path} was made with {made}; the repro calls an engine's kernel "
            f"and knows {supported()}: dump a `moe-verify run --backend <engine>` case"
        )
    root, name = case_directory(directory)
    report = Report.from_dict(read_json(root, f"{name}/report.json"))
    first = report.first_failing_result
    if first is None:
        raise ValueError(f"repro --dump: {case.path}'s report has no failing stage")
    mode = str(report.first_failing_mode)
    rank = first.rank or 0
    writer = FROM_DUMP.get((engine, Stage(first.stage)))
    if writer is None:
        raise ValueError(
            f"repro --dump: the first failing stage of {case.path} is {engine}'s {first.stage} "
            f"(rank {rank}, {mode} mode); the repro knows how to call {supported()}"
        )
    side = "golden" if mode == Mode.ISOLATED else mode
    upstream = load_trace(case.path / f"{side}_r{rank}.safetensors")
    return writer(Dumped(case.problem, rank, mode, upstream, case.problem.id))
