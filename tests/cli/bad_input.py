"""The bad-input catalogue (issue 12): every public function a user calls refuses what it cannot
run, with a ValueError or TypeError naming the argument and the value it got.

Each row is one bad input, its own test item (`-k topology-parse` picks a group). A row names the
exception type it expects and the strings its message must contain: the argument and the actual
value. A generic error (RuntimeError, AssertionError, IndexError, KeyError), a silent acceptance
or a message that does not say what was wrong fails the row. Rows build only tiny tensors and run
no kernel, so the whole catalogue takes about a second.

The rows live beside what they call: test_bad_problems.py (the vocabulary: MoEProblem, Topology,
Activation, from_dict, Mode), test_bad_inputs.py (inputs, pre-flight, presets),
test_bad_kernel_args.py (the kernel wrappers, M_sum bounds, quantizers, DeepGEMM calls) and
test_bad_api_calls.py (verify, the golden's helpers, the comparison's entry points). This module
holds what they share: the row, its check and the tiny problem.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from moe_verify.spec import MoEProblem

TINY = dict(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2)
GROUPED = dict(routing="grouped", num_experts=8, num_expert_group=4, topk_group=2)
# Errors that say nothing about the input: never an acceptable answer to a bad argument.
GENERIC = (RuntimeError, AssertionError, IndexError, KeyError, AttributeError)


def tiny(**changes: object) -> MoEProblem:
    return MoEProblem(**{**TINY, **changes})


@dataclass(frozen=True)
class Bad:
    """One bad input: `call` must raise `exc` with every string of `needles` in its message."""

    id: str
    call: Callable[[], object]
    exc: type[Exception]
    needles: tuple[str, ...]


def bad(id: str, call: Callable[[], object], exc: type[Exception], *needles: str) -> Bad:
    return Bad(id, call, exc, needles)


def params(rows: list[Bad]) -> list[object]:
    """The rows as test items, each named by its id."""
    return [pytest.param(r, id=r.id) for r in rows]


def check_refused_clearly(row: Bad) -> None:
    """`row.call()` raises the row's exception type, not a generic one, naming its needles."""
    with pytest.raises(Exception) as info:
        row.call()
    exc = info.value
    if isinstance(exc, GENERIC):
        pytest.fail(f"{row.id}: a generic {type(exc).__name__}: {exc}")
    if not isinstance(exc, row.exc):
        pytest.fail(f"{row.id}: expected {row.exc.__name__}, got {type(exc).__name__}: {exc}")
    message = str(exc)
    missing = [n for n in row.needles if n not in message]
    if missing:
        pytest.fail(f"{row.id}: the message does not name {missing}: {message!r}")
