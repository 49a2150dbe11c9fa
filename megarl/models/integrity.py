"""A megarl checkpoint's record of its own files, and the check that they are still what was written.

At save (:func:`megarl.models.checkpoint.save_checkpoint`), once every rank has written its part, the ranks hash
the checkpoint's files, each its share (:func:`record_files`), and ``megarl.json`` keeps every file's size
(``files``) and content hash (``hashes``: ``{"xxh3_128": {file: hex digest}}``, xxHash's XXH3 128-bit: 2.9 GB/s
a core in memory, below the cost of reading the files; a 2 GB checkpoint was read and hashed in 5.5 s on this
project's 2-core CPU machine under load, 24 s with sha256). Before
anything reads a checkpoint, :func:`checkpoint_fault` compares them with the files (and parses megatron's index),
so a file cut short, deleted or overwritten at the same size is named before any tensor is loaded. The hashes are
read again only when a file's size, modification time or inode changed since this process last checked it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megarl.storage import describe

META_FILE = "megarl.json"
HASH = "xxh3_128"
CHUNK = 8 << 20  # bytes read at a time while hashing


def file_hash(path: Path) -> str:
    """The XXH3-128 digest of a file's bytes, in hex (32 characters).

    Raises:
        OSError: the file cannot be read.
    """
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def record_files(directory: Path, share: int = 0, shares: int = 1) -> dict[str, tuple[int, str]]:
    """``{file: (size in bytes, hash)}`` of every file under ``directory`` (relative POSIX paths, sorted) whose
    position in that order is ``share`` modulo ``shares``: each rank of a save records its share, and the
    shares together are every file."""
    files = sorted(f for f in directory.rglob("*") if f.is_file())
    return {f.relative_to(directory).as_posix(): (f.stat().st_size, file_hash(f))
            for k, f in enumerate(files) if k % shares == share}


def files_meta(records: dict[str, tuple[int, str]]) -> dict[str, Any]:
    """The entries of ``megarl.json`` that :func:`checkpoint_fault` checks, from :func:`record_files`."""
    return {"files": {rel: size for rel, (size, _) in sorted(records.items())},
            "hashes": {HASH: {rel: digest for rel, (_, digest) in sorted(records.items())}}}


_checked: dict[str, tuple[tuple, str | None]] = {}  # checkpoint -> (its files' stat signature, the fault found)


def checkpoint_fault(path: str | os.PathLike) -> str | None:
    """What is wrong with the files of the checkpoint at ``path``, in words naming the file (relative to
    ``path``) and the cause, or None when they are sound: ``megarl.json`` parses; every file it records
    (``files``) is there with its size; megatron's ``model/metadata.json`` parses and its index ``model/.metadata``
    loads; every file that index names is there and long enough for the tensors it places in it; and every file
    whose hash it records (``hashes``) holds those bytes. Checkpoints written before ``files`` or ``hashes`` were
    recorded get the checks that remain. Reads every recorded file once (hashing); again only for files changed
    since (their size, modification time or inode)."""
    path = Path(path)
    key = str(path.resolve())
    signature = _signature(path)
    if key in _checked and _checked[key][0] == signature:
        return _checked[key][1]
    fault = _fault(path)
    _checked[key] = (signature, fault)
    return fault


def _signature(path: Path) -> tuple:
    """Every file under ``path`` with its size, modification time and inode: what a change to any file changes."""
    out = []
    for root, _, names in os.walk(path):
        for name in names:
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            out.append((os.path.join(root, name), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(out))


def _fault(path: Path) -> str | None:
    """:func:`checkpoint_fault`, without the memo."""
    def parse_json(rel: str) -> tuple[Any, str | None]:
        try:
            return json.loads((path / rel).read_text()), None
        except FileNotFoundError:
            return None, f"{rel} is missing"
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            return None, f"{rel} is not valid JSON ({e})"
        except OSError as e:
            return None, f"{rel} cannot be read ({describe(e)})"

    meta, fault = parse_json(META_FILE)
    if fault:
        return fault
    if not isinstance(meta, dict):
        return f"{META_FILE} does not hold a checkpoint's description (a JSON {type(meta).__name__})"
    files = meta.get("files") or {}
    for rel, size in sorted(files.items()):
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if (have := f.stat().st_size) != size:
            return f"{rel} has {have} bytes, {size} were written"
    _, fault = parse_json("model/metadata.json")
    if fault:
        return fault
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / "model" / ".metadata").is_file():
        return "model/.metadata is missing"
    try:
        index = FileSystemReader(str(path / "model")).read_metadata()
        needed: dict[str, int] = {}
        for info in (index.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # noqa: BLE001 (a torn pickle: EOFError, UnpicklingError, ...)
        return f"model/.metadata cannot be read ({type(e).__name__}: {str(e)[:200] or 'no detail'})"
    for rel, size in sorted(needed.items()):
        f = path / "model" / rel
        if not f.is_file():
            return f"model/{rel} is missing (model/.metadata places tensors in it)"
        if (have := f.stat().st_size) < size:
            return f"model/{rel} is truncated: {have} bytes, model/.metadata places tensors up to byte {size}"
    hashes = (meta.get("hashes") or {}).get(HASH) or {}
    for rel in sorted(set(hashes) & set(files)):  # a file left out of ``files`` (by hand) is left out here too
        try:
            have = file_hash(path / rel)
        except OSError as e:
            return f"{rel} cannot be read ({describe(e)})"
        if have != hashes[rel]:
            return (f"{rel} does not hold the bytes that were written (its {HASH} hash is {have}, the save "
                    f"recorded {hashes[rel]})")
    return None
