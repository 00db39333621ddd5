"""OptimizedBackend: the DeepGEMM MoE path (Triton kernels + DeepGEMM grouped GEMMs), staged.

This class is the one stage surface: one method per stage, `(problem, inputs, upstream, rank)
-> outputs`. Verification calls the methods through `run_stage` (host-validated, guarded
workspaces); production mode calls the same methods inside the custom op, graph-safe
(`production`: no validation, no host reads, buffers carved from the op's workspace, the op's
weights). A user's kernel for one stage is a subclass overriding that one method.

Stage for stage it mirrors reference/moe.py, so the two read side by side. GEMM stages pick an
engine like vLLM's TritonOrDeepGemmExperts (`deepgemm.choose_engine`) and record which one ran,
and why. The permute yields both grouped layouts (m_indices and the psum expert_ends) from one
plan; the GEMMs and act_quant read the one `deepgemm.choose_grouped_layout` picks (as vLLM 0.32
does, or as the problem forces) and record it as "layout".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from moe_verify.spec import (
    Engine,
    GemmRecipe,
    GroupedLayout,
    MoEInputs,
    MoEProblem,
    QuantizedWeight,
    Recipe,
    ScaleFmt,
    Stage,
    StageSkipped,
    StageViolation,
    TopologyKind,
    Trace,
    check_bool,
    is_sm90,
    run_stages,
)
from optimized import deepgemm
from optimized.deepgemm import EngineChoice, as_engine, choose_engine, choose_grouped_layout
from optimized.dispatch import batch_m_indices, batched_dispatch
from optimized.kernels import act_quant, gather, grouped_gemm, quant, scatter, slot_counts
from optimized.production import CarvedBuffers, ForwardConfig, RankWeights
from optimized.routing import select_experts
from optimized.topology import Shard, hosted_experts, shard, tp_down_shard, tp_gate_up_shard
from optimized.triton_compat import interpreter_mode
from optimized.workspace import Workspaces

Outputs = dict[str, object]
StageHook = Callable[[MoEProblem, MoEInputs, Trace, int], Outputs]


# The Triton GEMM tile whose SM90 bits were measured to be the tensor core's (docs/gpu-results.md).
MEASURED_BLOCK_ROWS = 128


def gemm_recipe(problem: MoEProblem, engine: Engine, out: torch.Tensor, alignment: int) -> Outputs:
    """{"recipe": "tensor_core"} where the Triton engine's fp8_block GEMM ran compiled on an SM90
    GPU: its chunks then accumulate on the tensor core and are promoted as DeepGEMM's are
    (optimized/kernels/grouped_gemm.py), so its output is the tensor-core recipe's bit for bit
    (measured on the H200: 100.0000% with fp32 and ceil-UE8M0 scales), for the one tile measured:
    128-row blocks (`grouped_gemm.default_block_m(alignment)`; smaller blocks may lower tl.dot to
    another MMA, whose accumulation is not modelled). The shared experts' two GEMMs say it of
    both. DeepGEMM's output says so by its engine; anything else declares nothing."""
    sm90 = (ScaleFmt.FLOAT32, ScaleFmt.FLOAT32_CEIL_UE8M0)
    if (
        engine is not Engine.TRITON
        or problem.recipe is not Recipe.FP8_BLOCK
        or problem.scale_fmt not in sm90
        or interpreter_mode()
        or grouped_gemm.default_block_m(alignment) != MEASURED_BLOCK_ROWS
        or not is_sm90(out.device)
    ):
        return {}
    return {"recipe": GemmRecipe.TENSOR_CORE.value}


