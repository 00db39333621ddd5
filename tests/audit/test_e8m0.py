"""`moe-verify audit-e8m0` on synthetic checkpoints: known answers for the ceil factor and the
two published requantization figures, a power-of-two checkpoint whose weight values E8M0 keeps,
one with fp32 scales that it does not, HF layouts (sharded, fused 3-D experts), activation dumps
used where given and refused when malformed, malformed tensors skipped and listed while the rest
is audited, and a clear error when nothing can be."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_verify.audit import (
    QWEN38_FLASH_NEXT,
    VERDICT_CAVEAT,
    AuditError,
    audit,
    dump_names,
    find_fp8_weights,
    requantization_error,
    to_markdown,
    write_report,
)
from moe_verify.audit.measure import ACT_GROUP
from moe_verify.cli import main
from moe_verify.common.safe_io import UntrustedFileError
from moe_verify.spec import ScaleFmt
from reference.formats import (
    cast_to_fp8,
    dequantize_fp8_blocks,
    dequantize_fp8_groups,
    quantize_fp8_blocks,
    quantize_fp8_groups,
)

pytestmark = pytest.mark.cpu

H, INTER = 256, 256  # two 128-blocks each way: small, and every weight has four blocks


def _weight(n: int, k: int, seed: int, scales: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [n, k], fp32 block scales) of N(0, 0.02) weights, each 128x128 block scaled by 2^u,
    u ~ U(0, 1), so block scales spread evenly on a log scale: "fp32" amax/448 scales, "pow2"
    ceil-UE8M0 scales, or "x1.5" every scale 1.5 * 2^-9 (ceil factor 4/3)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.rand(n // 128, k // 128, generator=g))
    w = (
        torch.randn(n, k, generator=g)
        * 0.02
        * spread.repeat_interleave(128, 0).repeat_interleave(128, 1)
    )
    if scales == "x1.5":
        s = torch.full((n // 128, k // 128), 1.5 * 2.0**-9)
        return cast_to_fp8(w / 1.5 / 2.0**-9), s
    return quantize_fp8_blocks(w, (128, 128), use_ue8m0=scales == "pow2")


def _model(scales: str, layers: int = 3, experts: int = 4) -> dict[str, torch.Tensor]:
    """A DeepSeek-style layout: attention o_proj, routed experts, a shared expert per layer."""
    tensors: dict[str, torch.Tensor] = {}
    seed = 0
    for layer in range(layers):
        p = f"model.layers.{layer}"
        mods = [f"{p}.self_attn.o_proj", f"{p}.mlp.shared_experts.down_proj"]
        mods += [
            f"{p}.mlp.experts.{e}.{proj}"
            for e in range(experts)
            for proj in ("gate_proj", "up_proj", "down_proj")
        ]
        for mod in mods:
            seed += 1
            q, s = _weight(INTER if "gate" in mod or "up" in mod else H, H, seed, scales)
            tensors[f"{mod}.weight"] = q
            tensors[f"{mod}.weight_scale_inv"] = s
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)  # not FP8
    return tensors


def _save(tmp: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    if config is not None:
        (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def test_power_of_two_scales_keep_every_weight_value(tmp_path: Path) -> None:
    report = audit(_save(tmp_path, _model("pow2"), {"model_type": "deepseek_v3"}), device="cpu")
    assert report.verdict == "low-risk" and report.model_type == "deepseek_v3"
    assert report.ratio == 1.0 and "have power-of-two scales already" in report.reason
    assert all(e.ratio == 1.0 and e.weight_rel_err == 0 for e in report.by_kind().values())
    assert report.fp8_weights == 3 * 14 and report.model.blocks == 3 * 14 * 4
    assert report.model.pow2_fraction == 1.0 and report.model.max_bits_lost == 0.0
    sampled = [w for layer in report.layers for w in layer.weights]
    assert len(sampled) == 3 * (2 + 4 * 3)  # o_proj, shared, every projection of 4 experts
    assert all(w.weight_rel_err == 0.0 and w.out_err_e8m0 == w.out_err_e8m0_act for w in sampled)
    # A block whose largest value rounds to code 224 requantizes to half the scale and twice the
    # codes (the same values): some codes change, never a value.
    assert any(w.codes_changed > 0 for w in sampled)
    # Ceil activation scales cost on their own: the outlier that sets a group's scale no longer
    # lands on code 448 exactly.
    assert all(w.out_err_e8m0_act > w.out_err_fp32 > 0 for w in sampled)


def test_fp32_scales_lose_half_a_bit_and_are_at_risk(tmp_path: Path) -> None:
    report = audit(_save(tmp_path, _model("fp32")), device="cpu")
    m = report.model
    assert m.pow2_fraction < 0.05
    # Scales spread evenly on a log scale make log2 r uniform in [0, 1): mean 0.5, and 168 blocks
    # put the sample mean within 0.022 (one standard error) of it.
    assert abs(m.mean_bits_lost - 0.5) < 0.1, m.mean_bits_lost
    sampled = [w for layer in report.layers for w in layer.weights]
    assert all(w.weight_rel_err > 0.01 and w.codes_changed > 0.5 for w in sampled)
    assert all(w.out_err_e8m0 > w.out_err_e8m0_act for w in sampled)
    assert report.ratio > report.max_ratio and report.verdict == "at-risk", report.reason
    kinds = report.by_kind()
    assert {k: e.gemms for k, e in kinds.items()} == {
        "attention": 3,
        "expert": 3 * 4 * 3,
        "shared_expert": 3,
    }
    assert all(e.ratio > 1 and e.weight_rel_err > 0.01 for e in kinds.values())
    # A limit above the measured ratio flips the verdict: the verdict follows the measurement.
    assert audit(tmp_path, device="cpu", max_ratio=report.ratio * 1.01).verdict == "low-risk"


def test_ceil_factor_known_answer(tmp_path: Path) -> None:
    report = audit(_save(tmp_path, _model("x1.5", layers=1)), device="cpu", experts_per_layer=0)
    m = report.model
    assert m.pow2_fraction == 0.0
    assert math.isclose(m.mean_bits_lost, math.log2(4 / 3), rel_tol=1e-12)
    assert math.isclose(m.max_bits_lost, math.log2(4 / 3), rel_tol=1e-12)
    assert m.histogram == [0, 0, 0, m.blocks, 0, 0, 0, 0, 0, 0]  # r = 1.333 in [1.3, 1.4)
    assert {w.kind for layer in report.layers for w in layer.weights} == {
        "attention",
        "shared_expert",
    }


def test_sharded_checkpoint_and_fused_experts(tmp_path: Path) -> None:
    q0, s0 = _weight(INTER, H, 1, "fp32")
    q1, s1 = _weight(INTER, H, 2, "fp32")
    fused_q, fused_s = torch.stack([q0, q1]), torch.stack([s0, s1])
    # The weight in one shard, its scale in another, as HF sharding by size can leave them.
    key = "model.layers.0.mlp.experts.gate_up_proj"
    save_file({f"{key}.weight": fused_q}, str(tmp_path / "a.safetensors"))
    save_file({f"{key}.weight_scale": fused_s}, str(tmp_path / "b.safetensors"))
    (w,), unaudited, skipped = find_fp8_weights(tmp_path)
    assert unaudited == [] and skipped == []
    assert (w.kind, w.layer, w.shape) == ("expert", 0, (2, INTER, H))
    assert w.file.name == "a.safetensors" and w.scale_file.name == "b.safetensors"
    report = audit(tmp_path, device="cpu", experts_per_layer=1, seed=3)
    (measured,) = report.layers[0].weights
    expert = int(measured.name[-2])
    assert measured.name == f"{key}[{expert}]"
    assert report.model.blocks == 2 * 4
    # The same expert alone in a 2-D checkpoint measures the same: weight and scales paired.
    alone = {
        "model.layers.0.mlp.experts.0.gate_proj.weight": fused_q[expert].contiguous(),
        "model.layers.0.mlp.experts.0.gate_proj.weight_scale": fused_s[expert].contiguous(),
    }
    report = audit(_save(tmp_path / "alone", alone), device="cpu", experts_per_layer=1, seed=3)
    (single,) = report.layers[0].weights
    assert (single.weight_rel_err, single.out_err_fp32, single.out_err_e8m0) == (
        measured.weight_rel_err,
        measured.out_err_fp32,
        measured.out_err_e8m0,
    )


def test_duplicate_tensors_across_shards_need_the_index(tmp_path: Path) -> None:
    q, s = _weight(INTER, H, 1, "fp32")
    key = "model.layers.0.mlp.down_proj"
    save_file(
        {f"{key}.weight": q, f"{key}.weight_scale_inv": s}, str(tmp_path / "full.safetensors")
    )
    save_file(
        {f"{key}.weight": q, f"{key}.weight_scale_inv": s * 2}, str(tmp_path / "m1.safetensors")
    )
    with pytest.raises(AuditError, match="is in both full.safetensors and m1.safetensors"):
        audit(tmp_path, device="cpu")
    shard = {f"{key}.weight": "m1.safetensors", f"{key}.weight_scale_inv": "m1.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shard}))
    (w,), _, _ = find_fp8_weights(tmp_path)
    assert w.file.name == w.scale_file.name == "m1.safetensors"


def test_what_is_not_audited_is_listed(tmp_path: Path) -> None:
    tensors = _model("fp32", layers=1, experts=1)
    fused = torch.zeros(2, 128, 128).to(torch.float8_e4m3fn)
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = fused  # no '.weight': a format we skip
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(128, 128).to(torch.float8_e5m2)
    q, s = _weight(128, 256, 5, "fp32")  # K = 192 cannot be cut into 128-wide activation groups
    tensors["model.layers.0.self_attn.k_proj.weight"] = q[:, :192].contiguous()
    tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"] = s
    report = audit(_save(tmp_path, tensors), device="cpu")
    skipped = "not an e4m3 '*.weight' with a block scale"
    assert report.unaudited == [
        f"model.layers.0.mlp.experts.gate_up_proj (F8_E4M3): {skipped}",
        f"model.layers.0.self_attn.q_proj.weight (F8_E5M2): {skipped}",
        "model.layers.0.self_attn.k_proj.weight: GEMM not measured (K = 192 is not a multiple "
        "of 128)",
    ]
    assert "3 FP8 tensors or GEMMs not audited" in report.reason
    assert "## Not audited (3)" in to_markdown(report)
    assert len(report.layers[0].weights) == 2 + 3  # o_proj, shared, one expert's three


def test_nothing_measured_is_an_error_not_a_verdict(tmp_path: Path) -> None:
    tensors = {k: v for k, v in _model("pow2", layers=1, experts=2).items() if ".experts." in k}
    with pytest.raises(AuditError, match="no GEMM .* was measured, .* raise --experts-per-layer"):
        audit(_save(tmp_path, tensors), device="cpu", experts_per_layer=0)


def test_report_files_and_cli_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _save(tmp_path / "ckpt", _model("fp32", layers=2, experts=2))
    out = tmp_path / "out"
    assert main(["audit-e8m0", str(ckpt), "--out", str(out), "--device", "cpu"]) == 1  # at-risk
    assert "verdict at-risk" in capsys.readouterr().out
    data = json.loads((out / "report.json").read_text())
    assert data["verdict"] == "at-risk" and len(data["layers"]) == 2
    layer0 = data["layers"][0]
    assert layer0["out_err_e8m0"] > layer0["out_err_e8m0_act"] > layer0["out_err_fp32"] > 0
    text = (out / "report.md").read_text()
    assert "**Verdict: at-risk**" in text and "| 1 |" in text and "| attention | 2 |" in text
    assert data["by_kind"]["expert"]["gemms"] == 2 * 2 * 3
    assert (out / "ceil_factor.png").stat().st_size > 0 and "![ceil_factor]" in text
    pow2 = _save(tmp_path / "pow2", _model("pow2", layers=1, experts=1))
    assert main(["audit-e8m0", str(pow2), "--out", str(out), "--device", "cpu"]) == 0
    assert "verdict low-risk" in capsys.readouterr().out


def test_markdown_says_when_plots_are_missing(tmp_path: Path) -> None:
    report = audit(_save(tmp_path, _model("pow2", layers=1, experts=1)), device="cpu")
    assert "matplotlib is not installed" in to_markdown(report, plots=[])
    assert write_report(report, tmp_path / "r")[0].name == "report.md"


def _bad_scale(shape_or_value: tuple[int, ...] | float) -> dict[str, torch.Tensor]:
    q, s = _weight(INTER, H, 1, "fp32")
    if isinstance(shape_or_value, tuple):
        s = torch.ones(shape_or_value)
    else:
        s = s.clone()
        s[1, 0] = shape_or_value
    return {
        "model.layers.0.mlp.down_proj.weight": q,
        "model.layers.0.mlp.down_proj.weight_scale_inv": s,
    }


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda d: d / "missing", "does not exist"),
        (lambda d: d, "holds no *.safetensors files"),
        (
            lambda d: _file(d / "x.safetensors", b"not a safetensors file"),
            "holds no FP8 (float8_e4m3fn) '*.weight' tensors in the shards it could read: "
            "nothing to audit; skipped x.safetensors: shard not read: header length "
            "7021991845529153390 is over the 100000000-byte limit",
        ),
        (lambda d: _file(d / "x.bin", b""), "is not a .safetensors file"),
        (lambda d: _save(d, {"a.weight": torch.ones(2, 2)}), "holds no FP8"),
        (
            lambda d: _save(d, {"a.weight": torch.ones(128, 128).to(torch.float8_e4m3fn)}),
            "nothing to give a verdict on (0 FP8 weights, 1 skipped as malformed, "
            "experts_per_layer=4); skipped a.weight: no block scale (looked for "
            "a.weight_scale_inv or a.weight_scale)",
        ),
        (
            lambda d: _save(d, _bad_scale((1, 1))),
            "skipped model.layers.0.mlp.down_proj.weight: model.layers.0.mlp.down_proj."
            "weight_scale_inv is F32 (1, 1); a 128x128-block scale of model.layers.0.mlp."
            "down_proj.weight (256, 256) must be float32 (F32) (2, 2)",
        ),
        (lambda d: _save(d, _nan_code()), "model.layers.0.mlp.down_proj.weight: q must be finite"),
        (
            lambda d: _save(
                d, _model("pow2", 1, 1), {"quantization_config": {"weight_block_size": [128]}}
            ),
            "weight_block_size must be [bm, bk], got [128]",
        ),
    ],
    ids=[
        "missing",
        "empty-dir",
        "corrupt",
        "not-safetensors",
        "no-fp8",
        "only-weight-no-scale",
        "only-weight-scale-shape",
        "only-weight-nan-code",
        "bad-block",
    ],
)
def test_bad_checkpoints_are_refused_naming_what_is_wrong(
    tmp_path: Path, build: Callable[[Path], Path], message: str
) -> None:
    path = build(tmp_path)
    # AuditError for what the audit finds wrong, UntrustedFileError for a file it cannot read;
    # a checkpoint whose only weight is malformed has nothing left to audit
    with pytest.raises((AuditError, UntrustedFileError)) as info:
        audit(path, device="cpu")
    assert message in str(info.value)


def _nan_code() -> dict[str, torch.Tensor]:
    tensors = _bad_scale(1.0)
    q = tensors["model.layers.0.mlp.down_proj.weight"].view(torch.uint8).clone()
    q[3, 5] = 0x7F  # an e4m3 NaN code
    tensors["model.layers.0.mlp.down_proj.weight"] = q.view(torch.float8_e4m3fn)
    return tensors


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_cli_reports_a_bad_checkpoint_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit-e8m0", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- the two published figures --------------------------------------------------------------------


def _sparse(codes: dict[tuple[int, int], float]) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-block [128, 128] fp8 weight with the given codes (zeros elsewhere) and the scale
    1.5 * 2^-9, which requantizes to 2^-8: every code becomes 0.75 x itself, rounded to e4m3."""
    q = torch.zeros(128, 128)
    for at, code in codes.items():
        q[at] = code
    return q.to(torch.float8_e4m3fn), torch.full((1, 1), 1.5 * 2.0**-9)


