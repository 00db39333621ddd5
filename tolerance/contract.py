"""The stage contract of what a backend returns, checked before any value is compared.

`contract_violations` holds one stage's outputs to docs/stage-contract.md: every required output
present, a tensor where a tensor is due, its exact dtype, its shape for this rank, the strides a
kernel depends on, and host entries of the right type. The comparison judges values; this judges
the form, so a float32 mm1 fails gemm1 (where a bounded comparison would pass it and the failure
would surface downstream), not the stage that later reads it.

Shapes come from the problem, this rank's view of it (local experts, TP shard of I) and the
upstream the stage was handed (M_sum from its align, the rows of the tensor a GEMM reads), so
every legitimate variant passes: an upper-bound or an exact M_sum, a permute that sizes its own
buffer to another valid M_sum, either grouped layout. Extra named outputs are allowed. Values
(ids in range, M_sum fitting the counts, which layout a forced problem reports) are the
comparison's (tolerance/stages/exact.py, tolerance/stages/permute.py, tolerance/stages/layouts.py).

Only `moe_verify.spec` is imported: tolerance shares no code with the golden or the kernels it
judges, so this module counts the local experts of a rank itself (tested against
reference.topology).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from moe_verify.spec import (
    COLUMN_ORDER,
    ROUTER_WEIGHT,
    Gemm1Columns,
    GroupedLayout,
    MoEProblem,
    Placement,
    Recipe,
    RouterWeight,
    ScaleFmt,
    Stage,
    TopologyKind,
    Trace,
    ceil_div,
    round_up,
)

__all__ = ["contract_violations", "local_expert_count"]

FP8 = torch.float8_e4m3fn
# DeepGEMM aligns each MN-major scale column to 16 bytes (get_tma_aligned_size): 4 int32 words.
_TMA_WORDS = 4
_LAYOUTS = (GroupedLayout.M_INDICES.value, GroupedLayout.PSUM.value)

# A dimension as the contract names it and its size for this rank; None where the upstream that
# would fix it is missing (then only the number of dimensions is checked).
Dim = tuple[str, int | None]


def local_expert_count(problem: MoEProblem, rank: int) -> int:
    """E_l, the experts `rank` holds: all of them under TP; under EP its slice (linear: the first
    E % N ranks one more), every N-th (round robin), or its explicit list (replicas counted)."""
    topo = problem.topology
    if not (isinstance(rank, int) and 0 <= rank < topo.size):
        raise ValueError(f"rank: expected an int in [0, {topo.size}) for {topo}, got {rank!r}")
    e, n = problem.num_experts, topo.size
    if topo.kind is TopologyKind.TP:
        return e
    if topo.placement is Placement.EXPLICIT:
        return len((topo.explicit or ())[rank])
    if topo.placement is Placement.ROUND_ROBIN:
        return len(range(rank, e, n))
    return e // n + (1 if rank < e % n else 0)


def _host_int(value: object) -> int | None:
    """A Python int (not a bool) or a one-element integer tensor as an int, else None."""
    if isinstance(value, torch.Tensor):
        integer = not (value.dtype.is_floating_point or value.dtype.is_complex)
        if value.numel() == 1 and integer and value.dtype != torch.bool:
            return int(value.item())
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _show(dims: Sequence[Dim]) -> str:
    """'(M_sum=640, H=128)', '(E_l=4,)', '?' where a size is unknown; read as a shape."""
    parts = [f"{label}={'?' if n is None else n}" for label, n in dims]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


class _Strides:
    """The stride rules the contract fixes (None: any strides)."""

    CONTIGUOUS = "contiguous"  # row-major, as the contract's table says
    K_MAJOR = "k_major"  # unit stride along K: the GEMMs' and DeepGEMM's A operand
    PACKED = "packed"  # packed UE8M0: MN-major, each word column TMA-aligned


def _stride_problem(t: torch.Tensor, rule: str) -> str | None:
    """Why `t` breaks the stride rule, or None. Empty tensors have no layout to break."""
    if t.numel() == 0:
        return None
    if rule == _Strides.CONTIGUOUS and not t.is_contiguous():
        return f"expected contiguous (row-major), got strides {tuple(t.stride())}"
    if rule == _Strides.K_MAJOR and t.shape[-1] > 1 and t.stride(-1) != 1:
        return (
            "expected unit stride along the last dimension (K-major, as the GEMM reads it), got "
            f"strides {tuple(t.stride())}"
        )
    if rule == _Strides.PACKED:
        # DeepGEMM's check_sf_layout: stride(-2) == 1 (or one row), stride(-1) ==
        # get_tma_aligned_size(rows, 4), also when there is only one word column.
        rows = t.shape[-2]
        tma = round_up(rows, _TMA_WORDS)
        if (t.stride(-2) != 1 and rows != 1) or t.stride(-1) != tma:
            return (
                f"expected (1, {tma}) (packed UE8M0: MN-major, word columns TMA-aligned to "
                f"round_up({rows}, {_TMA_WORDS})), got {tuple(t.stride())}"
            )
    return None


class _Outputs:
    """One stage's outputs under check; each broken rule becomes one line in `violations`."""

    def __init__(self, stage: str, outputs: Mapping[str, object]) -> None:
        self.stage = stage
        self.outputs = outputs
        self.violations: list[str] = []

    def say(self, name: str, rule: str, text: str) -> None:
        self.violations.append(f"{self.stage}.{name} {rule}: {text}")

    def get(self, name: str) -> object:
        return self.outputs.get(name)

    def tensor(
        self,
        name: str,
        dtype: torch.dtype,
        dims: Sequence[Dim],
        *,
        required: bool = True,
        strides: str | None = None,
    ) -> torch.Tensor | None:
        """outputs[name] held to `dtype`, `dims` and `strides`; the tensor (checked or not) when
        it is one, else None."""
        if name not in self.outputs:
            if required:
                self.say(
                    name,
                    "missing",
                    f"expected {dtype} {_show(dims)}; the stage returned {sorted(self.outputs)}",
                )
            return None
        value = self.outputs[name]
        if not isinstance(value, torch.Tensor):
            self.say(name, "type", f"expected a torch.Tensor, got {type(value).__name__}")
            return None
        if value.dtype != dtype:
            self.say(name, "dtype", f"expected {dtype}, got {value.dtype}")
        shape = tuple(value.shape)
        if len(shape) != len(dims) or any(
            n is not None and n != got for (_, n), got in zip(dims, shape, strict=False)
        ):
            self.say(name, "shape", f"expected {_show(dims)}, got {shape}")
        elif strides is not None and (why := _stride_problem(value, strides)) is not None:
            self.say(name, "strides", why)
        return value

    def host_int(self, name: str, *, required: bool = True) -> int | None:
        if name not in self.outputs:
            if required:
                self.say(
                    name, "missing", f"expected an int; the stage returned {sorted(self.outputs)}"
                )
            return None
        value = _host_int(self.outputs[name])
        if value is None:
            got = self.outputs[name]
            what = (
                f"{got.dtype} tensor of shape {tuple(got.shape)}"
                if isinstance(got, torch.Tensor)
                else f"{type(got).__name__} {got!r}"
            )
            self.say(name, "type", f"expected an int or a one-element integer tensor, got {what}")
        return value

    def host_str(self, name: str, choices: Sequence[str] | None = None) -> None:
        """An optional host string (a str subclass such as an enum member counts)."""
        if name not in self.outputs:
            return
        value = self.outputs[name]
        if not isinstance(value, str):
            self.say(name, "type", f"expected a str, got {type(value).__name__} {value!r}")
        elif choices is not None and value not in choices:
            self.say(name, "value", f"expected one of {list(choices)}, got {value!r}")


