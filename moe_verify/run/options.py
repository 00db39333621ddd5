"""`RunOptions`: how a case runs (which backend, mode and engine; workspaces and poisons; what the
GEMMs are held to; where it is compared; its deadline; where dumps and plots go; an invariance),
one checked value from the command line (moe_verify/args.py `run_options`) or the Python call
(`verify(problem, options=RunOptions(...))`) to every place that runs a case: `verify`, `replay`,
a sweep in process or in its worker, the torchrun ranks, and the dump that records it.

Each field is checked when the value is built, with an error naming the field and the value, and
so are the combinations that would be silently ignored otherwise. `to_dict` / `from_dict` carry
it as JSON (a dump's run.json, a sweep worker's request). `check_launcher` refuses what a
launcher cannot honour: a torchrun rank takes its options as flags, and a sweep's worker as
JSON, so neither takes a backend instance; torchrun ranks also run no workspaces, poisons,
plots, invariances, or comparisons on another device.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_verify.common.loader import class_spec
from moe_verify.spec import (
    INVARIANCE_KINDS,
    STAGES,
    Engine,
    GemmRecipe,
    Mode,
    check_bool,
    check_device,
    check_enum,
    check_output_dir,
)

if TYPE_CHECKING:  # the protocol imports torch, and the CLI checks its flags without it
    from moe_verify.spec import Backend

# The backends `--backend` names; anything else is 'module:Class' (moe_verify/run/runner.py).
BACKEND_NAMES = ("optimized", "golden", "vllm", "sglang", "lmdeploy")
# How a case is started: "none" runs it here (every rank emulated in this process), "isolated"
# in a sweep's worker process (moe_verify/sweep/worker.py), "torchrun" one process per rank.
LAUNCHERS = ("none", "isolated", "torchrun")
# The flag of `moe-verify run` that sets each field, as a refusal names it.
FLAGS = {
    "backend": "--backend",
    "mode": "--mode",
    "engine": "--engine",
    "workspace": "--workspace",
    "poison": "--poison",
    "padding_poison": "--poison-padding",
    "gemm_recipe": "--gemm-recipe",
    "compare_device": "--compare-on",
    "case_timeout_s": "--case-timeout",
    "dump_dir": "--dump-dir",
    "plot_dir": "--plot",
    "invariance": "--invariance",
}
# What a launcher cannot honour (fields that must keep their defaults): a torchrun rank builds
# its backend plain and compares on its own device; plots and invariances are not wired there.
_CANNOT: dict[str, tuple[str, ...]] = {
    "none": (),
    "isolated": (),
    "torchrun": ("workspace", "poison", "plot_dir", "compare_device", "invariance"),
}
_LAUNCHER_NAMES = {
    "none": "--launcher none",
    "isolated": "an isolated sweep",
    "torchrun": "--launcher torchrun",
}
# What an invariance run cannot honour: it builds both tested backends itself, dumps nothing and
# draws nothing, and its golden is the plain one.
_NOT_WITH_INVARIANCE = (
    "workspace",
    "poison",
    "plot_dir",
    "dump_dir",
    "padding_poison",
    "gemm_recipe",
)


@dataclass(frozen=True)
class RunOptions:
    """How a case runs; each field is checked (and normalized) when the value is built.

    backend         "optimized", "golden", "vllm", "module:Class", a Backend class (built here,
                    with the engine, workspace and poison), or a Backend instance (run as built)
    mode            "isolated", "chained" or "both" (moe_verify/run/verify.py)
    engine          the optimized backend's GEMM engine (auto picks one that can run)
    workspace       the optimized backend reuses its buffers, with guard bands checked
    poison          () or one or two bytes the buffers are filled with before each use; two: the
                    tested side runs under each, and the two runs must agree bit for bit
    padding_poison  the golden's padding rows poisoned before isolated stages read them (needs
                    isolated mode: moe_verify/run/poison.py)
    gemm_recipe     what gemm1 / gemm2 are held to; None: automatic (moe_verify/run/sm90_chain.py)
    compare_device  where stages are compared (e.g. "cpu"); None: the golden's device
    case_timeout_s  the whole case's deadline in seconds (moe_verify/run/contain.py); None: no limit
    dump_dir        on failure, the inputs and every trace go here, for `replay`
    plot_dir        a heatmap of each failing stage goes here (moe_verify/report/plot.py)
    invariance      run the tested side a second time with only this setting changed
                    (INVARIANCE_KINDS, moe_verify/run/invariance.py)
    """

    backend: str | type | Backend = "optimized"
    mode: str = "isolated"
    engine: Engine = Engine.AUTO
    workspace: bool = False
    poison: tuple[int, ...] = ()
    padding_poison: bool = False
    gemm_recipe: GemmRecipe | None = None
    compare_device: str | None = None
    case_timeout_s: float | None = None
    dump_dir: Path | None = None
    plot_dir: Path | None = None
    invariance: str | None = None

    def __post_init__(self) -> None:
        recipe = self.gemm_recipe
        checked = {
            "backend": check_backend(self.backend),
            "mode": check_mode(self.mode),
            "engine": check_enum("engine", self.engine, Engine),
            "workspace": check_bool("workspace", self.workspace),
            "poison": check_poison(self.poison),
            "padding_poison": check_bool("padding_poison", self.padding_poison),
            "gemm_recipe": None
            if recipe is None
            else check_enum("gemm_recipe", recipe, GemmRecipe),
            # A device torch parses, as a string; whether this machine has it is `verify`'s
            # check (a dump's options may name another machine's).
            "compare_device": None
            if self.compare_device is None
            else str(check_device("compare_device", self.compare_device)),
            "case_timeout_s": check_timeout(self.case_timeout_s),
            "dump_dir": None if self.dump_dir is None else check_dir("dump_dir", self.dump_dir),
            "plot_dir": None if self.plot_dir is None else check_dir("plot_dir", self.plot_dir),
            "invariance": None if self.invariance is None else check_invariance(self.invariance),
        }
        for name, value in checked.items():  # frozen: normalized values are set once, here
            object.__setattr__(self, name, value)
        self._check_together()

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The modes `mode` runs, isolated first."""
        return Mode.select(self.mode)

    def _check_together(self) -> None:
        """Combinations that would otherwise be silently ignored."""
        if self.padding_poison and Mode.ISOLATED not in self.modes:
            raise ValueError(
                "padding_poison: it poisons the golden's upstream, which only isolated mode feeds "
                f"to the tested stages; mode {self.mode!r} would run unpoisoned (use 'isolated' or "
                "'both')"
            )
        if self.invariance is not None:
            given = self._changed(_NOT_WITH_INVARIANCE)
            if given:
                raise ValueError(f"{', '.join(given)}: not supported with --invariance")

    def _changed(self, names: tuple[str, ...]) -> list[str]:
        """The flags of the fields among `names` that differ from their defaults."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [FLAGS[n] for n in names if getattr(self, n) != defaults[n]]

    def check_launcher(self, launcher: str) -> None:
        """A ValueError naming what `launcher` (LAUNCHERS) cannot honour of these options: its
        flags, or a backend instance where the case runs in other processes."""
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher: expected one of {list(LAUNCHERS)}, got {launcher!r}")
        if launcher != "none" and is_instance(self.backend):
            raise ValueError(
                f"backend {self.backend!r}: {_LAUNCHER_NAMES[launcher]} runs the case in another "
                f"process, which cannot take an instance; pass it by name "
                f"({class_spec(self.backend)!r}) or as a class"
            )
        refused = self._changed(_CANNOT[launcher])
        if refused:
            if "--compare-on" in refused:  # as the flag says it
                refused[refused.index("--compare-on")] = f"--compare-on {self.compare_device}"
            names = ", ".join(refused)
            raise ValueError(f"{names}: not supported with {_LAUNCHER_NAMES[launcher]}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields; a backend class or instance as its 'module:Class'."""
        backend = self.backend if isinstance(self.backend, str) else class_spec(self.backend)
        return {
            "backend": backend,
            "mode": self.mode,
            "engine": self.engine.value,
            "workspace": self.workspace,
            "poison": list(self.poison),
            "padding_poison": self.padding_poison,
            "gemm_recipe": None if self.gemm_recipe is None else self.gemm_recipe.value,
            "compare_device": self.compare_device,
            "case_timeout_s": self.case_timeout_s,
            "dump_dir": None if self.dump_dir is None else str(self.dump_dir),
            "plot_dir": None if self.plot_dir is None else str(self.plot_dir),
            "invariance": self.invariance,
        }

    @classmethod
    def from_dict(cls, data: object) -> RunOptions:
        """The options `to_dict` wrote, read as untrusted JSON (a dump may come from anyone's
        bug report): a ValueError naming the field for a value of the wrong JSON type or an
        unknown field. A field left out (a dump of an older version records fewer) or null
        takes its default; the backend must be there."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object of run options, got {type(data).__name__}")
        unknown = sorted(set(data) - set(FLAGS))
        if unknown:
            raise ValueError(
                f"unknown run option(s) {unknown} (written by a newer moe-verify?); "
                f"known: {list(FLAGS)}"
            )
        for key, value in data.items():
            _check_json(key, value)
        if data.get("backend") is None:
            raise ValueError("'backend' must be a string: the run options record no backend")
        return cls(**{k: v for k, v in data.items() if v is not None})


def options_of(
    call: str,
    options: RunOptions | None,
    fields: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
) -> RunOptions:
    """What `call` runs with: `options`, or a RunOptions of the keyword arguments `fields` over
    `defaults` (the form of the call before RunOptions); a ValueError when both are given."""
    if options is None:
        unknown = sorted(set(fields) - set(FLAGS))
        if unknown:
            raise TypeError(f"{call}: unknown option(s) {unknown}; RunOptions has {list(FLAGS)}")
        return RunOptions(**{**(defaults or {}), **fields})
    if not isinstance(options, RunOptions):
        raise TypeError(f"{call}: options: expected a RunOptions, got {type(options).__name__}")
    if fields:
        raise ValueError(
            f"{call}: options=RunOptions(...) and the keyword arguments {sorted(fields)} both "
            "given; pass the options only (dataclasses.replace(options, ...) changes some)"
        )
    return options


# -- the checks of single fields --------------------------------------------------------------


def is_instance(backend: object) -> bool:
    """A backend already built (neither a spec string nor a class)."""
    return not isinstance(backend, (str, type))


def check_backend(backend: object) -> str | type | Backend:
    """A name of BACKEND_NAMES or 'module:Class', a class, or an object of the stage protocol
    (a `name` and one method per stage, moe_verify/spec/protocol.py)."""
    if isinstance(backend, str):
        if backend not in BACKEND_NAMES and ":" not in backend:
            raise ValueError(
                f"backend: expected {', '.join(repr(n) for n in BACKEND_NAMES)} or "
                f"'module:Class', got {backend!r}"
            )
        return backend
    from moe_verify.spec import missing_stages  # the protocol imports torch: not for a name

    if isinstance(backend, type) or (
        hasattr(backend, "name") and not missing_stages(backend, STAGES)
    ):
        return backend
    raise TypeError(
        "backend: expected a name, 'module:Class', a Backend class or instance, got "
        f"{backend!r:.80} ({type(backend).__name__})"
    )


def check_mode(mode: object) -> str:
    """'isolated', 'chained' or 'both', as a plain string."""
    if not isinstance(mode, str):
        raise TypeError(f"mode: expected 'isolated', 'chained' or 'both', got {mode!r}")
    Mode.select(mode)
    return str(mode)


def check_poison(poison: object) -> tuple[int, ...]:
    """None, one byte or a sequence of one or two distinct bytes, each in 0..255, as a tuple."""
    if poison is None:
        return ()
    if isinstance(poison, int):
        values: tuple = (poison,)
    elif isinstance(poison, (list, tuple)):
        values = tuple(poison)
    else:
        raise TypeError(f"poison: expected a byte or a list of one or two, got {poison!r:.80}")
    if len(values) > 2:
        raise ValueError(f"poison: expected one or two bytes, got {len(values)}: {values}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 0xFF:
            raise ValueError(f"poison: expected a byte in 0..255, got {v!r}")
    if len(values) == 2 and values[0] == values[1]:
        raise ValueError(f"poison: a two-poison run needs two different bytes, got {values}")
    return values


def check_timeout(seconds: object) -> float | None:
    """A finite number of seconds >= 0; 0 and None: no limit (None)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"case_timeout_s: expected seconds >= 0 or None, got {seconds!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"case_timeout_s: expected >= 0 (0: no limit), got {seconds!r}")
    return float(seconds) or None


