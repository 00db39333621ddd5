"""Dumps of a failing case (safetensors, never pickle) and `replay` from a dump.

A dump directory holds one directory per failing case, named by the case id:
  problem.json            the MoEProblem (MoEProblem.from_dict reads it back)
  run.json                how it was run: RunOptions.to_dict() (moe_verify/run/options.py), the
                          backend as the spec verify() got ("optimized", "module:Class", the
                          module:Class of a Backend class or instance); absent in older dumps
                          and when the dumping caller did not say. A run.json of an older
                          version (backend, engine, mode, workspace, poison, padding_poison,
                          gemm_recipe) reads with the other options at their defaults.
  report.json             the report that failed
  inputs.safetensors      every MoEInputs tensor, keyed by field (QuantizedWeight as field.q/.scale)
  <side>_r<rank>.safetensors  each trace (golden, isolated, chained; golden_sm90_chain, the
                          golden a chained run was held to bit for bit, where there was one),
                          keyed "stage/name"; host values (M_sum, engine, skip reasons) in the
                          file's metadata

A dump is read as untrusted input (it may come from anyone's bug report): every file through
moe_verify.common.safe_io, so a bad one is a ValueError naming it, never a hang or a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moe_verify.common.safe_io import UntrustedFileError, load_safetensors, read_json, safe_file
from moe_verify.run.options import RunOptions
from moe_verify.run.runner import RankRun
from moe_verify.spec import MoEInputs, MoEProblem, QuantizedWeight, Trace
from tolerance.report import Report

# A case directory is one holding this file.
PROBLEM_FILE = "problem.json"
RUN_FILE = "run.json"
INPUTS_FILE = "inputs.safetensors"


@dataclass(frozen=True)
class DumpedCase:
    """A dumped case read back: what `replay` needs to re-run it bit for bit."""

    problem: MoEProblem
    inputs: MoEInputs
    path: Path  # the case directory
    options: RunOptions | None  # how it was run; None: an older dump that did not record it


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


# MoEInputs fields a dump must hold (the others may be None).
_REQUIRED = frozenset(
    name
    for name, hint in typing.get_type_hints(MoEInputs).items()
    if type(None) not in typing.get_args(hint)
)


def _inputs_from_tensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, str],
    device: torch.device | str,
) -> MoEInputs:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(MoEInputs):
        if f.name in tensors:
            values[f.name] = tensors[f.name].to(device)
        elif f"{f.name}.q" in tensors:
            values[f.name] = QuantizedWeight(
                tensors[f"{f.name}.q"].to(device),
                _tensor(path, tensors, f"{f.name}.scale").to(device),
                _block(path, meta, f"{f.name}.block"),
            )
        elif f.name in _REQUIRED:
            raise UntrustedFileError(f"{path}: holds no tensor {f.name!r} (a MoEInputs field)")
        else:
            values[f.name] = None
    return MoEInputs(**values)


def _tensor(path: Path, tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise UntrustedFileError(f"{path}: holds no tensor {key!r}")
    return tensors[key]


def _block(path: Path, meta: dict[str, str], key: str) -> tuple[int, int]:
    """A QuantizedWeight's scale block from the file's metadata: [rows, K elements]."""
    try:
        block = json.loads(meta[key])
    except (KeyError, json.JSONDecodeError, RecursionError):
        block = meta.get(key)
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise UntrustedFileError(
            f"{path}: metadata {key!r} must be a JSON [rows, columns] of positive ints, "
            f"got {block!r:.80}"
        )
    return block[0], block[1]


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
    """A trace save_trace wrote, read as untrusted input (only files beside it are followed)."""
    path = Path(path)
    tensors, meta = load_safetensors(path.parent, path.name)
    try:
        host = json.loads(meta.get("host", "{}"))
        order = json.loads(meta.get("order", "[]"))
        rank = int(meta.get("rank", "0"))
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise UntrustedFileError(f"{path}: metadata host/order/rank unreadable: {exc}") from None
    if not isinstance(host, dict) or not isinstance(order, list):
        raise UntrustedFileError(
            f"{path}: metadata 'host' must be a JSON object and 'order' a list of stages"
        )
    stages: dict[str, dict[str, object]] = {}
    for key, value in [*tensors.items(), *host.items()]:
        stage, _, name = key.partition("/")
        stages.setdefault(stage, {})[name] = value
    unknown = [s for s in order if s not in stages]
    if unknown:
        raise UntrustedFileError(
            f"{path}: metadata 'order' names stages it holds none of: {unknown}"
        )
    trace = Trace(meta.get("backend", "?"), rank)
    for stage in order or list(stages):
        trace.add(stage, stages[stage])
    return trace


def dump_case(
    directory: Path,
    problem: MoEProblem,
    inputs: MoEInputs,
    runs: list[RankRun],
    report: Report,
    options: RunOptions | None = None,
) -> Path:
    """Write everything needed to reproduce and inspect a failing case, with how it was run
    (`options`); the case directory."""
    out = dump_header(directory, problem, inputs, report, options)
    for run in runs:
        sides = {"golden": run.golden, "golden_sm90_chain": run.chained_golden, **run.tested}
        dump_rank_traces(out, run.rank, sides)
    return out


def dump_header(
    directory: Path,
    problem: MoEProblem,
    inputs: MoEInputs,
    report: Report,
    options: RunOptions | None = None,
) -> Path:
    """The case directory with problem.json, report.json, inputs.safetensors and, given the
    `options`, run.json (how to run it again: see the module docstring); its path."""
    out = Path(directory) / problem.id
    out.mkdir(parents=True, exist_ok=True)
    (out / PROBLEM_FILE).write_text(json.dumps(problem.to_dict(), indent=2))
    if options is not None:  # without them a replay needs --backend, as for an older dump
        (out / RUN_FILE).write_text(json.dumps(options.to_dict(), indent=2))
    (out / "report.json").write_text(report.to_json())
    tensors, meta = _inputs_to_tensors(inputs)
    save_file(tensors, str(out / INPUTS_FILE), metadata=meta)
    return out


def dump_rank_traces(out: Path, rank: int, sides: dict[str, Trace | None]) -> None:
    """One rank's traces as <side>_r<rank>.safetensors (each torchrun rank writes its own)."""
    out.mkdir(parents=True, exist_ok=True)
    for side, trace in sides.items():
        if trace is not None:
            save_trace(trace, out / f"{side}_r{rank}.safetensors")


