"""Tolerance: error metrics, the per-stage policy table, stage-by-stage comparison, and reports.

Depends on `moe_verify.spec` and torch only (never on the golden or the optimized path).
"""

from __future__ import annotations

from tolerance.compare import (
    CheckResult,
    ContractError,
    StageResult,
    Worst,
    compare,
    compare_stage,
    default_stages,
    keyed_values,
    not_compared,
)
from tolerance.policy import ANY, POLICY, Check, Limit, Rule, policy_for
from tolerance.report import Report, failure_message
from tolerance.stages.layouts import unpack_ue8m0

__all__ = [
    "ANY",
    "POLICY",
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
    "keyed_values",
    "policy_for",
    "not_compared",
    "unpack_ue8m0",
]
