"""`moe-verify audit-e8m0 CHECKPOINT`: what E8M0 (power-of-two) scales cost a model's FP8 weights.

checkpoint.py  reads an HF safetensors checkpoint's FP8 weights and block scales, refusing
               anything malformed with the tensor's name (AuditError) and any file it cannot
               read safely with the file's (moe_verify.safe_io.UntrustedFileError)
measure.py     the measurements and the verdict (`audit` -> AuditReport); its docstring says what
               is measured and why, and where DEFAULT_MAX_RATIO comes from
report.py      report.md, report.json and plots (matplotlib imported only to plot)
"""

from __future__ import annotations

from moe_verify.audit.checkpoint import AuditError, FP8Weight, find_fp8_weights
from moe_verify.audit.measure import DEFAULT_MAX_RATIO, AuditReport, LayerAudit, audit
from moe_verify.audit.report import to_markdown, write_report

__all__ = [
    "DEFAULT_MAX_RATIO",
    "AuditError",
    "AuditReport",
    "FP8Weight",
    "LayerAudit",
    "audit",
    "find_fp8_weights",
    "to_markdown",
    "write_report",
]
