"""tests/gpu/memory_stages_breakdown.py, the measurement script for permute and act_quant, runs on
tiny shapes under the interpreter, and its variants that claim the shipped kernels' results
produce them (a script that rots is found here, not on a leased GPU)."""

from __future__ import annotations

from tests.gpu import memory_stages_breakdown as breakdown


def test_permute_variants_run_and_the_row_ordered_copy_agrees() -> None:
    r: breakdown.Results = {}
    breakdown.permute(r, tokens=16, hidden=256, k=2, experts=4, align=16)
    assert r["row-ordered copy: live rows equal ep_scatter's"] is True
    assert r["permute rows (live, m_sum)"] == [32, 96]


def test_act_quant_variants_run_and_the_exact_ones_agree() -> None:
    r: breakdown.Results = {}
    breakdown.act_quant(r, rows_per_expert=8, experts=4, inter=256, align=8)
    shapes = [k for k in r if k.endswith("codes and scales as shipped")]
    assert len(shapes) == 4 and all(r[k] is True for k in shapes)
    exact = [
        k[: -len(": meant to be exact")] for k in r if k.endswith("meant to be exact") and r[k]
    ]
    assert len(exact) == 2
    for name in exact:
        assert [r[k] for k in r if k.startswith(name + ": codes")] == [0, 0, 0], name
    # the diagnostic without exp or division changes codes: the comparison can tell
    assert r["act_quant float32, no exp, no division (diagnostic): codes that differ from shipped"]
