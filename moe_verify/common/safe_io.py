"""The one place files from outside are opened: dumps for `replay`, checkpoints for `audit-e8m0`.

Such a file may be anything its author made it. So every read here
- stays inside a root directory: a name with `..` or a symlink that leads out of it is refused;
- opens only a regular file: a FIFO would block the open forever, a device read forever, so the
  path is stat'ed before it is opened, opened non-blocking and without following a last symlink,
  and stat'ed again through the descriptor;
- is bounded: a JSON file by `max_bytes`, a safetensors header by its own length field, which is
  checked against the file's size before anything is allocated;
- checks a safetensors header completely (dtype, shape, byte ranges) before reading a tensor, and
  reads tensors from the descriptor it checked, so nothing can swap the file in between;
- fails with one UntrustedFileError (a ValueError) that names the file and what is wrong with it.
No file is ever unpickled or executed: JSON and raw safetensors bytes only.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

# The safetensors library refuses headers above 100 MB too (its MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
# problem.json and report.json are kilobytes; the largest HF index (DeepSeek-V3, ~90k tensors) is
# about 10 MB.
MAX_JSON_BYTES = 64 * 2**20

# safetensors dtype name -> torch dtype, for the dtypes of one byte or more (sub-byte F4/F6 codes
# do not occur in the files read here).
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}


class UntrustedFileError(ValueError):
    """A file from a dump or a checkpoint that cannot be read as given (the message names it)."""


def safe_file(
    root: Path, relative_or_path: str | os.PathLike[str], *, within: Path | None = None
) -> Path:
    """The resolved path of a regular file inside `root`, checked without opening it.

    `relative_or_path` is relative to `root`, or a path under it. Refused: a name that leaves
    `root` (`..`, an absolute path elsewhere), a symlink whose target is outside `within` (by
    default `root` itself), a file that does not exist, and anything but a regular file (a FIFO,
    a device, a socket, a directory)."""
    root = Path(os.path.abspath(root))
    given = Path(relative_or_path)
    path = Path(os.path.normpath(root / given))  # `root / absolute` is the absolute path
    if not path.is_relative_to(root):
        raise UntrustedFileError(
            f"{given}: names {path}, outside {root} (by '..' or an absolute path); only files "
            "inside it are read"
        )
    try:
        real_root = Path(os.path.abspath(within if within is not None else root)).resolve(
            strict=True
        )
    except OSError as exc:
        raise UntrustedFileError(f"{root}: cannot open the directory ({_reason(exc)})") from None
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        raise UntrustedFileError(f"{path}: does not exist") from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop on older Pythons
        raise UntrustedFileError(f"{path}: cannot be resolved ({_reason(exc)})") from None
    if not real.is_relative_to(real_root):
        via = "is a symlink to" if path.is_symlink() else "resolves to"
        raise UntrustedFileError(
            f"{path}: {via} {real}, outside {real_root}; only files inside it are read"
        )
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        raise UntrustedFileError(f"{path}: cannot be read ({_reason(exc)})") from None
    _require_regular(path, mode)
    return real


def read_json(
    root: Path,
    name: str | os.PathLike[str],
    max_bytes: int = MAX_JSON_BYTES,
    *,
    within: Path | None = None,
) -> Any:
    """The JSON value (callers check its shape) of the file `name` inside `root`, at most
    `max_bytes` long."""
    path = safe_file(root, name, within=within)
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise UntrustedFileError(f"{path}: {size} bytes, more than the {max_bytes} allowed")
        raw = _read_exactly(f, path, 0, size)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UntrustedFileError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise UntrustedFileError(
            f"{path}: invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
            f"(char {exc.pos})"
        ) from None
    except RecursionError:
        raise UntrustedFileError(f"{path}: invalid JSON: nested too deeply") from None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checked safetensors header: its bytes are [start, end) of the file."""

    dtype: str  # the safetensors name, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class SafetensorsFile:
    """An open safetensors file whose header has been checked: its keys, metadata and tensors,
    each read on its own from the descriptor that was checked."""

    def __init__(
        self, path: Path, f: BinaryIO, tensors: dict[str, TensorInfo], metadata: dict[str, str]
    ) -> None:
        self.path = path
        self.tensors = tensors
        self.metadata = metadata
        self._f = f

    def keys(self) -> list[str]:
        """The tensor names, in the order of their bytes in the file."""
        return list(self.tensors)

    def info(self, key: str) -> TensorInfo:
        """Tensor `key`'s dtype, shape and bytes, from the checked header."""
        if key not in self.tensors:
            raise UntrustedFileError(f"{self.path}: holds no tensor {key!r}")
        return self.tensors[key]

    def tensor(self, key: str, index: int | None = None) -> torch.Tensor:
        """Tensor `key` on the CPU, or only its row `index` of the leading dimension."""
        info = self.info(key)
        shape, start, end = info.shape, info.start, info.end
        if index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise UntrustedFileError(
                    f"{self.path}: tensor {key!r} {list(shape)} has no row {index}"
                )
            row = (end - start) // shape[0]
            shape, start = shape[1:], start + index * row
            end = start + row
        if end == start:
            return torch.empty(shape, dtype=info.torch_dtype)
        data = _read_exactly(self._f, self.path, start, end - start)
        return torch.frombuffer(data, dtype=info.torch_dtype).reshape(shape)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_safetensors(root: Path, name: str | os.PathLike[str]) -> SafetensorsFile:
    """The safetensors file `name` inside `root`, its header checked (see parse_header)."""
    path = safe_file(root, name)
    f = _open_file(path)
    try:
        tensors, metadata = parse_header(f, path)
    except BaseException:
        f.close()
        raise
    return SafetensorsFile(path, f, tensors, metadata)


