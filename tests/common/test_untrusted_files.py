"""Dumps (`replay`) and checkpoints (`audit-e8m0`) are untrusted input: every hostile file is one
ValueError naming the file within a second, never a hang, a traceback or a read outside the
directory; and a dump finds its case and records the backend it was made with."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_verify.audit import audit
from moe_verify.common.safe_io import DTYPES, UntrustedFileError, load_safetensors, open_safetensors
from moe_verify.run.dump import load_case
from moe_verify.run.inputs import make_inputs
from moe_verify.run.verify import verify
from moe_verify.spec import MoEProblem
from reference.formats import quantize_fp8_blocks

pytestmark = pytest.mark.cpu

PROBLEM = MoEProblem(tokens=4, hidden=128, intermediate=128, num_experts=4, topk=2)
WRONG = "tests.tester.wrong_backends:MisroutedToken"  # fails at route: a dump is written
WITHIN_S = 1.0  # the brief's bound: an error, not a wait
INPUTS, SHARD = "inputs.safetensors", "model.safetensors"


# -- building hostile files -----------------------------------------------------------------------


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header: dict | bytes, data: bytes = b"") -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _edit(change: Callable[[dict, list[str]], None]) -> Callable[[Path], None]:
    """Rewrite a file's header: `change(header, tensor names in file order)`."""

    def apply(path: Path) -> None:
        header, data = _header(path)
        names = sorted(
            (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]
        )
        change(header, names)
        _write(path, header, data)

    return apply


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def _length(value: int) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        raw = path.read_bytes()
        path.write_bytes(struct.pack("<Q", value) + raw[8:])

    return apply


def _length_past_end(path: Path) -> None:
    _length(path.stat().st_size)(path)


def _overlap(header: dict, names: list[str]) -> None:
    first, second = header[names[0]]["data_offsets"], header[names[1]]["data_offsets"]
    header[names[1]]["data_offsets"] = [first[0], first[0] + second[1] - second[0]]


def _past_end(header: dict, names: list[str]) -> None:
    begin, end = header[names[-1]]["data_offsets"]
    header[names[-1]]["data_offsets"] = [begin + 10**9, end + 10**9]


def _set(field: str, value: object) -> Callable[[dict, list[str]], None]:
    def change(header: dict, names: list[str]) -> None:
        header[names[0]][field] = value

    return change


def _grow_shape(header: dict, names: list[str]) -> None:
    header[names[0]]["shape"] = [d * 2 for d in header[names[0]]["shape"]]


def _duplicate_name(path: Path) -> None:
    header, data = _header(path)
    name = next(k for k in header if k != "__metadata__")
    text = json.dumps(header)
    entry = json.dumps({name: header[name]})[1:-1]
    _write(path, (text[:-1] + ", " + entry + "}").encode(), data)


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.mkdir()


def _link(path: Path, target: Path | str) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(target)


@dataclass(frozen=True)
class Corruption:
    """A way to spoil one safetensors file, and what the error must say."""

    id: str
    apply: Callable[[Path], None]
    message: str


# Each row spoils the one file every reader must open (a dump's inputs, a checkpoint's shard).
SAFETENSORS_CORRUPTIONS = [
    Corruption("fifo", _fifo, "is a FIFO, not a regular file"),
    Corruption("directory", _directory, "is a directory, not a regular file"),
    Corruption("empty", lambda p: p.write_bytes(b""), "0 bytes, too short for a safetensors"),
    Corruption("truncated-half", _truncate, "(truncated?)"),
    Corruption("header-longer-than-file", _length_past_end, "bytes after the length field"),
    Corruption("header-2-pow-60", _length(2**60), "is over the 100000000-byte limit"),
    Corruption(
        "header-not-json",
        lambda p: _write(p, b"{nope", b"\0" * 16),
        "the safetensors header is not valid JSON",
    ),
    Corruption(
        "header-a-list", lambda p: _write(p, b"[1, 2]"), "header is a JSON list, not an object"
    ),
    Corruption("duplicate-name", _duplicate_name, "appears twice"),
    Corruption("unknown-dtype", _edit(_set("dtype", "F7")), "unknown dtype 'F7'"),
    Corruption("unhashable-dtype", _edit(_set("dtype", ["F32"])), "unknown dtype ['F32']"),
    Corruption("negative-shape", _edit(_set("shape", [-1, 4])), "shape must be a list of non-neg"),
    Corruption("shape-not-dtype-x-bytes", _edit(_grow_shape), "needs"),
    Corruption("overlapping-offsets", _edit(_overlap), "overlaps the tensor before it"),
    Corruption("offsets-past-the-file", _edit(_past_end), "are not a range within the"),
    Corruption(
        "metadata-not-strings",
        _edit(lambda h, _: h.update({"__metadata__": {"a": 1}})),
        "__metadata__ must map strings to strings",
    ),
]


