"""Tolerance: error metrics, the per-stage policy table, stage-by-stage comparison, and reports.

Depends on `moe_verify.spec` and torch only (never on the golden or the optimized path).
"""

from __future__ import annotations

# moe_verify first: its __init__ imports moe_verify.verify, which imports tolerance.compare; were
# tolerance.compare first, it would reach moe_verify.spec mid-import and find itself half-built.
import moe_verify  # noqa: F401
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
)
from tolerance.layouts import unpack_ue8m0
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
