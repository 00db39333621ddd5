"""Tolerance: error metrics, the per-stage policy table, stage-by-stage comparison, and reports.

Depends on `moe_verify.spec` and torch only (never on the golden or the optimized path).
"""

from __future__ import annotations

from tolerance.compare import (
    ERROR_KEY,
    SKIP_KEY,
    CheckResult,
    ContractError,
    StageResult,
    Worst,
    compare,
    compare_stage,
    default_stages,
    not_compared,
    unpack_ue8m0,
)
from tolerance.policy import ANY, POLICY, Check, Limit, Rule, policy_for
from tolerance.report import Report, failure_message

__all__ = [
    "ANY",
    "POLICY",
    "ERROR_KEY",
    "SKIP_KEY",
    "Check",
    "CheckResult",
    "ContractError",
    "Limit",
    "Report",
    "Rule",
    "StageResult",
    "Worst",
    "compare",
    "compare_stage",
    "default_stages",
    "failure_message",
    "policy_for",
    "not_compared",
    "unpack_ue8m0",
]
