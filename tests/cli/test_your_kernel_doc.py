"""docs/your-kernel.md runs as written: from an empty scratch directory outside the checkout, with
no PYTHONPATH (the package installed, as a kernel developer has it), on the CPU.

How the test reads the doc's code blocks:
- a ```python block whose first line is `# NAME.py` is a file the reader saves: it is written to
  the scratch directory as NAME.py before anything runs;
- every other ```python block runs, in the doc's order, in one interpreter and one namespace (the
  blocks joined), with the scratch directory as the working directory and on sys.path, so a
  block uses what an earlier one defined and imports the saved module;
- in ```bash blocks every line that starts with `moe-verify` runs (in the doc's order, in a
  scratch directory of its own holding the saved files: the first in bash, the console script
  itself, the others in one interpreter as `moe_verify.cli.main`, tests/cli/doc_examples.py
  `run_lines`) and must exit 0, or the `# exit N` it ends with; a line ending in `# gpu` needs
  a GPU and is not run here. Other lines are not run;
- ```text blocks are sample output for the reader; EXPECT below names what each command must
  print, and PYTHON_EXPECT what the Python blocks must.
The glossary must name every check the comparison can emit (a check added to tolerance/ without
a line there fails `test_the_glossary_names_every_check`).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli import doc_examples
from tests.cli.doc_examples import Command, user_env

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "your-kernel.md"
NOT_RUN = {"gpu": "needs a GPU"}
TIMEOUT_S = 300

# What a command must print (each needle in its stdout), by a piece of the command that names it.
EXPECT = {
    "run --backend my_kernels:MyGather -T 8 ": ["PASS", "reduce"],
    "run --backend my_kernels:MyGather -T 1 ": ["PASS"],  # odd token counts
    "run --backend my_kernels:MyGather -T 9 ": ["PASS"],
    "run --backend my_kernels:MyGatherBug ": [
        "first failure: gather",
        "ulp",
        "dumped to dumps/",
        "plots in plots",
    ],
    "replay dumps  #": ["first failure: gather", "my-gather-bug"],
    "replay dumps --backend my_kernels:MyGather": ["PASS", "[my-gather,"],
    "graph --backend my_kernels:MyGather": ["half-live", "one-live", "PASS: 3 of 3 replays"],
    "bench --production --backend my_kernels:MyGather": ["Production mode", "| gather |"],
}
PYTHON_EXPECT = [
    "route, quant_input, align, permute, gemm1, act_quant, gemm2\n",
    "max |mine - golden| = 0.0",
    "ulp: ",
    "why this limit:",
    "FAIL fp8_block-tp1-T8-H128-I128-E4-k2-softmax-A32 [my-gather-bug, isolated]",
]


def _text(text: str | None) -> str:
    return DOC.read_text() if text is None else text


def saved_files(text: str | None = None) -> dict[str, str]:
    """NAME.py -> its text, for the python blocks that are files."""
    return doc_examples.saved_files(_text(text))


def session(text: str | None = None) -> str:
    """The python blocks that are not files, joined in order: one script, one namespace."""
    parts = doc_examples.blocks(_text(text), "python")
    return "\n".join(b for b in parts if doc_examples.saved_name(b) is None)


def commands(text: str | None = None) -> list[Command]:
    """The `moe-verify` lines of the bash blocks, with the exit code each must give."""
    return [
        c
        for body in doc_examples.blocks(_text(text), "bash")
        for c in doc_examples.commands(body, NOT_RUN)
        if c.line.startswith("moe-verify")
    ]


def _scratch(tmp_path: Path) -> Path:
    assert ROOT not in tmp_path.parents, "the scratch directory must lie outside the checkout"
    for name, text in saved_files().items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_python_blocks_run_in_one_session(tmp_path: Path) -> None:
    script = session()
    assert script, "the tutorial has no Python to run"
    proc = subprocess.run(
        [sys.executable, "-"],  # stdin: the working directory is on sys.path
        input=script,
        cwd=_scratch(tmp_path),
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    missing = [n for n in PYTHON_EXPECT if n not in proc.stdout]
    assert not missing, f"the Python blocks did not print {missing}:\n{proc.stdout[-3000:]}"


def test_the_shell_commands_run_as_written(tmp_path: Path) -> None:
    """In order, in one directory: the replay reads the dump the failing run wrote."""
    cwd = _scratch(tmp_path)
    runnable = [c for c in commands() if c.exit_code is not None]
    assert len(runnable) >= len(EXPECT)
    unexpected = [k for k in EXPECT if not any(k in c.line for c in runnable)]
    assert not unexpected, f"EXPECT names commands the doc no longer has: {unexpected}"
    procs = doc_examples.run_lines([c.line for c in runnable], cwd, user_env(), TIMEOUT_S)
    for cmd, proc in zip(runnable, procs, strict=True):
        said = f"{cmd.line!r}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert proc.returncode == cmd.exit_code, (
            f"exited {proc.returncode}, not {cmd.exit_code}, {said}"
        )
        needles = [n for key, ns in EXPECT.items() if key in cmd.line for n in ns]
        missing = [n for n in needles if n not in proc.stdout]
        assert not missing, f"{missing} not printed by {said}"
    assert list((cwd / "plots").glob("*gather*.png")), "the failing run drew no gather plot"


# Where the check's name is among the arguments of each way tolerance/ builds a check.
_NAME_ARG = {
    "CheckResult": 0,
    "bound_check": 0,
    "exact_check": 0,
    "exact_int_vector": 2,
    "_slot_rows_check": 3,
}


def check_names() -> set[str]:
    """Every check name tolerance/ writes as a literal (names built by f-strings, such as
    '<output> shape' and 'mm1 bits', are listed in the glossary by hand)."""
    names = set()
    for path in sorted((ROOT / "tolerance").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called not in _NAME_ARG:
                continue
            args = {kw.arg: kw.value for kw in node.keywords}
            arg = args.get("name")
            if arg is None and len(node.args) > _NAME_ARG[called]:
                arg = node.args[_NAME_ARG[called]]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
    return names


def glossary() -> str:
    text = DOC.read_text()
    start = text.index("### Glossary")
    return text[start : text.index("\n## ", start)]


def test_the_glossary_names_every_check() -> None:
    names = check_names()
    assert {"elementwise", "nan_inf", "a1q codes", "inv_perm", "expert_ends"} <= names  # read
    listed = glossary()
    missing = sorted(n for n in names if f"| `{n}` |" not in listed)
    assert not missing, f"docs/your-kernel.md's glossary lacks {missing}"


def test_the_block_conventions_are_read() -> None:
    """A convention the parser missed would skip a command or run a GPU one on a CPU."""
    text = (
        "```python\n# mod.py\nX = 1\n```\n```python\nimport mod\n```\n```python\nY = mod.X\n```\n"
        "```bash\nmoe-verify run -T 8\nmoe-verify run --bug  # exit 1: why\n"
        "moe-verify run -T 4096  # gpu\npython mod.py\n```\n"
    )
    assert saved_files(text) == {"mod.py": "# mod.py\nX = 1\n"}
    assert session(text) == "import mod\n\nY = mod.X\n"
    assert commands(text) == [
        Command("moe-verify run -T 8", 0),
        Command("moe-verify run --bug  # exit 1: why", 1),
        Command("moe-verify run -T 4096  # gpu", None, "needs a GPU"),
    ]


_NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
).split()


def test_what_the_doc_says_of_the_defaults_and_the_smoke_preset_is_true() -> None:
    """The default --mode as `run --help` has it; the smoke preset's count and topologies as
    `sweep --preset smoke --list` shows them."""
    from moe_verify.cli import build_parser
    from moe_verify.spec import Topology
    from moe_verify.sweep.cases import preset

    text = " ".join(DOC.read_text().split())
    run = next(a for a in build_parser()._actions if a.dest == "command").choices["run"]
    mode = run._option_string_actions["--mode"].default
    assert set(re.findall(r"`--mode (\w+)` \(the default\)", text)) == {mode}
    said = re.search(
        r"--preset smoke` \((\w+) edge cases on ((?:[\w:]+(?:, | and ))*[\w:]+):", text
    )
    assert said, "the doc no longer says how many smoke cases there are, on which topologies"
    smoke = preset("smoke")
    assert said[1] == _NUMBERS[len(smoke)], (said[1], len(smoke))
    named = {Topology.parse(t) for t in re.split(r", | and ", said[2])}
    assert named == {p.topology for p in smoke}, (said[2], sorted(map(str, named)))
