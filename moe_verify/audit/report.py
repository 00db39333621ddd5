"""The E8M0 audit's report files: markdown (verdict and what it can say, the published
requantization figures beside the measured ones, text histogram, per-layer, per-kind and
per-tensor tables, what was skipped), report.json, plots."""

from __future__ import annotations

from pathlib import Path

from moe_verify.audit.measure import (
    HIST_BINS,
    SYNTHETIC,
    VERDICT_CAVEAT,
    AuditReport,
    RequantFigures,
)


def _bar(count: int, most: int, width: int = 30) -> str:
    return "#" * round(width * count / most) if most else ""


def _probes(report: AuditReport) -> str:
    sampled = report.sampled()
    dumped = sum(1 for w in sampled if w.activations != SYNTHETIC)
    synthetic = (
        f"{report.tokens} synthetic tokens (N(0,1), 1 in 200 channels 30x)"
        if dumped < len(sampled)
        else ""
    )
    if report.activations_path is None:
        return f"on {synthetic}"
    real = f"{dumped} on the activation dumps in {report.activations_path}"
    return f"{real}, {len(sampled) - dumped} on {synthetic}" if synthetic else real


def _figures(f: RequantFigures) -> str:
    return (
        f"{f.tensors} | {f.rel_frobenius_mean:.5f} | {f.rel_frobenius_min:.5f} | "
        f"{f.rel_frobenius_max:.5f} | {f.one_minus_cos_mean:.3e} | {f.one_minus_cos_max:.3e}"
    )