def load_safetensors(
    root: Path, name: str | os.PathLike[str], keys: Iterable[str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (every one, or only `keys`) and the metadata of the file `name` inside `root`."""
    with open_safetensors(root, name) as f:
        wanted = f.keys() if keys is None else list(keys)
        return {k: f.tensor(k) for k in wanted}, f.metadata


def parse_header(f: BinaryIO, path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Check a safetensors header the way its format defines it, before any tensor is read: an
    8-byte little-endian length within the file and at most MAX_HEADER_BYTES, a JSON object
    (no duplicate names) of {name: {dtype, shape, data_offsets}} plus an optional string-to-string
    "__metadata__", every dtype known, every shape of non-negative ints, and byte ranges that
    match dtype x shape and tile the data area from its start to the end of the file, as the
    safetensors library requires. Returns the tensors in file order, with absolute byte ranges,
    and the metadata."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise UntrustedFileError(
            f"{path}: {size} bytes, too short for a safetensors file (an 8-byte header length "
            "comes first)"
        )
    (length,) = struct.unpack("<Q", _read_exactly(f, path, 0, 8))
    if length > MAX_HEADER_BYTES:
        raise UntrustedFileError(
            f"{path}: header length {length} is over the {MAX_HEADER_BYTES}-byte limit: "
            "not a safetensors file"
        )
    if length > size - 8:
        raise UntrustedFileError(
            f"{path}: header length {length} exceeds the {size - 8} bytes after the length "
            "field: truncated or not a safetensors file"
        )
    try:
        header = json.loads(
            _read_exactly(f, path, 8, length).decode("utf-8"), object_pairs_hook=_unique_keys
        )
    except (UnicodeDecodeError, json.JSONDecodeError, _DuplicateKey, RecursionError) as exc:
        raise UntrustedFileError(
            f"{path}: the safetensors header is not valid JSON: {exc}"
        ) from None
    if not isinstance(header, dict):
        raise UntrustedFileError(
            f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object"
        )
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise UntrustedFileError(
            f"{path}: the header's __metadata__ must map strings to strings, got {metadata!r:.200}"
        )
    base, data_size = 8 + length, size - 8 - length
    tensors = {
        key: _tensor_info(path, key, entry, base, data_size) for key, entry in header.items()
    }
    ordered = sorted(tensors.items(), key=lambda item: (item[1].start, item[1].end))
    at = base
    for key, info in ordered:
        if info.start != at:
            problem = "overlaps the tensor before it" if info.start < at else "leaves a gap"
            raise UntrustedFileError(
                f"{path}: tensor {key!r} data_offsets {_offsets(info, base)} {problem} "
                f"(expected it to start at {at - base})"
            )
        at = info.end
    if at != size:
        raise UntrustedFileError(
            f"{path}: the tensors' data ends at byte {at - base} of a {data_size}-byte data area: "
            + ("truncated" if at > size else "trailing bytes no tensor owns")
        )
    return dict(ordered), metadata


def _tensor_info(path: Path, key: str, entry: object, base: int, data_size: int) -> TensorInfo:
    where = f"{path}: tensor {key!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise UntrustedFileError(
            f"{where}: expected {{dtype, shape, data_offsets}}, got {entry!r:.200}"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise UntrustedFileError(
            f"{where}: unknown dtype {dtype!r:.40} (known: {', '.join(DTYPES)})"
        )
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise UntrustedFileError(
            f"{where}: shape must be a list of non-negative ints, got {shape!r:.200}"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise UntrustedFileError(
            f"{where}: data_offsets must be [begin, end] of non-negative ints, got {offsets!r:.200}"
        )
    begin, end = offsets
    if not begin <= end <= data_size:
        raise UntrustedFileError(
            f"{where}: data_offsets {offsets} are not a range within the {data_size}-byte data "
            "area after the header (truncated?)"
        )
    want = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != want:
        raise UntrustedFileError(
            f"{where}: data_offsets {offsets} hold {end - begin} bytes; "
            f"{dtype} {shape} needs {want}"
        )
    return TensorInfo(dtype, tuple(shape), base + begin, base + end)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _offsets(info: TensorInfo, base: int) -> list[int]:
    return [info.start - base, info.end - base]


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"name {key!r} appears twice")
        out[key] = value
    return out


def _require_regular(path: Path, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    raise UntrustedFileError(f"{path}: is {kind}, not a regular file")


def _open_file(path: Path) -> BinaryIO:
    """Open a path safe_file returned, read-only: O_NONBLOCK so that a FIFO swapped in after the
    check cannot block the open, O_NOFOLLOW so that a symlink swapped in is not followed, and the
    descriptor itself stat'ed again."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise UntrustedFileError(f"{path}: cannot be opened ({_reason(exc)})") from None
    try:
        _require_regular(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb", buffering=0)


@contextmanager
def _open(path: Path) -> Iterator[BinaryIO]:
    f = _open_file(path)
    try:
        yield f
    finally:
        f.close()


def _read_exactly(f: BinaryIO, path: Path, offset: int, count: int) -> bytearray:
    """`count` bytes at `offset`, read in place, or an error naming the file when it ends (or
    fails) first."""
    data = bytearray(count)
    view, done = memoryview(data), 0
    try:
        while done < count:
            got = os.preadv(f.fileno(), [view[done:]], offset + done)
            if got == 0:
                raise UntrustedFileError(
                    f"{path}: ends at byte {offset + done}, {count - done} bytes short of the "
                    f"{count} read at byte {offset} (truncated while being read?)"
                )
            done += got
    except OSError as exc:
        raise UntrustedFileError(f"{path}: cannot be read ({_reason(exc)})") from None
    finally:
        view.release()
    return data


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
