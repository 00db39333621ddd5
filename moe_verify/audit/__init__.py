"""`moe-verify audit-e8m0 CHECKPOINT`: what E8M0 (power-of-two) scales cost a model's FP8 weights.

checkpoint.py   reads an HF safetensors checkpoint's FP8 weights and block scales: what is wrong
                with the checkpoint as a whole is an AuditError naming the file or tensor (and a
                file it cannot read safely an UntrustedFileError), a malformed tensor or shard a
                Skipped entry the report lists
activations.py  the activation dumps of `--activations` (a vLLM run's linear-layer inputs) and
                the names that tie them to the checkpoint's weights
published.py    the requantization figures published for a real checkpoint, with their source
measure.py      the measurements and the verdict (`audit` -> AuditReport); its docstring says what
                is measured and why, and where DEFAULT_MAX_RATIO comes from
report.py       report.md, report.json and plots (matplotlib imported only to plot)
"""

from __future__ import annotations

from moe_verify.audit.activations import ActivationDumps, dump_names
from moe_verify.audit.checkpoint import AuditError, FP8Weight, Skipped, find_fp8_weights
from moe_verify.audit.measure import (
    DEFAULT_MAX_RATIO,
    VERDICT_CAVEAT,
    AuditReport,
    LayerAudit,
    RequantFigures,
    audit,
    requantization_error,
)
from moe_verify.audit.published import QWEN38_FLASH_NEXT, PublishedRequant
from moe_verify.audit.report import to_markdown, write_report

__all__ = [
    "DEFAULT_MAX_RATIO",
    "QWEN38_FLASH_NEXT",
    "VERDICT_CAVEAT",
    "ActivationDumps",
    "AuditError",
    "AuditReport",
    "FP8Weight",
    "LayerAudit",
    "PublishedRequant",
    "RequantFigures",
    "Skipped",
    "audit",
    "dump_names",
    "find_fp8_weights",
    "requantization_error",
    "to_markdown",
    "write_report",
]