def _hand(exact: list[int], requant: list[int]) -> tuple[float, float]:
    """The two figures of weights given in units of 2^-8, in the order the audit computes them;
    every sum is of integers, so float64 gets them exactly and the match is exact."""
    diff = math.sqrt(sum((a - b) ** 2 for a, b in zip(requant, exact, strict=True)))
    na, nb = math.sqrt(sum(a * a for a in requant)), math.sqrt(sum(b * b for b in exact))
    return diff / nb, 1 - sum(a * b for a, b in zip(requant, exact, strict=True)) / (na * nb)


# codes 416 and 16 at scale 1.5 * 2^-9 are 312 and 12 in units of 2^-8; requantized, 312 rounds
# to the e4m3 value 320 and 12 stays; codes 352 and 8: 264 rounds to 256, 6 stays.
O_PROJ = ({(0, 0): 416, (5, 7): 16}, [312, 12], [320, 12])
Q_PROJ = ({(3, 1): 352, (9, 9): 8}, [264, 6], [256, 6])


def test_requantization_figures_known_answer(tmp_path: Path) -> None:
    tensors = {}
    for mod, (codes, _, _) in (("o_proj", O_PROJ), ("q_proj", Q_PROJ)):
        q, s = _sparse(codes)
        tensors[f"model.layers.0.self_attn.{mod}.weight"] = q
        tensors[f"model.layers.0.self_attn.{mod}.weight_scale_inv"] = s
    report = audit(_save(tmp_path, tensors), device="cpu")
    got = {w.family: (w.weight_rel_err, w.weight_one_minus_cos) for w in report.sampled()}
    o, q = _hand(*O_PROJ[1:]), _hand(*Q_PROJ[1:])
    assert got == {"attention.o_proj": o, "attention.q_proj": q}
    (kind,) = report.requant_by("kind").values()
    assert (kind.tensors, kind.rel_frobenius_mean, kind.one_minus_cos_max) == (
        2,
        (q[0] + o[0]) / 2,
        max(o[1], q[1]),
    )
    assert set(report.requant_by("family")) == {"attention.o_proj", "attention.q_proj"}
    data = json.loads(report.to_json())
    assert data["requant_by_family"]["attention.o_proj"]["rel_frobenius_mean"] == o[0]
    assert data["published"]["rel_frobenius_mean"] == QWEN38_FLASH_NEXT.rel_frobenius_mean
    text = to_markdown(report)
    assert "## Weight requantization against the published figures" in text
    assert QWEN38_FLASH_NEXT.source in text and "0.02645 (0.02575-0.02715)" in text
    assert f"| model.layers.0.self_attn.o_proj | attention.o_proj | 128x128 | {o[0]:.5f} |" in text