def case_directory(directory: Path) -> tuple[Path, str]:
    """(the directory files are read under, the case's path relative to it): `directory` itself
    when it is a case, else its one case subdirectory. A directory of several cases (a sweep's)
    is refused with their names, so the user picks one."""
    root = Path(directory).resolve()  # the path the user named is trusted; what it holds is not
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise ValueError(f"dump: {directory} {what} (expected a moe-verify dump directory)")
    if os.path.lexists(root / PROBLEM_FILE):
        return root, "."
    cases = sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.is_symlink() and os.path.lexists(p / PROBLEM_FILE)
    )
    if not cases:
        raise ValueError(
            f"dump: {directory} has no {PROBLEM_FILE} and no case directory holding one "
            "(is it a moe-verify dump?)"
        )
    if len(cases) > 1:
        raise ValueError(
            f"dump directory {directory} holds {len(cases)} cases: {', '.join(cases)}; "
            "pass one of them"
        )
    return root, cases[0]


def load_case(directory: Path, device: torch.device | str | None = None) -> DumpedCase:
    """The case dumped in `directory` (the case directory, or a dump directory holding exactly
    one case), its inputs on `device`, every file read as untrusted input."""
    from moe_verify.common.device import default_device

    root, case = case_directory(directory)
    problem_path = safe_file(root, f"{case}/{PROBLEM_FILE}")
    data = read_json(root, f"{case}/{PROBLEM_FILE}")
    if not isinstance(data, dict):
        raise UntrustedFileError(f"{problem_path}: expected a JSON object (a MoEProblem)")
    try:
        problem = MoEProblem.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        why = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise UntrustedFileError(f"{problem_path}: not a valid MoEProblem ({why})") from None
    options = _read_run(root, case)
    inputs_path = safe_file(root, f"{case}/{INPUTS_FILE}")
    tensors, meta = load_safetensors(root, inputs_path)
    inputs = _inputs_from_tensors(inputs_path, tensors, meta, device or default_device())
    return DumpedCase(problem, inputs, root / case, options)


def _read_run(root: Path, case: str) -> RunOptions | None:
    """run.json as RunOptions, read as untrusted input; None for an older dump without one."""
    name = f"{case}/{RUN_FILE}"
    if not os.path.lexists(root / name):
        return None
    run = read_json(root, name)
    path = safe_file(root, name)
    try:
        return RunOptions.from_dict(run)
    except (TypeError, ValueError) as exc:
        raise UntrustedFileError(f"{path}: {exc}") from None
