"""`load_class`: a user's 'module:Class' (`--backend`), each way it can fail named, and
`class_spec`, its inverse."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moe_verify.common.loader import class_spec, load_class
from moe_verify.run.runner import resolve_backend
from optimized.backend import OptimizedBackend

pytestmark = pytest.mark.cpu


class Outer:
    class Inner(OptimizedBackend):
        name = "nested"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("no_colon", "backend: expected 'module:Class', got 'no_colon'"),
        (":Outer", "expected 'module:Class'"),
        ("tests.common.test_loader:", "expected 'module:Class'"),
        ("tests.common.test_loader:Outer.", "expected 'module:Class'"),
        ("tests.common.test_loader:1st", "expected 'module:Class'"),
        ("no_such_module_of_moe_verify:X", "cannot load it (import no_such_module_of_moe_verify"),
        ("tests.common.test_loader:Missing", "cannot load it (tests.common.test_loader has no"),
        ("tests.common.test_loader:Outer.Gone", "test_loader.Outer has no 'Gone'"),
        ("tests.common.test_loader:pytestmark", "expected a class, got MarkDecorator"),
    ],
    ids=[
        "no-colon",
        "no-module",
        "no-class",
        "trailing-dot",
        "not-a-name",
        "no-such-module",
        "missing",
        "missing-nested",
        "not-a-class",
    ],  # fmt: skip
)
def test_each_failure_is_a_value_error_naming_the_option_and_the_spec(
    spec: str, words: str
) -> None:
    with pytest.raises(ValueError, match="^backend") as exc:
        load_class(spec, "backend")
    assert words in str(exc.value)
    if ":" in spec and spec.split(":")[0]:
        assert repr(spec) in str(exc.value)


def test_a_spec_that_is_not_a_string_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="forward: expected 'module:Class', got 3"):
        load_class(3, "forward")  # type: ignore[arg-type]


def test_a_nested_class_loads_and_class_spec_is_its_inverse() -> None:
    spec = class_spec(Outer.Inner)
    assert spec == "tests.common.test_loader:Outer.Inner"
    assert load_class(spec, "backend") is Outer.Inner
    assert class_spec(Outer.Inner(engine="triton")) == spec  # an instance names its class


def test_a_module_in_the_current_directory_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "moe_verify_loader_probe.py").write_text("class Mine:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "moe_verify_loader_probe", raising=False)
    cls = load_class("moe_verify_loader_probe:Mine", "backend")
    assert cls.__name__ == "Mine" and str(tmp_path) in sys.path
    monkeypatch.delitem(sys.modules, "moe_verify_loader_probe")


def test_resolve_backend_builds_a_spec_and_a_class_alike() -> None:
    by_spec = resolve_backend(class_spec(Outer.Inner), "triton")
    by_class = resolve_backend(Outer.Inner, "triton")
    assert type(by_spec) is type(by_class) is Outer.Inner
    assert by_spec.engine == by_class.engine == "triton"
    with pytest.raises(ValueError, match="expected 'optimized', 'golden', 'vllm', .* or 'module:C"):
        resolve_backend("optimised")