def check_dir(name: str, path: object) -> Path:
    """A path (str or os.PathLike) of a directory that can be made and written, as a Path:
    checked before the run, so a report is never lost to a dump or plot directory that cannot
    be written."""
    if isinstance(path, str) and not path:
        raise ValueError(f"{name}: expected a directory path, got ''")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a directory path, got {path!r}")
    check_output_dir(name, path)
    return Path(path)


def check_invariance(kind: object) -> str:
    """A setting of INVARIANCE_KINDS whose second value `invariance_pair` builds (two poisons
    are `poison`'s)."""
    known = [k for k in INVARIANCE_KINDS if k != "poison"]
    if kind not in known:
        raise ValueError(
            f"invariance: expected one of {known} (two poisons: --workspace --poison A "
            f"--poison B), got {kind!r}"
        )
    return str(kind)


# -- JSON shapes (from_dict) --------------------------------------------------------------------

_STRINGS = ("backend", "mode", "engine", "gemm_recipe", "compare_device", "dump_dir", "plot_dir",
            "invariance")  # fmt: skip
_BOOLS = ("workspace", "padding_poison")


def _check_json(key: str, value: object) -> None:
    """`value` has the JSON type field `key` is written as (null: the default)."""
    if value is None:
        return
    if key in _STRINGS and not isinstance(value, str):
        raise ValueError(f"'{key}' must be a string, got {value!r:.80}")
    if key in _BOOLS and not isinstance(value, bool):
        raise ValueError(f"'{key}' must be true or false, got {value!r:.80}")
    if key == "poison" and not (
        isinstance(value, list)
        and len(value) <= 2
        and all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in value)
    ):
        raise ValueError(
            f"'poison' must be a list of at most two bytes (0..255), got {value!r:.80}"
        )
    if key == "case_timeout_s" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"'case_timeout_s' must be a number of seconds, got {value!r:.80}")