def _requant_section(report: AuditReport) -> list[str]:
    """The two published figures per family, per kind and overall, with the published values
    beside every row, then every sampled tensor's."""
    p = report.published
    ref = (
        f"{p.rel_frobenius_mean:.5f} ({p.rel_frobenius_min:.5f}-{p.rel_frobenius_max:.5f}) | "
        f"{p.one_minus_cos_mean:.2e} (max {p.one_minus_cos_max:.2e})"
    )
    head = (
        "| tensors | rel. Frobenius mean | min | max | 1 - cos mean | max | published rel. "
        "Frobenius | published 1 - cos |"
    )
    rule = "| --- " * 9 + "|"
    lines = [
        "",
        "## Weight requantization against the published figures",
        "",
        "||W_e8m0 - W||_F / ||W||_F and 1 - cos(W_e8m0, W) of the dequantized weights (W with the "
        "checkpoint's block scales, W_e8m0 requantized to UE8M0 as vLLM does at load) over the "
        f"sampled tensors. Published beside them: {p.model}, {p.note} ({p.source}). A checkpoint "
        "with fp32 amax/448 scales should land near them; 0 means power-of-two scales (nothing "
        "re-rounded); a kind far above them is not the format's usual cost.",
        "",
        f"| family {head}",
        rule,
    ]
    lines += [f"| {k} | {_figures(f)} | {ref} |" for k, f in report.requant_by("family").items()]
    lines += ["", f"| kind {head}", rule]
    lines += [f"| {k} | {_figures(f)} | {ref} |" for k, f in report.requant_by("kind").items()]
    lines.append(f"| **all** | {_figures(report.requant())} | {ref} |")
    lines += [
        "",
        "### Per tensor",
        "",
        "| tensor | family | [N, K] | rel. Frobenius | 1 - cos | codes changed | activations |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in report.sampled():
        source = "synthetic" if w.activations == SYNTHETIC else f"dump `{w.activations}`"
        lines.append(
            f"| {w.name} | {w.family} | {w.shape[0]}x{w.shape[1]} | {w.weight_rel_err:.5f} | "
            f"{w.weight_one_minus_cos:.3e} | {w.codes_changed:.1%} | {source} ({w.tokens} rows) |"
        )
    return lines


def to_markdown(report: AuditReport, plots: list[str] | None = None) -> str:
    m = report.model
    lines = [
        f"# E8M0 audit: {report.checkpoint}",
        "",
        f"model_type {report.model_type or '-'}; {report.fp8_weights} FP8 weight tensors in "
        f"{report.block[0]}x{report.block[1]} blocks; {len(report.sampled())} GEMMs sampled "
        f"(every non-expert weight, {report.experts_per_layer} experts per layer), "
        f"{_probes(report)}; {len(report.skipped)} malformed tensors or shards skipped.",
        "",
        "## Verdict",
        "",
        f"**Verdict: {report.verdict}**: {report.reason}.",
        "",
        f"What it can say: {VERDICT_CAVEAT}",
        *_requant_section(report),
        "",
        f"## Ceil factor r = ceil_ue8m0(s) / s of all {m.blocks} weight blocks",
        "",
        f"Already powers of two: {m.pow2_fraction:.2%}; bits lost log2(r): mean "
        f"{m.mean_bits_lost:.4f}, max {m.max_bits_lost:.4f} (0 for power-of-two scales, 0.5 for "
        "scales spread evenly on a log scale).",
        "",
        "| r | blocks | share | |",
        "| --- | --- | --- | --- |",
    ]
    most = max(m.histogram) if m.histogram else 0
    for i, count in enumerate(m.histogram):
        lo, hi = 1 + i / HIST_BINS, 1 + (i + 1) / HIST_BINS
        share = count / m.blocks if m.blocks else 0.0
        lines.append(f"| [{lo:.1f}, {hi:.1f}) | {count} | {share:.1%} | `{_bar(count, most)}` |")
    lines += [
        "",
        "## Per layer",
        "",
        "Output errors are ||Y - X W^T|| / ||X W^T|| against the exact float64 product with the "
        "checkpoint's weights: `fp32` quantizes the activations with fp32 scales, `E8M0 act` "
        "with ceil-UE8M0 scales, `E8M0` also requantizes the weight; ratio = E8M0 / E8M0 act. "
        "Layer values are the RMS over the layer's sampled GEMMs. A block whose largest code "
        "is <= 224 requantizes to half the scale and twice the codes: codes change, values "
        "do not.",
        "",
        "| layer | blocks | pow2 | mean bits lost | GEMMs | fp32 | E8M0 act | E8M0 | ratio "
        "| worst GEMM (E8M0) | its weight err | codes changed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for layer in report.layers:
        s = layer.scales
        worst = max(layer.weights, key=lambda w: w.out_err_e8m0, default=None)
        tail = (
            f"{worst.name} | {worst.weight_rel_err:.3g} | {worst.codes_changed:.1%}"
            if worst
            else "- | - | -"
        )
        lines.append(
            f"| {'-' if layer.layer is None else layer.layer} | {s.blocks} | "
            f"{s.pow2_fraction:.1%} | {s.mean_bits_lost:.4f} | {len(layer.weights)} | "
            f"{layer.out_err_fp32:.4g} | {layer.out_err_e8m0_act:.4g} | {layer.out_err_e8m0:.4g} "
            f"| {layer.ratio:.3f} | {tail} |"
        )
    lines += [
        "",
        "## By weight kind",
        "",
        "| kind | GEMMs | fp32 | E8M0 act | E8M0 | ratio | weight err |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, e in report.by_kind().items():
        lines.append(
            f"| {kind} | {e.gemms} | {e.out_err_fp32:.4g} | {e.out_err_e8m0_act:.4g} | "
            f"{e.out_err_e8m0:.4g} | {e.ratio:.3f} | {e.weight_rel_err:.3g} |"
        )
    lines += [
        "",
        "## Compounded over the model",
        "",
        "Root-sum-square of the per-layer output errors (independent errors adding up along the "
        f"residual stream): fp32 scales {report.compounded_fp32:.4g}, E8M0 activations "
        f"{report.compounded_e8m0_act:.4g}, full E8M0 {report.compounded_e8m0:.4g}; requantizing "
        f"the weights multiplies E8M0's error by **{report.ratio:.3f}x** (limit "
        f"{report.max_ratio:g}x; `at-risk` above it: a candidate for vLLM's E8M0 auto-disable "
        "list, to confirm with a task A/B). Requantization re-rounds every weight whose scale "
        "is not a power of two, so such checkpoints exceed the default limit; compare models "
        "by the ratio and the compounded errors, whose activation part depends on the "
        "activations (the synthetic probe is the same for every checkpoint).",
    ]
    if report.skipped:
        lines += [
            "",
            f"## Skipped as malformed ({len(report.skipped)})",
            "",
            "Left out of every figure above; the rest of the checkpoint was audited.",
            "",
        ]
        lines += [f"- `{s.name}`: {s.reason}" for s in report.skipped]
    if report.unaudited:
        lines += ["", f"## Not audited ({len(report.unaudited)})", ""]
        lines += [f"- {entry}" for entry in report.unaudited]
    if report.activations_unused:
        lines += [
            "",
            f"## Activation dumps no measured GEMM read ({len(report.activations_unused)})",
            "",
            "Their layer's weights were not sampled or not audited, or their name matches no "
            "linear layer (docs/audit-e8m0.md gives the naming).",
            "",
        ]
        lines += [f"- `{key}`" for key in report.activations_unused]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    elif plots is not None:
        lines += ["", "Plots skipped: matplotlib is not installed (`pip install matplotlib`)."]
    return "\n".join(lines) + "\n"


def write_plots(report: AuditReport, out_dir: Path) -> list[str]:
    """PNG plots of the ceil factors and the per-layer errors; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    edges = [1 + i / HIST_BINS for i in range(HIST_BINS)]
    ax.bar(edges, report.model.histogram, width=1 / HIST_BINS, align="edge", edgecolor="white")
    ax.set_xlabel("ceil factor r = ceil_ue8m0(s) / s")
    ax.set_ylabel("weight blocks")
    ax.set_title(f"Range lost to E8M0 scales, per {report.block[0]}x{report.block[1]} block")
    path = out_dir / "ceil_factor.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    files.append(str(path))

    measured = [layer for layer in report.layers if layer.weights]
    if measured:
        xs = [layer.layer if layer.layer is not None else -1 for layer in measured]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(xs, [layer.out_err_fp32 for layer in measured], "o-", label="fp32 scales")
        ax.plot(xs, [layer.out_err_e8m0_act for layer in measured], "^-", label="E8M0 activations")
        ax.plot(xs, [layer.out_err_e8m0 for layer in measured], "s-", label="E8M0")
        ax.set_xlabel("layer (-1: outside the numbered layers)")
        ax.set_ylabel("relative GEMM output error (RMS)")
        ax.set_title("Per-layer output error")
        ax.set_ylim(bottom=0)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
        path = out_dir / "layer_error.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(str(path))
    return files


def write_report(report: AuditReport, out_dir: Path) -> list[Path]:
    """report.md, report.json and the plots into out_dir; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(report, out_dir)
    (out_dir / "report.md").write_text(to_markdown(report, plots))
    (out_dir / "report.json").write_text(report.to_json())
    return [out_dir / "report.md", out_dir / "report.json", *map(Path, plots)]
