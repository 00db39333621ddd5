"""Dumps of a failing case (safetensors, never pickle) and `replay` from a dump.

A dump directory holds:
  problem.json            the MoEProblem (MoEProblem.from_dict reads it back)
  report.json             the report that failed
  inputs.safetensors      every MoEInputs tensor, keyed by field (QuantizedWeight as field.q/.scale)
  <side>_r<rank>.safetensors  each trace (golden, isolated, chained), keyed "stage/name"; host
                          values (M_sum, engine, skip reasons) in the file's metadata
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from moe_verify.runner import RankRun
from moe_verify.spec import MoEInputs, MoEProblem, QuantizedWeight, Trace
from tolerance.report import Report


def _inputs_to_tensors(inputs: MoEInputs) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    for f in dataclasses.fields(inputs):
        value = getattr(inputs, f.name)
        if isinstance(value, torch.Tensor):
            tensors[f.name] = value.contiguous().cpu()
        elif isinstance(value, QuantizedWeight):
            tensors[f"{f.name}.q"] = value.q.contiguous().cpu()
            tensors[f"{f.name}.scale"] = value.scale.contiguous().cpu()
            meta[f"{f.name}.block"] = json.dumps(list(value.block))
    return tensors, meta


def _inputs_from_tensors(
    tensors: dict[str, torch.Tensor], meta: dict[str, str], device: torch.device | str
) -> MoEInputs:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(MoEInputs):
        if f.name in tensors:
            values[f.name] = tensors[f.name].to(device)
        elif f"{f.name}.q" in tensors:
            block = tuple(json.loads(meta[f"{f.name}.block"]))
            values[f.name] = QuantizedWeight(
                tensors[f"{f.name}.q"].to(device), tensors[f"{f.name}.scale"].to(device), block
            )
        else:
            values[f.name] = None
    return MoEInputs(**values)


def save_trace(trace: Trace, path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    host: dict[str, object] = {}
    for stage, outputs in trace.items():
        for name, value in outputs.items():
            key = f"{stage}/{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value.contiguous().cpu()  # strided layouts saved by logical view
            else:
                host[key] = value
    metadata = {
        "host": json.dumps(host, default=str),
        "order": json.dumps(trace.stages),
        "backend": trace.backend,
        "rank": str(trace.rank),
    }
    save_file(tensors, str(path), metadata=metadata)


def load_trace(path: Path) -> Trace:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    tensors = load_file(str(path))
    host = json.loads(meta.get("host", "{}"))
    stages: dict[str, dict[str, object]] = {}
    for key, value in [*tensors.items(), *host.items()]:
        stage, _, name = key.partition("/")
        stages.setdefault(stage, {})[name] = value
    trace = Trace(meta.get("backend", "?"), int(meta.get("rank", "0")))
    order = json.loads(meta.get("order", "[]")) or list(stages)
    for stage in order:
        trace.add(stage, stages[stage])
    return trace


def dump_case(
    directory: Path, problem: MoEProblem, inputs: MoEInputs, runs: list[RankRun], report: Report
) -> Path:
    """Write everything needed to reproduce and inspect a failing case."""
    out = dump_header(directory, problem, inputs, report)
    for run in runs:
        dump_rank_traces(out, run.rank, {"golden": run.golden, **run.tested})
    return out


def dump_header(directory: Path, problem: MoEProblem, inputs: MoEInputs, report: Report) -> Path:
    """The case directory with problem.json, report.json and inputs.safetensors; its path."""
    out = Path(directory) / problem.id
    out.mkdir(parents=True, exist_ok=True)
    (out / "problem.json").write_text(json.dumps(problem.to_dict(), indent=2))
    (out / "report.json").write_text(report.to_json())
    tensors, meta = _inputs_to_tensors(inputs)
    save_file(tensors, str(out / "inputs.safetensors"), metadata=meta)
    return out


def dump_rank_traces(out: Path, rank: int, sides: dict[str, Trace | None]) -> None:
    """One rank's traces as <side>_r<rank>.safetensors (each torchrun rank writes its own)."""
    out.mkdir(parents=True, exist_ok=True)
    for side, trace in sides.items():
        if trace is not None:
            save_trace(trace, out / f"{side}_r{rank}.safetensors")


def load_case(
    directory: Path, device: torch.device | str | None = None
) -> tuple[MoEProblem, MoEInputs]:
    from safetensors import safe_open

    from moe_verify.device import default_device

    directory = Path(directory)
    if not (directory / "problem.json").exists():
        raise ValueError(f"dump: {directory} has no problem.json (is it a moe-verify dump?)")
    problem = MoEProblem.from_dict(json.loads((directory / "problem.json").read_text()))
    path = directory / "inputs.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    inputs = _inputs_from_tensors(load_file(str(path)), meta, device or default_device())
    return problem, inputs
