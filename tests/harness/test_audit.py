"""`moe-verify audit-e8m0` on synthetic checkpoints: known answers for the ceil factor, a
power-of-two checkpoint whose weight values E8M0 keeps, one with fp32 scales that it does not,
HF layouts (sharded, fused 3-D experts), and a clear error for every malformed input."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_verify.audit import AuditError, audit, find_fp8_weights, to_markdown, write_report
from moe_verify.cli import main
from moe_verify.safe_io import UntrustedFileError
from reference.formats import cast_to_fp8, quantize_fp8_blocks

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
    (w,), unaudited = find_fp8_weights(tmp_path)
    assert unaudited == []
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
    (w,), _ = find_fp8_weights(tmp_path)
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
    with pytest.raises(AuditError, match="no GEMM .* was measured .* raise --experts-per-layer"):
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
            "x.safetensors: header length 7021991845529153390 is over the 100000000-byte limit",
        ),
        (lambda d: _file(d / "x.bin", b""), "is not a .safetensors file"),
        (lambda d: _save(d, {"a.weight": torch.ones(2, 2)}), "holds no FP8"),
        (
            lambda d: _save(d, {"a.weight": torch.ones(128, 128).to(torch.float8_e4m3fn)}),
            "a.weight has no block scale (looked for a.weight_scale_inv or a.weight_scale)",
        ),
        (
            lambda d: _save(d, _bad_scale((1, 1))),
            "model.layers.0.mlp.down_proj.weight_scale_inv is F32 (1, 1); a 128x128-block scale "
            "of model.layers.0.mlp.down_proj.weight (256, 256) must be float32 (F32) (2, 2)",
        ),
        (
            lambda d: _save(d, _bad_scale(0.0)),
            "holds 1 scales outside the normal fp32 range [2^-126, 2^127] that UE8M0 spans (or "
            "not finite), first 0.0 at (1, 0)",
        ),
        (lambda d: _save(d, _bad_scale(math.nan)), "(or not finite), first nan at (1, 0)"),
        (lambda d: _save(d, _bad_scale(1e-40)), "outside the normal fp32 range [2^-126, 2^127]"),
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
        "no-scale",
        "scale-shape",
        "zero-scale",
        "nan-scale",
        "subnormal-scale",
        "nan-code",
        "bad-block",
    ],
)
def test_bad_checkpoints_are_refused_naming_what_is_wrong(
    tmp_path: Path, build: Callable[[Path], Path], message: str
) -> None:
    path = build(tmp_path)
    # AuditError for what the audit finds wrong, UntrustedFileError for a file it cannot read
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