@pytest.mark.parametrize(
    ("exact", "requant", "want"),
    [
        ([3.0, 4.0], [3.0, 4.0], (0.0, 0.0)),  # unchanged
        ([0.0, 0.0], [0.0, 0.0], (0.0, 0.0)),  # a zero weight stays zero
        ([3.0, 4.0], [0.0, 0.0], (1.0, 1.0)),  # everything lost
        ([3.0, 4.0], [-3.0, -4.0], (2.0, 2.0)),  # sign flipped: cos = -1
        ([3.0, 4.0], [4.0, 3.0], (math.sqrt(2) / 5, 1 - 24 / 25)),
    ],
    ids=["equal", "both-zero", "zeroed", "negated", "swapped"],
)
def test_requantization_error_edges(
    exact: list[float], requant: list[float], want: tuple[float, float]
) -> None:
    assert requantization_error(torch.tensor(requant), torch.tensor(exact)) == want


def test_gaussian_fp32_scales_land_on_the_published_figures(tmp_path: Path) -> None:
    """Gaussian weights with amax/448 scales requantize like the published real checkpoint:
    "about one more e4m3 rounding", flat across kinds. The model-wide mean falls inside the
    published per-tensor range, and 1 - cos is about half the square of the relative error (the
    error is noise, orthogonal to the weight), so it sits in [mean/2, 2 x mean] of the published."""
    report = audit(_save(tmp_path, _model("fp32", layers=2, experts=2)), device="cpu")
    p, every = QWEN38_FLASH_NEXT, report.requant()
    assert p.rel_frobenius_min <= every.rel_frobenius_mean <= p.rel_frobenius_max, every
    assert p.one_minus_cos_mean / 2 <= every.one_minus_cos_mean <= 2 * p.one_minus_cos_mean
    pow2 = audit(_save(tmp_path / "pow2", _model("pow2", layers=1, experts=1)), device="cpu")
    assert pow2.requant() == type(every)(5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


# -- malformed tensors are skipped, the rest audited ---------------------------------------------

O_PROJ_KEY = "model.layers.0.self_attn.o_proj"


def _spoil_scale(value: object) -> Callable[[dict[str, torch.Tensor]], None]:
    def spoil(tensors: dict[str, torch.Tensor]) -> None:
        s = tensors[f"{O_PROJ_KEY}.weight_scale_inv"]
        if isinstance(value, tuple):
            tensors[f"{O_PROJ_KEY}.weight_scale_inv"] = torch.ones(value)
        elif isinstance(value, torch.dtype):
            tensors[f"{O_PROJ_KEY}.weight_scale_inv"] = s.to(value)
        else:
            s[1, 0] = value

    return spoil


def _drop_scale(tensors: dict[str, torch.Tensor]) -> None:
    del tensors[f"{O_PROJ_KEY}.weight_scale_inv"]


def _nan_o_proj(tensors: dict[str, torch.Tensor]) -> None:
    q = tensors[f"{O_PROJ_KEY}.weight"].view(torch.uint8).clone()
    q[3, 5] = 0xFF  # an e4m3 NaN code
    tensors[f"{O_PROJ_KEY}.weight"] = q.view(torch.float8_e4m3fn)


def _flat_o_proj(tensors: dict[str, torch.Tensor]) -> None:
    tensors[f"{O_PROJ_KEY}.weight"] = tensors[f"{O_PROJ_KEY}.weight"].reshape(-1)


SCALE_SHAPE = (
    f"{O_PROJ_KEY}.weight_scale_inv is F32 (1, 1); a 128x128-block scale of {O_PROJ_KEY}.weight "
    "(256, 256) must be float32 (F32) (2, 2)"
)
RANGE = "scales outside the normal fp32 range [2^-126, 2^127] that UE8M0 spans (or not finite)"
# (id, how the o_proj of a one-layer checkpoint is spoiled, what its skipped entry says)
MALFORMED = [
    ("scale-shape", _spoil_scale((1, 1)), SCALE_SHAPE),
    ("scale-zero", _spoil_scale(0.0), f"holds 1 {RANGE}, first 0.0 at (1, 0)"),
    ("scale-negative", _spoil_scale(-0.5), f"holds 1 {RANGE}, first -0.5 at (1, 0)"),
    ("scale-nan", _spoil_scale(math.nan), f"holds 1 {RANGE}, first nan at (1, 0)"),
    ("scale-subnormal", _spoil_scale(1e-40), f"holds 1 {RANGE}"),
    ("scale-dtype-bf16", _spoil_scale(torch.bfloat16), "is BF16 (2, 2); a 128x128-block scale"),
    ("no-scale", _drop_scale, f"no block scale (looked for {O_PROJ_KEY}.weight_scale_inv or"),
    ("weight-1d", _flat_o_proj, f"FP8 weight {O_PROJ_KEY}.weight is (65536,), not [N, K]"),
    ("nan-code", _nan_o_proj, f"{O_PROJ_KEY}.weight: q must be finite"),
]


@pytest.mark.parametrize(
    ("spoil", "reason"), [r[1:] for r in MALFORMED], ids=[r[0] for r in MALFORMED]
)
def test_a_malformed_tensor_is_skipped_and_the_rest_audited(
    tmp_path: Path, spoil: Callable[[dict[str, torch.Tensor]], None], reason: str
) -> None:
    tensors = _model("fp32", layers=1, experts=1)
    good = audit(_save(tmp_path / "good", tensors), device="cpu")
    spoil(tensors)
    report = audit(_save(tmp_path / "bad", tensors), device="cpu")
    ((name, why),) = [(s.name, s.reason) for s in report.skipped]
    assert name == f"{O_PROJ_KEY}.weight" and reason in why, why
    # The rest is audited as it was: the same GEMMs but the o_proj, and none of its blocks.
    assert [w.name for w in report.sampled()] == [
        w.name for w in good.sampled() if w.name != O_PROJ_KEY
    ]
    assert report.model.blocks == good.model.blocks - 4
    assert "attention" not in report.by_kind() and report.verdict == "at-risk"
    assert "1 malformed tensors or shards skipped" in report.reason
    text = to_markdown(report)
    assert "## Skipped as malformed (1)" in text and f"- `{O_PROJ_KEY}.weight`: " in text
    assert json.loads(report.to_json())["skipped"] == [{"name": name, "reason": why}]


def test_an_unreadable_shard_is_skipped_and_the_others_audited(tmp_path: Path) -> None:
    """The o_proj in a shard of its own, truncated: the index says what it held; the weight whose
    scale it kept is listed too."""
    tensors = _model("fp32", layers=1, experts=1)
    alone = {k: tensors.pop(k) for k in list(tensors) if k.startswith(O_PROJ_KEY)}
    scale_key = "model.layers.0.mlp.shared_experts.down_proj.weight_scale_inv"
    alone[scale_key] = tensors.pop(scale_key)
    save_file(tensors, str(tmp_path / "a.safetensors"))
    save_file(alone, str(tmp_path / "b.safetensors"))
    weight_map = {k: "a.safetensors" for k in tensors} | {k: "b.safetensors" for k in alone}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    raw = (tmp_path / "b.safetensors").read_bytes()
    (tmp_path / "b.safetensors").write_bytes(raw[: len(raw) - 100])
    report = audit(tmp_path, device="cpu")
    assert [s.name for s in report.skipped] == [
        "b.safetensors",
        "model.layers.0.mlp.shared_experts.down_proj.weight",
    ]
    assert report.skipped[0].reason.startswith("shard not read: ") and "truncated" in (
        report.skipped[0].reason
    )
    assert report.skipped[
        1
    ].reason == f"its block scale {scale_key} is in b.safetensors, which " + ("could not be read")
    assert {w.kind for w in report.sampled()} == {"expert"} and len(report.sampled()) == 3


def test_cli_audits_a_checkpoint_with_one_odd_o_proj_scale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: one o_proj scale of the wrong shape no longer ends the audit with exit 2;
    the exit code is the verdict's (1 at-risk for fp32 scales, 0 low-risk for powers of two)."""
    for scales, code in (("fp32", 1), ("pow2", 0)):
        tensors = _model(scales, layers=2, experts=1)
        _spoil_scale((1, 1))(tensors)
        out = tmp_path / scales / "out"
        ckpt = _save(tmp_path / scales / "ckpt", tensors)
        assert main(["audit-e8m0", str(ckpt), "--out", str(out), "--device", "cpu"]) == code
        assert "1 malformed tensors or shards skipped" in capsys.readouterr().out
        assert f"- `{O_PROJ_KEY}.weight`: {SCALE_SHAPE}" in (out / "report.md").read_text()


def test_the_verdict_says_what_it_cannot_tell(tmp_path: Path) -> None:
    report = audit(_save(tmp_path, _model("fp32", layers=1, experts=1)), device="cpu")
    text = to_markdown(report)
    verdict = text[text.index("## Verdict") : text.index("## Weight requantization")]
    assert "**Verdict: at-risk**" in verdict and VERDICT_CAVEAT in verdict
    for claim in (
        "flags every checkpoint whose weight scales are not powers of two",
        "activation outliers",
        "task-level A/B",
    ):
        assert claim in VERDICT_CAVEAT
    assert json.loads(report.to_json())["verdict_caveat"] == VERDICT_CAVEAT
    doc = (Path(__file__).parents[2] / "docs" / "audit-e8m0.md").read_text()
    assert " ".join(VERDICT_CAVEAT.split()) in " ".join(doc.split())


# -- activation dumps -----------------------------------------------------------------------------


def _outliers(tokens: int, k: int, seed: int) -> torch.Tensor:
    """Activations unlike the synthetic probe: one channel per 128-group 100x the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    x[:, ::ACT_GROUP] *= 100.0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("m.layers.0.self_attn.o_proj", ["m.layers.0.self_attn.o_proj"]),
        (
            "m.layers.0.self_attn.k_proj",
            ["m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.qkv_proj"],
        ),
        ("m.layers.0.mlp.up_proj", ["m.layers.0.mlp.up_proj", "m.layers.0.mlp.gate_up_proj"]),
        (
            "m.layers.0.mlp.shared_experts.gate_proj",
            [
                "m.layers.0.mlp.shared_experts.gate_proj",
                "m.layers.0.mlp.shared_experts.gate_up_proj",
            ],
        ),
        ("m.layers.0.mlp.experts.7.w1", ["m.layers.0.mlp.experts.7.w1", "m.layers.0.mlp.experts"]),
        (
            "m.layers.0.mlp.experts.gate_up_proj",  # a fused [E, N, K] tensor
            ["m.layers.0.mlp.experts.gate_up_proj", "m.layers.0.mlp.experts"],
        ),
        ("m.layers.0.mlp.experts.7.down_proj", ["m.layers.0.mlp.experts.7.down_proj"]),
    ],
    ids=["exact", "qkv", "gate-up", "shared-gate-up", "fused-moe-w1", "fused-3d", "expert-down"],
)
def test_dump_names(module: str, names: list[str]) -> None:
    assert dump_names(module) == names


def test_activation_dumps_are_used_where_given(tmp_path: Path) -> None:
    tensors = _model("fp32", layers=2, experts=1)
    x_o, x_moe = _outliers(5, H, 1), _outliers(7, H, 2)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    save_file({"model.layers.0.self_attn.o_proj": x_o}, str(dumps / "a.safetensors"))
    save_file(
        {"model.layers.1.mlp.experts": x_moe, "not.a.layer": x_o}, str(dumps / "b.safetensors")
    )
    report = audit(_save(tmp_path / "ckpt", tensors), device="cpu", activations=dumps)
    used = {
        w.name: (w.activations, w.tokens) for w in report.sampled() if w.activations != "synthetic"
    }
    assert used == {
        "model.layers.0.self_attn.o_proj": ("model.layers.0.self_attn.o_proj", 5),
        "model.layers.1.mlp.experts.0.gate_proj": ("model.layers.1.mlp.experts", 7),
        "model.layers.1.mlp.experts.0.up_proj": ("model.layers.1.mlp.experts", 7),
    }
    assert all(w.tokens == report.tokens for w in report.sampled() if w.name not in used)
    assert report.activations_unused == ["not.a.layer"]
    # The o_proj's error is that of the dumped activations, computed here from the formats alone.
    q, s = tensors[f"{O_PROJ_KEY}.weight"], tensors[f"{O_PROJ_KEY}.weight_scale_inv"]
    w = dequantize_fp8_blocks(q, s, (128, 128)).double()
    x_q = dequantize_fp8_groups(*quantize_fp8_groups(x_o, ACT_GROUP, ScaleFmt.FLOAT32), ACT_GROUP)
    exact = x_o.double() @ w.T
    want = float(
        torch.linalg.vector_norm(x_q.double() @ w.T - exact) / torch.linalg.vector_norm(exact)
    )
    (o_proj,) = [e for e in report.sampled() if e.name == O_PROJ_KEY]
    assert o_proj.out_err_fp32 == want  # the same float64 operations, so exactly
    text = to_markdown(report)
    assert f"3 on the activation dumps in {dumps}, 7 on 64 synthetic tokens" in text
    assert "| dump `model.layers.1.mlp.experts` (7 rows) |" in text
    assert "## Activation dumps no measured GEMM read (1)" in text
    assert "3 of 10 GEMMs on activation dumps" in report.reason
    assert json.loads(report.to_json())["activations_path"] == str(dumps)


def _dump(tmp_path: Path, tensors: dict[str, torch.Tensor], name: str = "d.safetensors") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / name))
    return tmp_path / name


BAD_DUMPS = [
    # (id, dump builder into a directory, what the one-line error says)
    (
        "wrong-k",
        lambda d: _dump(d, {O_PROJ_KEY: _outliers(4, 128, 0)}),
        f"activation dump '{O_PROJ_KEY}' in d.safetensors is BF16 [4, 128]; as the input of "
        f"{O_PROJ_KEY}.weight [256, 256] it must be [T, 256] of F32, BF16, F16",
    ),
    (
        "3d",
        lambda d: _dump(d, {O_PROJ_KEY: _outliers(4, H, 0).reshape(2, 2, H)}),
        "is BF16 [2, 2, 256]; as the input of",
    ),
    (
        "int-dtype",
        lambda d: _dump(d, {O_PROJ_KEY: torch.ones(4, H, dtype=torch.int32)}),
        "is I32 [4, 256]; as the input of",
    ),
    ("no-tokens", lambda d: _dump(d, {O_PROJ_KEY: torch.ones(0, H)}), "is [0, 256]: no tokens"),
    (
        "nan",
        lambda d: _dump(d, {O_PROJ_KEY: torch.full((4, H), math.nan)}),
        f"activation dump '{O_PROJ_KEY}' in d.safetensors holds 1024 NaN/Inf values",
    ),
    (
        "names-no-layer",
        lambda d: _dump(d, {"layers.0.attn.out": _outliers(4, H, 0)}),
        "names a linear layer of the checkpoint (dumps layers.0.attn.out...",
    ),
    (
        "in-two-files",
        lambda d: (
            (
                _dump(d, {O_PROJ_KEY: _outliers(4, H, 0)}, "a.safetensors"),
                _dump(d, {O_PROJ_KEY: _outliers(4, H, 0)}, "b.safetensors"),
            )[0].parent
        ),
        f"activation dump '{O_PROJ_KEY}' is in both a.safetensors and b.safetensors",
    ),
    ("missing", lambda d: d / "nope", "does not exist"),
    ("empty-dir", lambda d: d, "holds no *.safetensors files"),
    ("corrupt", lambda d: _file(d / "x.safetensors", b"\x01" * 12), "x.safetensors: header length"),
]


@pytest.mark.parametrize(
    ("build", "message"), [r[1:] for r in BAD_DUMPS], ids=[r[0] for r in BAD_DUMPS]
)
def test_malformed_activation_dumps_are_refused_in_one_line(
    tmp_path: Path, build: Callable[[Path], Path], message: str
) -> None:
    ckpt = _save(tmp_path / "ckpt", _model("pow2", layers=1, experts=1))
    (tmp_path / "dumps").mkdir()
    with pytest.raises((AuditError, UntrustedFileError)) as info:
        audit(ckpt, device="cpu", activations=build(tmp_path / "dumps"))
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