# -- the two readers, each with a fresh copy of a good input --------------------------------------


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real dump of a failing case (one verify() per xdist worker)."""
    top = tmp_path_factory.mktemp("dump")
    report = verify(PROBLEM, backend=WRONG, mode="isolated", engine="triton", dump_dir=top)
    assert not report.passed
    return top / PROBLEM.id


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-weight FP8 block-scaled checkpoint the audit accepts."""
    root = tmp_path_factory.mktemp("ckpt")
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    q, s = quantize_fp8_blocks(w, (128, 128), use_ue8m0=False)
    key = "model.layers.0.mlp.down_proj"
    save_file({f"{key}.weight": q, f"{key}.weight_scale_inv": s}, str(root / SHARD))
    (root / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    audit(root, device="cpu")  # the good checkpoint passes: every failure below is the damage
    return root


def _copy(src: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(a copy of `src` inside tmp_path/inside, a directory outside it holding a copy too)."""
    outside = tmp_path / "outside"
    shutil.copytree(src, outside)
    inside = tmp_path / "inside" / src.name
    shutil.copytree(src, inside)
    return inside, outside


def _replay(directory: Path) -> object:
    return load_case(directory, device="cpu")


def _audit(directory: Path) -> object:
    return audit(directory, device="cpu")


def _error_within_a_second(read: Callable[[Path], object], directory: Path) -> BaseException:
    """The exception `read(directory)` raises, failing the test if it returns or hangs. A hung
    reader is a FIFO open without a writer: opening each FIFO for writing releases it."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            read(directory)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(WITHIN_S)
    if worker.is_alive():
        for fifo in (p for p in directory.rglob("*") if p.is_fifo()):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(WITHIN_S)
        pytest.fail(f"{read.__name__}({directory}) did not return within {WITHIN_S} s")
    (exc,) = outcome
    if exc is None:
        pytest.fail(f"{read.__name__}({directory}) accepted a hostile file")
    return exc


def _assert_names(exc: BaseException, file: Path, message: str) -> None:
    assert isinstance(exc, ValueError), f"{type(exc).__name__}: {exc}"
    assert str(file) in str(exc) or file.name in str(exc), str(exc)
    assert message in str(exc), str(exc)


@pytest.mark.parametrize(
    "bad", SAFETENSORS_CORRUPTIONS, ids=[c.id for c in SAFETENSORS_CORRUPTIONS]
)
def test_replay_refuses_a_hostile_inputs_file(
    dumped: Path, tmp_path: Path, bad: Corruption
) -> None:
    case, _ = _copy(dumped, tmp_path)
    bad.apply(case / INPUTS)
    _assert_names(_error_within_a_second(_replay, case), case / INPUTS, bad.message)


@pytest.mark.parametrize(
    "bad", SAFETENSORS_CORRUPTIONS, ids=[c.id for c in SAFETENSORS_CORRUPTIONS]
)
def test_audit_refuses_a_hostile_shard(checkpoint: Path, tmp_path: Path, bad: Corruption) -> None:
    root, _ = _copy(checkpoint, tmp_path)
    bad.apply(root / SHARD)
    _assert_names(_error_within_a_second(_audit, root), root / SHARD, bad.message)


def _text(name: str, data: str | bytes) -> Callable[[Path, Path], Path]:
    def build(case: Path, outside: Path) -> Path:
        path = case / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return path

    return build


def _problem_field(field: str, value: object) -> Callable[[Path, Path], Path]:
    def build(case: Path, outside: Path) -> Path:
        data = {**json.loads((case / "problem.json").read_text()), field: value}
        return _text("problem.json", json.dumps(data))(case, outside)

    return build


def _linked(name: str, target: Callable[[Path], Path | str]) -> Callable[[Path, Path], Path]:
    def build(case: Path, outside: Path) -> Path:
        _link(case / name, target(outside))
        return case / name

    return build


def _spoiled(name: str, spoil: Callable[[Path], None]) -> Callable[[Path, Path], Path]:
    def build(case: Path, outside: Path) -> Path:
        spoil(case / name)
        return case / name

    return build


# (id, build(case dir, outside dir) -> the bad file, what the error says)
REPLAY_FILES = [
    ("fifo-problem-json", _spoiled("problem.json", _fifo), "is a FIFO"),
    ("fifo-run-json", _spoiled("run.json", _fifo), "is a FIFO"),
    ("problem-json-to-etc-passwd", _linked("problem.json", lambda o: "/etc/passwd"), "outside"),
    ("inputs-to-a-file-outside", _linked(INPUTS, lambda o: o / INPUTS), "is a symlink to"),
    ("directory-problem-json", _spoiled("problem.json", _directory), "is a directory"),
    ("problem-invalid-json", _text("problem.json", '{"tokens": 4,'), "invalid JSON: Expecting"),
    ("problem-not-utf8", _text("problem.json", b'{"\xff": 1}'), "not UTF-8"),
    ("problem-a-list", _text("problem.json", "[]"), "expected a JSON object"),
    # MoEProblem's own message follows, in spec.py's words
    ("problem-missing-fields", _text("problem.json", '{"tokens": 4}'), "not a valid MoEProblem"),
    ("problem-unknown-field", _problem_field("bogus", 1), "not a valid MoEProblem"),
    ("problem-bad-value", _problem_field("topk", 9), "not a valid MoEProblem"),
    ("problem-wrong-type", _problem_field("topology", 5), "not a valid MoEProblem"),
    ("run-poison-not-a-byte", _text("run.json", '{"poison": [300]}'), "'poison' must be a list"),
    ("run-backend-not-a-string", _text("run.json", '{"backend": 1}'), "'backend' must be a str"),
]


@pytest.mark.parametrize(
    ("build", "message"), [r[1:] for r in REPLAY_FILES], ids=[r[0] for r in REPLAY_FILES]
)
def test_replay_refuses_a_hostile_dump_file(
    dumped: Path, tmp_path: Path, build: Callable[[Path, Path], Path], message: str
) -> None:
    case, outside = _copy(dumped, tmp_path)
    bad = build(case, outside)
    _assert_names(_error_within_a_second(_replay, case), bad, message)


def _index_to(file: str) -> Callable[[Path, Path], Path]:
    """An index that puts the checkpoint's first tensor in `file` (the rest in the shard)."""

    def build(root: Path, outside: Path) -> Path:
        header, _ = _header(root / SHARD)
        names = [k for k in header if k != "__metadata__"]
        weight_map = {k: file if k == names[0] else SHARD for k in names}
        return _text("model.safetensors.index.json", json.dumps({"weight_map": weight_map}))(
            root, outside
        )

    return build


# (id, build(checkpoint dir, outside dir) -> the file the error must name, what it says)
AUDIT_FILES = [
    ("fifo-config-json", _spoiled("config.json", _fifo), "is a FIFO"),
    ("fifo-index", _spoiled("model.safetensors.index.json", _fifo), "is a FIFO"),
    ("fifo-extra-shard", _spoiled("x.safetensors", _fifo), "is a FIFO"),
    ("directory-named-like-a-shard", _spoiled("x.safetensors", _directory), "is a directory"),
    ("shard-to-etc-passwd", _linked("x.safetensors", lambda o: "/etc/passwd"), "outside"),
    ("config-to-etc-passwd", _linked("config.json", lambda o: "/etc/passwd"), "outside"),
    ("shard-to-a-file-outside", _linked(SHARD, lambda o: o / SHARD), "is a symlink to"),
    ("index-entry-dotdot", _index_to("../../outside/model.safetensors"), "by '..' or an abs"),
    ("index-entry-absolute", _index_to("/etc/passwd"), "by '..' or an absolute path"),
    ("index-entry-missing", _index_to("gone.safetensors"), "does not exist"),
    ("config-invalid-json", _text("config.json", "{"), "invalid JSON: Expecting property name"),
    ("config-a-list", _text("config.json", "[]"), "a JSON list, not an object"),
]


@pytest.mark.parametrize(
    ("build", "message"), [r[1:] for r in AUDIT_FILES], ids=[r[0] for r in AUDIT_FILES]
)
def test_audit_refuses_a_hostile_checkpoint_file(
    checkpoint: Path, tmp_path: Path, build: Callable[[Path, Path], Path], message: str
) -> None:
    root, outside = _copy(checkpoint, tmp_path)
    bad = build(root, outside)
    _assert_names(_error_within_a_second(_audit, root), bad, message)


# -- what is still accepted -----------------------------------------------------------------------


def test_a_symlink_that_stays_inside_the_checkpoint_is_followed(
    checkpoint: Path, tmp_path: Path
) -> None:
    root, _ = _copy(checkpoint, tmp_path)
    (root / "blobs").mkdir()
    (root / SHARD).rename(root / "blobs" / "0123")
    _link(root / SHARD, "blobs/0123")
    assert audit(root, device="cpu").fp8_weights == 1


def _hf_snapshot(checkpoint: Path, tmp_path: Path, blob_dir: Path) -> Path:
    """The checkpoint laid out as a Hugging Face cache snapshot: files in `blob_dir`, linked from
    models--org--tiny/snapshots/<revision>/ by relative symlinks."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    blob_dir.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate((SHARD, "config.json")):
        shutil.copy(checkpoint / name, blob_dir / f"blob{i}")
        (snapshot / name).symlink_to(os.path.relpath(blob_dir / f"blob{i}", snapshot))
    return snapshot


def test_a_hugging_face_cache_snapshot_is_read(checkpoint: Path, tmp_path: Path) -> None:
    """Its files link to ../../blobs inside the cached repository: inside, so followed."""
    snapshot = _hf_snapshot(checkpoint, tmp_path, tmp_path / "models--org--tiny" / "blobs")
    assert audit(snapshot, device="cpu").fp8_weights == 1


def test_a_snapshot_linking_out_of_its_cached_repository_is_refused(
    checkpoint: Path, tmp_path: Path
) -> None:
    snapshot = _hf_snapshot(checkpoint, tmp_path, tmp_path / "elsewhere")
    with pytest.raises(UntrustedFileError, match="outside"):
        audit(snapshot, device="cpu")


def test_the_reader_returns_what_safetensors_wrote_bit_for_bit(tmp_path: Path) -> None:
    """Every dtype (a replay must be bit-identical), an empty tensor, and one row read alone."""
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (3, 5, 8), generator=g, dtype=torch.uint8)
    tensors = {
        name: raw.bool() if dtype == torch.bool else raw.clone().view(dtype)
        for name, dtype in DTYPES.items()
    }
    tensors["empty"] = torch.zeros(0, 4)
    save_file(tensors, str(tmp_path / "all.safetensors"), metadata={"k": "v"})
    mine, meta = load_safetensors(tmp_path, "all.safetensors")
    theirs = load_file(str(tmp_path / "all.safetensors"))
    assert meta == {"k": "v"} and mine.keys() == theirs.keys()
    for name, t in theirs.items():
        assert mine[name].dtype == t.dtype and mine[name].shape == t.shape, name
        assert torch.equal(mine[name].view(torch.uint8), t.view(torch.uint8)), name
    with open_safetensors(tmp_path, "all.safetensors") as f:
        assert torch.equal(f.tensor("F32", 2), theirs["F32"][2])
        with pytest.raises(UntrustedFileError, match=r"'F32' \[3, 5, 2\] has no row 3"):
            f.tensor("F32", 3)


# -- finding the case, and what it was run with ---------------------------------------------------


def test_load_case_takes_the_dump_directory_of_one_case(dumped: Path) -> None:
    case = load_case(dumped.parent, device="cpu")
    assert case.path == dumped.resolve() and case.problem == PROBLEM


def test_load_case_lists_the_cases_of_a_dump_directory_of_several(
    dumped: Path, tmp_path: Path
) -> None:
    shutil.copytree(dumped, tmp_path / "a-case")
    shutil.copytree(dumped, tmp_path / "b-case")
    (tmp_path / "not-a-case").mkdir()
    with pytest.raises(ValueError, match="holds 2 cases: a-case, b-case; pass one of them"):
        load_case(tmp_path, device="cpu")


def test_load_case_of_a_directory_with_no_case(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no problem.json and no case directory"):
        load_case(tmp_path, device="cpu")


def test_the_dump_records_the_backend_spec_engine_and_mode(dumped: Path) -> None:
    case = load_case(dumped, device="cpu")
    run = case.options
    assert run is not None and (run.backend, run.engine, run.mode) == (WRONG, "triton", "isolated")
    assert (run.workspace, run.poison) == (False, ())
    want = make_inputs(PROBLEM, "cpu")  # the dumped inputs are the ones the failing run used
    for name in ("hidden_states", "router_logits", "w13", "w2"):
        assert torch.equal(getattr(case.inputs, name), getattr(want, name)), name
    assert torch.equal(case.inputs.w13_q.q.view(torch.uint8), want.w13_q.q.view(torch.uint8))
    assert case.inputs.w13_q.block == want.w13_q.block


def test_a_backend_instance_is_recorded_as_its_module_and_class(tmp_path: Path) -> None:
    from tests.tester.wrong_backends import MisroutedToken

    verify(PROBLEM, backend=MisroutedToken(engine="triton"), mode="chained", dump_dir=tmp_path)
    case = load_case(tmp_path, device="cpu")
    run = case.options
    assert run is not None and (run.backend, run.mode) == (WRONG, "chained")


def test_an_older_dump_records_no_backend(dumped: Path, tmp_path: Path) -> None:
    case, _ = _copy(dumped, tmp_path)
    (case / "run.json").unlink()
    old = load_case(case, device="cpu")
    assert old.options is None  # no backend, engine or mode recorded
