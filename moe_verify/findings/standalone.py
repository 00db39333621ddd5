"""A standalone reproduction of an engine kernel's bug, written by `moe-verify repro`.

It needs torch, safetensors and the engine, nothing of moe-verify: the inputs are in
inputs.safetensors beside this file (their metadata says what each call is), the kernel is the
engine's public function, and the check is computed here in plain torch. Each call runs in a
child process, so a kernel that reads or writes out of bounds and crashes is reported as the bug
rather than ending the run. The children are forked without a GPU and spawned (a fresh
interpreter that imports the kernel itself) with one: CUDA cannot be used in a forked child once
the parent has initialized it, as importing an engine does.

    python repro.py                     # the engine's kernel
    python repro.py --kernel pkg.mod:fn # another function of the same signature (a fixed build)
    python repro.py --spawn             # spawn the children also without a GPU

Exit 0: the kernel's answer is right; 1: it is wrong, or a call crashed (the bug is there);
2: the repro could not run (the engine is not importable, the inputs are unreadable).

On a machine without a GPU the Triton kernels run under Triton's interpreter
(TRITON_INTERPRET=1, set here): slow, and its bf16 arithmetic is not a GPU's (it computes on the
raw bit patterns), so a kernel that accumulates in bf16 is far further off there than on a GPU;
the verdict carries over, the size does not.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import multiprocessing
import os
import signal
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

INPUTS = "inputs.safetensors"
EXIT_RIGHT, EXIT_WRONG, EXIT_CANNOT_RUN = 0, 1, 2
VERDICTS = {
    EXIT_RIGHT: "no bug seen",
    EXIT_WRONG: "the bug is there",
    EXIT_CANNOT_RUN: "not judged",
}
SHOWN = 8  # differing rows or elements printed per call

Tensors = dict[str, torch.Tensor]


# -- the engine's kernel ------------------------------------------------------------------------


def prepare_engine(module: str) -> None:
    """What importing the engine's kernel module needs here: the interpreter without a GPU,
    vLLM's Triton switch, LMDeploy's package root left unimported."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    engine = module.split(".")[0]
    if engine == "vllm" and os.environ.get("TRITON_INTERPRET") == "1":
        # vLLM disables Triton when it has no CPU backend (vllm/triton_utils/importing.py) and
        # hands its kernel modules a placeholder; under the interpreter the real one runs them.
        importing = importlib.import_module("vllm.triton_utils.importing")
        utils = importlib.import_module("vllm.triton_utils")
        if not utils.HAS_TRITON:
            importing.HAS_TRITON = True
            importlib.reload(utils)
    if engine == "lmdeploy" and "lmdeploy" not in sys.modules:
        # lmdeploy/__init__.py imports the serving stack; the kernels need none of it
        spec = importlib.util.find_spec("lmdeploy")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("the lmdeploy package is not installed")
        root = types.ModuleType("lmdeploy")
        root.__path__ = list(spec.submodule_search_locations)
        root.__spec__ = spec
        sys.modules["lmdeploy"] = root


def load_kernel(path: str) -> Callable[..., object]:
    """The function `module:name` names, its engine prepared first."""
    module, _, name = path.partition(":")
    prepare_engine(module)
    return getattr(importlib.import_module(module), name)


# -- the checks, in plain torch -------------------------------------------------------------------


def count_expert_num_tokens(
    kernel: Callable[..., object], t: Tensors, call: dict, device: str
) -> list[str]:
    """vLLM's count_expert_num_tokens(topk_ids, num_local_experts, expert_map): tokens per local
    expert. Right: only ids in [0, len(expert_map)) count, through the map (without a map, ids in
    [0, num_local_experts)). The map is a view of `expert_map_storage`, so what lies past its end
    in memory is the storage's next element, the same on every run."""
    ids = t["topk_ids"]
    local = call["num_local_experts"]
    expert_map = None
    if "expert_map_storage" in t:
        expert_map = t["expert_map_storage"].to(device)[: call["map_length"]]
    got = kernel(ids.to(device), local, expert_map)
    got = torch.as_tensor(got).cpu().to(torch.int64)

    flat = ids.reshape(-1).to(torch.int64)
    bound = call["map_length"] if expert_map is not None else local
    live = flat[(flat >= 0) & (flat < bound)]
    if expert_map is not None:
        live = expert_map.cpu().to(torch.int64)[live]
        live = live[live >= 0]
    want = torch.bincount(live, minlength=local)[:local]

    lines = ["  expert  expected  actual"]
    for e in range(local):
        mark = "   <- differs" if want[e] != got[e] else ""
        lines.append(f"  {e:>6}  {int(want[e]):>8}  {int(got[e]):>6}{mark}")
    wrong = int((want != got).sum())
    if wrong:
        lines.append(
            f"WRONG: {wrong} of {local} counts differ; the right count takes only ids in "
            f"[0, {bound}), sum {int(want.sum())}, the kernel's sums to {int(got.sum())}"
        )
    return lines if wrong else [*lines, "right: every count takes only ids in range"]