class OptimizedBackend:
    """The path under test. `engine` selects the GEMM engine: auto, deepgemm or triton.

    Each stage is a public method named after it (`route`, `quant_input`, `align`, `permute`,
    `dispatch`, `gemm1`, `act_quant`, `gemm2`, `gather`, `shared`), all with the signature
    `(problem, inputs, upstream, rank) -> outputs`; `run_stage` calls the one for its stage. To
    verify your own kernel for a stage, subclass and override that method: `upstream` holds the
    outputs of the stages before it (yours in chained mode, the golden's in isolated mode; never
    write to it), and the returned names are those of docs/stage-contract.md.

    The same methods run in production mode (`moe-verify graph`, `bench --production`, the op):
    there `self.graph_safe` is True, so call kernels with `validate=self.validate`, take output
    buffers from `self.workspaces.get(...)`, weights from `self.shard(...)`, and read nothing
    from the device on the host; a stage that does is named by `moe-verify graph`.
    """

    name = "optimized"

    def __init__(
        self,
        engine: Engine | str = Engine.AUTO,
        workspace: bool = False,
        poison: int | None = None,
        *,
        exact_m_sum: bool = False,
        expected_m: int | None = None,
        num_sms: int | None = None,
    ) -> None:
        """workspace: kernels write into buffers allocated once per (name, shape) and reused
        across calls, as vLLM's workspaces are; stage outputs are then copies. Each workspace
        sits between two guard bands of a canary pattern, checked after every stage, so a kernel
        writing past either end of its output fails that stage by name. poison: fill each
        workspace with this byte before every use, so an element a kernel leaves unwritten shows
        up (the same case under two poisons must agree bitwise on everything it promises).

        The settings that must not change any output (tolerance/invariance.py): exact_m_sum
        sizes the permuted buffer from the counts on every topology (a host read), not only on
        ep:N+ht; expected_m replaces the masked GEMM's scheduling hint; num_sms caps the SMs
        DeepGEMM's GEMMs may use (deep_gemm.set_num_sms)."""
        if expected_m is not None and (isinstance(expected_m, bool) or expected_m < 1):
            raise ValueError(f"expected_m: an int >= 1 or None, got {expected_m!r}")
        if num_sms is not None and (isinstance(num_sms, bool) or num_sms < 1):
            raise ValueError(f"num_sms: an int >= 1 or None, got {num_sms!r}")
        check_bool("workspace", workspace)
        self.exact_m_sum = check_bool("exact_m_sum", exact_m_sum)
        self.expected_m = expected_m
        self.num_sms = num_sms
        self.engine = as_engine(engine)
        self.workspaces: Workspaces | CarvedBuffers = Workspaces(workspace, poison)
        # Production mode (`production`): graph-safe stage calls on the op's weights and buffers.
        self.graph_safe = False
        self._bound: tuple[ForwardConfig, RankWeights] | None = None
        # Per-rank weights (and DeepGEMM's scale layouts) of the inputs object last seen; held,
        # so a new inputs object can never alias a stale cache entry through a reused id().
        self._weights_of: MoEInputs | None = None
        self._shards: dict[tuple[MoEProblem, int], Shard] = {}
        self._dg_scales: dict[tuple[MoEProblem, int, str], torch.Tensor] = {}

    @property
    def workspace(self) -> bool:
        return isinstance(self.workspaces, Workspaces) and self.workspaces.enabled

    @property
    def poison(self) -> int | None:
        return self.workspaces.poison if isinstance(self.workspaces, Workspaces) else None

    @property
    def validate(self) -> bool:
        """Whether kernels check their inputs' values on the host (never in production mode)."""
        return not self.graph_safe

    @contextlib.contextmanager
    def production(
        self, cfg: ForwardConfig, weights: RankWeights, buffers: CarvedBuffers
    ) -> Iterator[None]:
        """Inside this block the stage methods run as production mode needs them: graph-safe
        (no validation, no host reads), on `weights` (the rank's, as the op was given them),
        writing the M_sum-sized outputs into `buffers`, on `cfg`'s engine."""
        saved = (self.graph_safe, self._bound, self.workspaces, self.engine)
        self.graph_safe, self._bound = True, (cfg, weights)
        self.workspaces, self.engine = buffers, cfg.engine
        try:
            yield
        finally:
            self.graph_safe, self._bound, self.workspaces, self.engine = saved

    def run(self, problem: MoEProblem, inputs: MoEInputs, rank: int = 0) -> Trace:
        return run_stages(self, problem, inputs, rank)

    def run_stage(
        self, stage: str, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int
    ) -> Outputs:
        hook = self.stage_hook(stage)
        try:
            outputs = hook(problem, inputs, upstream, rank)
        except StageSkipped:
            self.workspaces.guard_hits()  # re-armed; a stage that did not run wrote nothing
            raise
        except Exception as exc:
            hits = self.workspaces.guard_hits()
            if hits:  # the stage failed and wrote out of bounds: report both
                raise StageViolation(f"{type(exc).__name__}: {exc}; and {stage} {hits}") from exc
            raise
        hits = self.workspaces.guard_hits()
        if hits:
            raise StageViolation(f"{stage} {hits}")
        return outputs

    def stage_hook(self, stage: str) -> StageHook:
        """The method that runs `stage` (the one named after it)."""
        try:
            known = Stage(stage)
        except ValueError:
            known = None
        if known is None or known is Stage.REDUCE:
            raise ValueError(f"stage {stage!r} is not a stage of the optimized MoE")
        hook: StageHook = getattr(self, known.value)
        return hook

    def shard(self, problem: MoEProblem, inputs: MoEInputs, rank: int) -> Shard:
        """This rank's weights and expert map, built once per inputs object (in production
        mode: the weights the op was given)."""
        if self._bound is not None:
            cfg, w = self._bound
            experts = tuple(hosted_experts(cfg.problem, cfg.rank))
            return Shard(experts, w.expert_map, w.w13, w.w2)
        if inputs is not self._weights_of:
            self._weights_of, self._shards, self._dg_scales = inputs, {}, {}
        key = (problem, rank)
        if key not in self._shards:
            self._shards[key] = shard(problem, inputs.w13_q, inputs.w2_q, rank)
        return self._shards[key]

    def _deepgemm_weight_scales(
        self, problem: MoEProblem, inputs: MoEInputs, rank: int, which: str, w: QuantizedWeight
    ) -> torch.Tensor:
        """This rank's w13/w2 scales in DeepGEMM's layout, transformed once per inputs object
        (in production mode: the op's, transformed at load time)."""
        if self._bound is not None:
            bound = self._bound[1]
            return bound.w13_scale if which == "w13" else bound.w2_scale
        self.shard(problem, inputs, rank)  # resets the caches when inputs is a new object
        key = (problem, rank, which)
        if key not in self._dg_scales:
            self._dg_scales[key] = deepgemm.prepare_weight_scales(w, problem.scale_fmt.is_ue8m0)
        return self._dg_scales[key]

    # -- stages ----------------------------------------------------------------------------------

    def route(self, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int) -> Outputs:
        ids, weights = select_experts(problem, inputs)
        if problem.topology.kind is not TopologyKind.EP_HT:
            return {"topk_ids": ids, "topk_weights": weights}
        expert_map = self.shard(problem, inputs, rank).expert_map
        assert expert_map is not None
        local = torch.where(ids >= 0, expert_map[ids.long().clamp(min=0)], -1)
        received = (local >= 0).any(dim=1).nonzero().squeeze(1)
        return {
            "topk_ids": ids[received].to(torch.int64),
            "topk_weights": weights[received],
            "token_index": received,
        }

    def quant_input(
        self, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int
    ) -> Outputs:
        hidden = inputs.hidden_states
        if "token_index" in upstream["route"]:  # ep:N+ht: the tokens this rank received
            hidden = hidden[upstream["route"]["token_index"]]
        if problem.recipe is Recipe.MXFP8:
            q, s = quant.quantize_mxfp8(hidden, problem.recipe.act_group)
        else:
            q, s = quant.quantize_fp8_groups(hidden, problem.recipe.act_group, problem.scale_fmt)
        return {"a1q": q, "a1q_scale": s}

    def align(self, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int) -> Outputs:
        sh = self.shard(problem, inputs, rank)
        ids = upstream["route"]["topk_ids"]
        counts = slot_counts.count_expert_tokens(
            ids, sh.num_local_experts, sh.expert_map, validate=self.validate
        )
        if problem.topology.kind is TopologyKind.EP_HT or self.exact_m_sum:
            # The one host read of the exact-count path (production mode says so: host_syncs).
            m_sum = slot_counts.aligned_m_sum_exact(counts, problem.alignment)
        else:
            m_sum = slot_counts.aligned_m_sum_upper_bound(
                ids.shape[0], ids.shape[1], sh.num_local_experts, problem.alignment
            )
        return {"M_sum": m_sum, "alignment": problem.alignment, "counts": counts}

    def permute(
        self, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int
    ) -> Outputs:
        sh = self.shard(problem, inputs, rank)
        align = upstream["align"]
        a1q = upstream["quant_input"]["a1q"]
        m_sum = align["M_sum"]
        out = scatter.ep_scatter(
            a1q,
            upstream["quant_input"]["a1q_scale"],
            upstream["route"]["topk_ids"],
            align["counts"],
            sh.num_local_experts,
            align["alignment"],
            m_sum,
            sh.expert_map,
            validate=self.validate,
            a_perm_out=self.workspaces.get("a_perm", (m_sum, a1q.shape[1]), a1q.dtype, a1q.device),
        )
        return {
            "a_perm": self.workspaces.own(out.a_perm),
            "a_scale_perm": out.a_scale_perm,
            "m_indices": out.m_indices,
            "expert_ends": out.expert_ends,
            "inv_perm": out.inv_perm,
            "expert_start": out.expert_start,
            "layout": choose_grouped_layout(problem).layout.value,
        }

    @staticmethod
    def grouped_layout(problem: MoEProblem, upstream: Trace) -> tuple[GroupedLayout, torch.Tensor]:
        """The layout the contiguous GEMMs and act_quant read, and its tensor from the upstream
        permute: m_indices [M_sum], or expert_ends [E_l] for psum."""
        layout = choose_grouped_layout(problem).layout
        name = "expert_ends" if layout is GroupedLayout.PSUM else "m_indices"
        return layout, upstream["permute"][name]

    def gemm1(self, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int) -> Outputs:
        if "dispatch" in upstream:
            d = upstream["dispatch"]
            r = self._batched_gemm(
                problem, inputs, upstream, rank, "w13", d["a_batched"], d["a_scale_batched"]
            )
            return {"mm1": r.pop("out"), **r}
        perm = upstream["permute"]
        choice = choose_engine(problem, upstream["route"]["topk_ids"].shape[0], self.engine)
        layout, grouped = self.grouped_layout(problem, upstream)
        mm1 = self._grouped_gemm(
            choice,
            problem,
            inputs,
            rank,
            "w13",
            perm["a_perm"],
            perm["a_scale_perm"],
            grouped,
            layout,
            upstream["align"]["alignment"],
        )
        return {
            "mm1": mm1,
            "engine": choice.engine,
            "engine_reason": choice.reason,
            "layout": layout.value,
            **gemm_recipe(problem, choice.engine, mm1, upstream["align"]["alignment"]),
        }

    def act_quant(
        self, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int
    ) -> Outputs:
        if problem.recipe is Recipe.MXFP4_W4A8 and problem.activation.kind != "silu":
            raise ValueError("mxfp4_w4a8: the FP4 experts support silu (with optional clamp) only")
        mm1 = upstream["gemm1"]["mm1"]
        batch = mm1.shape[:-1]
        flat = mm1.reshape(-1, mm1.shape[-1])
        out_q = self.workspaces.get(
            "a2q", (flat.shape[0], flat.shape[1] // 2), torch.float8_e4m3fn, mm1.device
        )
        if mm1.dim() == 3:  # batched layout: every batch row is quantized, kept [E_l, T, ...]
            q, s = act_quant.silu_mul_quant(
                flat, problem.activation, problem.recipe.act_group, problem.scale_fmt, out_q,
                validate=self.validate,
            )  # fmt: skip
            return {
                "a2q": self.workspaces.own(q).view(*batch, q.shape[-1]),
                "a2q_scale": s.reshape(*batch, s.shape[-1]),
                **act_quant.gate_source(mm1.device),
            }
        layout, grouped = self.grouped_layout(problem, upstream)
        psum = layout is GroupedLayout.PSUM
        q, s = act_quant.silu_mul_quant(
            flat,
            problem.activation,
            problem.recipe.act_group,
            problem.scale_fmt,
            out_q,
            expert_ends=grouped if psum else None,
            expert_alignment=upstream["align"]["alignment"] if psum else 0,
            validate=self.validate,
        )
        return {
            "a2q": self.workspaces.own(q),
            "a2q_scale": s,
            "layout": layout.value,
            **act_quant.gate_source(mm1.device),
        }

    def gemm2(self, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int) -> Outputs:
        act = upstream["act_quant"]
        if "dispatch" in upstream:
            r = self._batched_gemm(
                problem, inputs, upstream, rank, "w2", act["a2q"], act["a2q_scale"]
            )
            return {"mm2": r.pop("out"), **r}
        choice = choose_engine(problem, upstream["route"]["topk_ids"].shape[0], self.engine)
        layout, grouped = self.grouped_layout(problem, upstream)
        mm2 = self._grouped_gemm(
            choice,
            problem,
            inputs,
            rank,
            "w2",
            act["a2q"],
            act["a2q_scale"],
            grouped,
            layout,
            upstream["align"]["alignment"],
        )
        return {
            "mm2": mm2,
            "engine": choice.engine,
            "engine_reason": choice.reason,
            "layout": layout.value,
            **gemm_recipe(problem, choice.engine, mm2, upstream["align"]["alignment"]),
        }

    def gather(self, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int) -> Outputs:
        route = upstream["route"]
        if "dispatch" in upstream:  # LL combine: weighted fp32 sum over each slot's batched row
            mm2, d = upstream["gemm2"]["mm2"], upstream["dispatch"]
            rows = torch.where(d["slot"] >= 0, d["slot_expert"] * mm2.shape[1] + d["slot"], -1)
            out = gather.ep_gather(
                mm2.reshape(-1, mm2.shape[-1]),
                d["slot_expert"],
                route["topk_weights"],
                rows.to(torch.int32),
                validate=self.validate,
            )
            return {"out": out}
        mm2, ids = upstream["gemm2"]["mm2"], route["topk_ids"]
        out = gather.ep_gather(
            mm2,
            ids,
            route["topk_weights"],
            upstream["permute"]["inv_perm"],
            self.shard(problem, inputs, rank).expert_map,
            validate=self.validate,
            out=self.workspaces.get(
                "out", (ids.shape[0], mm2.shape[1]), torch.bfloat16, mm2.device
            ),
        )
        return {"out": self.workspaces.own(out)}

    def shared(self, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int) -> Outputs:
        """Shared experts: a dense gated MLP on every token, this rank's intermediate shard, with
        the same kernels (one group: every row is expert 0). vLLM runs it through dense FP8
        linears, not the DeepGEMM MoE path, so the Triton engine computes it here."""
        if inputs.shared_w13 is None or inputs.shared_w2 is None:
            raise ValueError("shared_experts > 0 needs inputs with shared_w13 / shared_w2")
        size = problem.topology.size
        i_s = inputs.shared_w2.shape[2]
        w13 = tp_gate_up_shard(inputs.shared_w13, i_s, i_s // size, rank)
        w2 = tp_down_shard(inputs.shared_w2, i_s // size, rank)
        hidden = inputs.hidden_states
        group = problem.recipe.act_group
        if problem.recipe is Recipe.MXFP8:
            a, bytes_ = quant.quantize_mxfp8(hidden, group)
            a_scale = quant.pack_ue8m0(bytes_)
        else:
            a, a_scale = quant.quantize_fp8_groups(hidden, group, problem.scale_fmt)
        rows = hidden.shape[0]
        if rows == 0:
            return {
                "out": torch.zeros(0, problem.hidden, dtype=torch.bfloat16, device=hidden.device)
            }
        every_row = torch.zeros(rows, dtype=torch.int32, device=hidden.device)
        mm1 = grouped_gemm.grouped_gemm(
            a, a_scale, group, w13.q, w13.scale, w13.block, every_row, rows
        )
        a2, a2_scale = act_quant.silu_mul_quant(mm1, problem.activation, group, problem.scale_fmt)
        out = grouped_gemm.grouped_gemm(
            a2, a2_scale, group, w2.q, w2.scale, w2.block, every_row, rows
        )
        return {
            "out": out,
            "engine": Engine.TRITON,
            **gemm_recipe(problem, Engine.TRITON, out, rows),
            **act_quant.gate_source(out.device),
        }

    # -- batched low-latency layout (ep:N+ll) ----------------------------------------------------

    def dispatch(
        self, problem: MoEProblem, inputs: MoEInputs, upstream: Trace, rank: int
    ) -> Outputs:
        """Stands in for DeepEP's low-latency dispatch (optimized/dispatch.py). expected_m, the
        masked GEMM's scheduling hint, is the mean batch read on the host in verification, and
        the mean of the token bound in production mode (no host read)."""
        sh = self.shard(problem, inputs, rank)
        q = upstream["quant_input"]
        a1q, e_l = q["a1q"], sh.num_local_experts
        t, k = upstream["route"]["topk_ids"].shape
        rows = e_l * problem.ll_max_tokens
        out = batched_dispatch(
            a1q,
            q["a1q_scale"],
            upstream["route"]["topk_ids"],
            sh.expert_map,
            e_l,
            problem.ll_max_tokens,
            expected_m=max(1, -(-t * k // max(e_l, 1))) if self.graph_safe else None,
            a_out=self.workspaces.get("a_perm", (rows, a1q.shape[1]), a1q.dtype, a1q.device),
        )
        out["a_batched"] = self.workspaces.own(out["a_batched"])
        return out

    def _batched_gemm(
        self,
        problem: MoEProblem,
        inputs: MoEInputs,
        upstream: Trace,
        rank: int,
        which: str,
        a: torch.Tensor,
        a_scale: torch.Tensor,
    ) -> Outputs:
        d = upstream["dispatch"]
        e_l, t_max, k = a.shape
        choice = choose_engine(problem, upstream["route"]["topk_ids"].shape[0], self.engine)
        sh = self.shard(problem, inputs, rank)
        w = sh.w13 if which == "w13" else sh.w2
        name = "mm1" if which == "w13" else "mm2"
        buf = self.workspaces.get(name, (e_l * t_max, w.shape[1]), torch.bfloat16, a.device)
        if choice.engine is Engine.DEEPGEMM:
            with deepgemm.sm_count_scope(self.num_sms):
                out = deepgemm.m_grouped_gemm_masked(
                    a,
                    a_scale,
                    w,
                    self._deepgemm_weight_scales(problem, inputs, rank, which, w),
                    d["masked_m"],
                    self.expected_m or int(d["expected_m"]),
                    use_ue8m0=problem.scale_fmt.is_ue8m0,
                    validate=self.validate,
                    out=None if buf is None else buf.view(e_l, t_max, w.shape[1]),
                )
        else:
            out = grouped_gemm.grouped_gemm(
                a.reshape(e_l * t_max, k),
                a_scale.reshape(e_l * t_max, a_scale.shape[-1]),
                problem.recipe.act_group,
                w.q,
                w.scale,
                w.block,
                batch_m_indices(d["masked_m"], t_max),
                t_max,
                validate=self.validate,
                out=buf,
            ).view(e_l, t_max, w.shape[1])
        out = self.workspaces.own(out)
        return {
            "out": out,
            "engine": choice.engine,
            "engine_reason": choice.reason,
            **gemm_recipe(problem, choice.engine, out, t_max),
        }

    # -- engines ---------------------------------------------------------------------------------

    def _grouped_gemm(
        self,
        choice: EngineChoice,
        problem: MoEProblem,
        inputs: MoEInputs,
        rank: int,
        which: str,
        a: torch.Tensor,
        a_scale: torch.Tensor,
        grouped: torch.Tensor,
        layout: GroupedLayout,
        alignment: int,
    ) -> torch.Tensor:
        """One contiguous grouped GEMM on `choice`'s engine; `grouped` is the layout's tensor
        (m_indices, or expert_ends for psum) and `alignment` the segments' A (the align
        stage's, so an isolated GEMM tiles the golden's layout as the golden laid it out)."""
        sh = self.shard(problem, inputs, rank)
        w = sh.w13 if which == "w13" else sh.w2
        group = problem.recipe.act_group
        psum = layout is GroupedLayout.PSUM
        name = "mm1" if which == "w13" else "mm2"
        out = self.workspaces.get(name, (a.shape[0], w.shape[1]), torch.bfloat16, a.device)
        if choice.engine is Engine.TRITON:
            d = grouped_gemm.grouped_gemm(
                a, a_scale, group, w.q, w.scale, w.block, grouped, alignment,
                use_psum_layout=psum, validate=self.validate, out=out,
            )  # fmt: skip
        else:
            with deepgemm.sm_count_scope(self.num_sms):
                d = deepgemm.m_grouped_gemm(
                    a,
                    a_scale,
                    group,
                    w,
                    self._deepgemm_weight_scales(problem, inputs, rank, which, w),
                    grouped,
                    alignment,
                    use_ue8m0=problem.scale_fmt.is_ue8m0,
                    use_psum_layout=psum,
                    validate=self.validate,
                    out=out,
                )
        return self.workspaces.own(d)