class _View:
    """What one stage's outputs are held to: the problem as `rank` sees it, and the upstream the
    stage was handed (the backend's own when chained, the golden's in isolated mode)."""

    def __init__(self, problem: MoEProblem, upstream: Trace, rank: int) -> None:
        self.problem = problem
        self.upstream = upstream
        self.local_experts: Dim = ("E_l", local_expert_count(problem, rank))
        self.batched = problem.batched
        self.k: Dim = ("k", problem.topk)
        self.hidden: Dim = ("H", problem.hidden)
        self.tokens: Dim = ("M", self._route_rows())

    def upstream_value(self, stage: str, name: str) -> object:
        """upstream[stage][name], or None where that stage did not run or lacks it."""
        if stage not in self.upstream or self.upstream.failure(stage) is not None:
            return None
        return self.upstream[stage].get(name)

    def upstream_tensor(self, stage: str, name: str, ndim: int) -> torch.Tensor | None:
        value = self.upstream_value(stage, name)
        return value if isinstance(value, torch.Tensor) and value.dim() == ndim else None

    def upstream_int(self, stage: str, name: str) -> int | None:
        return _host_int(self.upstream_value(stage, name))

    def _route_rows(self) -> int | None:
        """M: the rows entering the experts, those of the route this stage's upstream holds (the
        received tokens under ep+ht, every token otherwise)."""
        ids = self.upstream_tensor(Stage.ROUTE, "topk_ids", 2)
        if ids is not None:
            return ids.shape[0]
        if self.problem.topology.kind is TopologyKind.EP_HT:
            return None
        return self.problem.tokens

    def lead(self, stage: str, name: str) -> tuple[Dim, ...]:
        """The leading dimensions of the tensor a GEMM or act_quant reads (upstream[stage][name]):
        [M_sum] of the contiguous layout, or [E_l, max_tokens] of the batched one. Falls back to
        align's M_sum (or the problem's capacity) where the upstream lacks the tensor."""
        if self.batched:
            t = self.upstream_tensor(stage, name, 3)
            if t is not None:
                return (("E_l", t.shape[0]), ("max_tokens", t.shape[1]))
            return (self.local_experts, ("max_tokens", self.problem.ll_max_tokens))
        t = self.upstream_tensor(stage, name, 2)
        rows = t.shape[0] if t is not None else self.upstream_int(Stage.ALIGN, "M_sum")
        return (("M_sum", rows),)