def ordered_bf16(x: torch.Tensor) -> torch.Tensor:
    """bf16 values as integers in value order: neighbouring bf16 numbers differ by 1 (one ulp),
    +0 and -0 are both 0."""
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def ep_gather(kernel: Callable[..., object], t: Tensors, call: dict, device: str) -> list[str]:
    """LMDeploy's ep_gather(input, topk_ids, topk_weights, inv_perm, output): each token's
    weighted sum over its slots with topk_ids >= 0 of input[inv_perm]. Right: the sum in fp32,
    rounded once to bf16, within one bf16 ulp (a GPU's FMA or another order of the fp32 sum
    moves the rounding by at most that)."""
    mm2, ids, weights, inv = t["input"], t["topk_ids"], t["topk_weights"], t["inv_perm"]
    out = torch.empty((ids.shape[0], mm2.shape[1]), dtype=torch.bfloat16, device=device)
    kernel(mm2.to(device), ids.to(device), weights.to(device), inv.to(device), out)
    got = out.cpu()

    rows = mm2.float()[inv.clamp(min=0).to(torch.int64)]  # [T, k, H]
    live = (ids >= 0).unsqueeze(-1)
    terms = torch.where(live, rows * weights.float().unsqueeze(-1), 0.0)
    want = terms.sum(dim=1).to(torch.bfloat16)

    ulps = (ordered_bf16(got) - ordered_bf16(want)).abs()
    beyond = ulps > 1
    n = int(beyond.sum())
    lines = [
        f"{ids.shape[0]} tokens x {ids.shape[1]} slots, H = {mm2.shape[1]}: {n} of {ulps.numel()} "
        f"elements beyond 1 bf16 ulp of the fp32 sum rounded once (worst {int(ulps.max())} ulp)"
    ]
    if n:
        lines.append("  token  column      expected        actual    ulp")
        for token, col in beyond.nonzero()[:SHOWN].tolist():
            lines.append(
                f"  {token:>5}  {col:>6}  {float(want[token, col]):>12.6g}  "
                f"{float(got[token, col]):>12.6g}  {int(ulps[token, col]):>5}"
            )
        lines.append("WRONG: the sum is not the fp32 one rounded once to bf16")
    if os.environ.get("TRITON_INTERPRET") == "1" and "triton" in sys.modules:
        lines.append(
            "note: under the Triton interpreter bf16 arithmetic is computed on raw bit patterns, "
            "not as a GPU computes it: a kernel that accumulates in bf16 is far further off here "
            "than on a GPU (the verdict carries over, the size does not)"
        )
    return lines


CHECKS = {"count_expert_num_tokens": count_expert_num_tokens, "ep_gather": ep_gather}


# -- running each call in a child ------------------------------------------------------------------


def run_call(check: str, path: str, t: Tensors, call: dict) -> None:
    """The child: one call of the kernel `path` names and its check; exit 0 right, 1 wrong (a
    CUDA fault included), 2 when the call raised anything else (the repro cannot judge it)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        lines = CHECKS[check](load_kernel(path), t, call, device)
    except Exception as exc:  # noqa: BLE001 - the kernel's own error, reported as it is
        fault = "CUDA error" in str(exc) or "illegal memory access" in str(exc)
        verdict = "WRONG" if fault else "cannot judge"
        print(f"{verdict}: the call raised {type(exc).__name__}: {exc}")
        sys.exit(EXIT_WRONG if fault else EXIT_CANNOT_RUN)
    print("\n".join(lines), flush=True)
    sys.exit(EXIT_WRONG if any(line.startswith("WRONG") for line in lines) else EXIT_RIGHT)


def start_method(gpu: bool, spawn: bool) -> str:
    """How each call's child starts: forked without a GPU (cheap, the kernel already imported),
    spawned with one (a forked child cannot use CUDA that its parent initialized)."""
    return "spawn" if gpu or spawn else "fork"


def read_inputs(path: Path) -> tuple[dict, dict[str, Tensors]]:
    """(the repro's description, tensors by call name) from inputs.safetensors."""
    calls: dict[str, Tensors] = {}
    with safe_open(str(path), framework="pt") as f:
        about = json.loads((f.metadata() or {})["repro"])
        for key in f.keys():
            call, _, name = key.partition("/")
            calls.setdefault(call, {})[name] = f.get_tensor(key)
    return about, calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", help="module:function to call instead of the engine's")
    parser.add_argument("--inputs", default=str(Path(__file__).with_name(INPUTS)))
    parser.add_argument("--spawn", action="store_true", help="spawn each call's child, not fork")
    args = parser.parse_args(argv)
    try:
        about, tensors = read_inputs(Path(args.inputs))
        path = args.kernel or about["kernel"]
        load_kernel(path)  # importable here, or the repro cannot run
    except Exception as exc:  # noqa: BLE001 - any failure to start is "cannot run"
        print(f"cannot run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    print(about["title"])
    gpu = torch.cuda.is_available()
    where = "on the GPU" if gpu else "no GPU: Triton kernels interpreted"
    print(f"kernel: {path} ({where})")
    verdict = EXIT_RIGHT
    children = multiprocessing.get_context(start_method(gpu, args.spawn))
    for name, call in about["calls"].items():
        print(f"\n{name}: {call['about']}", flush=True)
        child = children.Process(target=run_call, args=(about["check"], path, tensors[name], call))
        child.start()
        child.join()
        code = child.exitcode if child.exitcode is not None else EXIT_CANNOT_RUN
        if code < 0:
            print(
                f"WRONG: the call crashed ({signal.Signals(-code).name}): the kernel read or wrote "
                "out of bounds"
            )
            code = EXIT_WRONG
        verdict = max(verdict, code)
    print(f"\n{VERDICTS[verdict]} (exit {verdict})")
    return verdict


if __name__ == "__main__":
    sys.exit(main())