def _route(v: _View, out: _Outputs) -> None:
    p = v.problem
    if p.topology.kind is not TopologyKind.EP_HT:
        m: Dim = ("T", p.tokens)
        out.tensor("topk_ids", torch.int32, (m, v.k))
        out.tensor("topk_weights", torch.float32, (m, v.k))
        out.host_str("recipe")
        return
    # DeepEP HT: only the received tokens, ids as int64; M is what this rank received.
    ids = out.tensor("topk_ids", torch.int64, (("M", None), v.k))
    rows = ids.shape[0] if ids is not None and ids.dim() == 2 else None
    if rows is not None and rows > p.tokens:
        out.say("topk_ids", "shape", f"expected at most T={p.tokens} received rows, got {rows}")
    m = ("M", rows)
    out.tensor("topk_weights", torch.float32, (m, v.k))
    out.tensor("token_index", torch.int64, (m,))
    out.host_str("recipe")


def _quant_input(v: _View, out: _Outputs) -> None:
    p = v.problem
    g = p.recipe.act_group
    # MXFP8 carries one E8M0 byte per 32 elements; the other recipes fp32 scales per 128
    # (powers of two for the ue8m0 formats: packing them is permute's and act_quant's job).
    scale_dtype = torch.uint8 if p.recipe is Recipe.MXFP8 else torch.float32
    out.tensor("a1q", FP8, (v.tokens, v.hidden), strides=_Strides.CONTIGUOUS)
    out.tensor(
        "a1q_scale", scale_dtype, (v.tokens, (f"H/{g}", p.hidden // g)), strides=_Strides.CONTIGUOUS
    )
    out.host_str("recipe")
    out.host_str(ROUTER_WEIGHT, [r.value for r in RouterWeight])


def _align(v: _View, out: _Outputs) -> None:
    out.host_int("M_sum")
    alignment = out.host_int("alignment")
    if alignment is not None and alignment < 1:
        out.say("alignment", "value", f"expected >= 1, got {alignment}")
    out.tensor("counts", torch.int32, (v.local_experts,), required=False)
    out.host_str("recipe")


def _permuted_rows(v: _View, out: _Outputs, a_perm: torch.Tensor | None) -> int | None:
    """The rows of the permuted buffer: align's M_sum, or another valid M_sum (a permute that
    sizes its own buffer, docs/stage-contract.md "M_sum"): a multiple of A holding every
    segment of align's counts."""
    m_sum = v.upstream_int(Stage.ALIGN, "M_sum")
    if a_perm is None or a_perm.dim() != 2:
        return m_sum
    rows = a_perm.shape[0]
    a = v.upstream_int(Stage.ALIGN, "alignment")
    if m_sum is None or rows == m_sum or a is None or a < 1:
        return rows
    counts = v.upstream_tensor(Stage.ALIGN, "counts", 1)
    need = 0 if counts is None else int(round_up(counts.long(), a).sum())
    if rows % a or rows < need:
        out.say(
            "a_perm",
            "rows",
            f"expected align's M_sum={m_sum}, or another multiple of A={a} that holds every "
            f"segment (>= {need}), got {rows}",
        )
    return rows


def _permute(v: _View, out: _Outputs) -> None:
    p = v.problem
    a_perm = out.tensor("a_perm", FP8, (("M_sum", None), v.hidden), strides=_Strides.K_MAJOR)
    r: Dim = ("M_sum", _permuted_rows(v, out, a_perm))
    if p.recipe is Recipe.MXFP8:  # E8M0 bytes travel packed four per int32, as DeepGEMM reads them
        words = ceil_div(p.hidden // 32, 4)
        out.tensor(
            "a_scale_perm", torch.int32, (r, ("ceil(H/32/4)", words)), strides=_Strides.PACKED
        )
    else:
        g = p.recipe.act_group
        out.tensor("a_scale_perm", torch.float32, (r, (f"H/{g}", p.hidden // g)))
    # DeepGEMM reads both grouped layouts as contiguous int32 (validate_contiguous_call). A
    # kernel returns the layout it built: m_indices, or expert_ends alone for psum.
    psum = p.grouped_layout is GroupedLayout.PSUM or out.get("layout") == GroupedLayout.PSUM
    out.tensor("m_indices", torch.int32, (r,), required=not psum, strides=_Strides.CONTIGUOUS)
    out.tensor("inv_perm", torch.int32, (v.tokens, v.k))
    out.tensor(
        "expert_ends",
        torch.int32,
        (v.local_experts,),
        required=psum,
        strides=_Strides.CONTIGUOUS,
    )
    out.tensor("expert_start", torch.int32, (v.local_experts,), required=False)
    out.host_str("layout", _LAYOUTS)


def _dispatch(v: _View, out: _Outputs) -> None:
    p = v.problem
    g = p.recipe.act_group
    e, t = v.local_experts, ("max_tokens", p.ll_max_tokens)
    # DeepGEMM's masked GEMM views the batches as one K-major [E_l * max_tokens, H] matrix.
    out.tensor("a_batched", FP8, (e, t, v.hidden), strides=_Strides.CONTIGUOUS)
    scales = out.get("a_scale_batched")
    if p.scale_fmt is ScaleFmt.UE8M0_PACKED and getattr(scales, "dtype", None) == torch.int32:
        # Handed to DeepGEMM already packed (its packer off): per batch MN-major, TMA-aligned.
        words = ceil_div(p.hidden // g, 4)
        out.tensor(
            "a_scale_batched",
            torch.int32,
            (e, t, (f"ceil(H/{g}/4)", words)),
            strides=_Strides.PACKED,
        )
    else:
        out.tensor("a_scale_batched", torch.float32, (e, t, (f"H/{g}", p.hidden // g)))
    out.tensor("masked_m", torch.int32, (e,), strides=_Strides.CONTIGUOUS)
    out.tensor("slot", torch.int32, (v.tokens, v.k))
    out.tensor("slot_expert", torch.int32, (v.tokens, v.k))
    out.host_int("expected_m")


def _gemm1(v: _View, out: _Outputs) -> None:
    lead = v.lead(Stage.DISPATCH, "a_batched") if v.batched else v.lead(Stage.PERMUTE, "a_perm")
    ip = v.problem.intermediate_per_rank
    out.tensor("mm1", torch.bfloat16, (*lead, ("2*Ip", 2 * ip)))
    out.host_str("engine")
    out.host_str("layout", _LAYOUTS)
    out.host_str(COLUMN_ORDER, [c.value for c in Gemm1Columns])


def _act_quant(v: _View, out: _Outputs) -> None:
    p = v.problem
    lead = v.lead(Stage.GEMM1, "mm1")
    ip, g = p.intermediate_per_rank, p.recipe.act_group
    out.tensor("a2q", FP8, (*lead, ("Ip", ip)), strides=_Strides.K_MAJOR)
    if p.scale_fmt is ScaleFmt.UE8M0_PACKED:
        words = ceil_div(ip // g, 4)
        out.tensor(
            "a2q_scale", torch.int32, (*lead, (f"ceil(Ip/{g}/4)", words)), strides=_Strides.PACKED
        )
    else:
        out.tensor("a2q_scale", torch.float32, (*lead, (f"Ip/{g}", ip // g)))
    out.host_str("recipe")
    out.host_str("layout", _LAYOUTS)


def _gemm2(v: _View, out: _Outputs) -> None:
    out.tensor("mm2", torch.bfloat16, (*v.lead(Stage.ACT_QUANT, "a2q"), v.hidden))
    out.host_str("engine")
    out.host_str("layout", _LAYOUTS)


def _gather(v: _View, out: _Outputs) -> None:
    out.tensor("out", torch.bfloat16, (v.tokens, v.hidden))


def _every_token(v: _View, out: _Outputs) -> None:
    """shared (this rank's shard of the dense MLP) and reduce: every token, all of H."""
    out.tensor("out", torch.bfloat16, (("T", v.problem.tokens), v.hidden))
    out.host_str("engine")


_RULES: dict[Stage, Callable[[_View, _Outputs], None]] = {
    Stage.ROUTE: _route,
    Stage.QUANT_INPUT: _quant_input,
    Stage.ALIGN: _align,
    Stage.PERMUTE: _permute,
    Stage.DISPATCH: _dispatch,
    Stage.GEMM1: _gemm1,
    Stage.ACT_QUANT: _act_quant,
    Stage.GEMM2: _gemm2,
    Stage.GATHER: _gather,
    Stage.SHARED: _every_token,
    Stage.REDUCE: _every_token,
}


def contract_violations(
    stage: str,
    problem: MoEProblem,
    upstream: Trace,
    outputs: Mapping[str, object],
    rank: int,
) -> list[str]:
    """Every way `outputs` of `stage` (as `rank` ran it on `upstream`) break the stage contract,
    one line each, e.g. "gemm1.mm1 dtype: expected torch.bfloat16, got torch.float32"; [] when
    they keep it.

    stage: one of problem.stages, or "reduce". upstream: the trace the stage was handed (its
    shapes fix M and M_sum). Raises ValueError for a stage the problem does not run or a rank
    outside its topology.
    """
    allowed = (*problem.stages, Stage.REDUCE)
    if stage not in allowed:
        raise ValueError(
            f"stage: expected one of {[str(s) for s in allowed]} for {problem.id}, got {stage!r}"
        )
    if not isinstance(outputs, Mapping):
        return [
            f"{stage} outputs: expected a mapping of names to values, got {type(outputs).__name__}"
        ]
    view = _View(problem, upstream, rank)
    out = _Outputs(str(stage), outputs)
    _RULES[Stage(stage)](view, out)
    return out.violations
