"""JSON-lines record files (a run's ``metrics.jsonl``, ``samples.jsonl``, ``val_samples.jsonl``, ``restarts.jsonl``):
appended a record at a time, and read back whatever a crash left in them.

A process killed in the middle of an append leaves a torn last line: part of a record, no newline.
:func:`append_records` first sets such a tail aside, appending its bytes to ``<file>.torn`` with a warning that
names both files, and cuts the file back to its last complete line, so that the new record starts a line of its own;
a last line that is a whole record, only its newline missing, is kept and its newline added. :func:`read_records`
returns every complete record: a line that does not parse is skipped with a warning naming the file and the line,
except for the record that an older megarl appended onto a torn line (``{"step": 3, "rew{"step": 4, ...}``), which
is read from where it starts. Complete records are never lost, and one damaged line never makes a run folder
unreadable.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

log = logging.getLogger(__name__)

TORN_SUFFIX = ".torn"


def append_records(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> None:
    """Append ``records`` to the JSON-lines file ``path`` (created, with its folder, when missing), one line
    each, after setting aside a torn last line (module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, default=str) + "\n" for r in records)
    with path.open("ab+") as f:
        _set_torn_tail_aside(path, f)
        f.write(text.encode())


def _set_torn_tail_aside(path: Path, f) -> None:
    """Cut the open file ``f`` (``path``) back to its last newline when it does not end with one, the bytes cut
    appended to ``<path>.torn``."""
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return
    f.seek(end - 1)
    if f.read(1) == b"\n":
        return
    start, chunk = end, 4096
    while start > 0:  # the last newline, read backwards a chunk at a time
        start = max(0, start - chunk)
        f.seek(start)
        at = f.read(min(chunk, end - start)).rfind(b"\n")
        if at >= 0:
            start += at + 1
            break
    f.seek(start)
    torn = f.read()
    if _complete(torn):  # a whole record whose newline alone was not written: kept, its line ended
        f.seek(end)
        f.write(b"\n")
        log.warning("%s ended in a complete record without its newline (a process stopped while writing it): "
                    "kept, the newline added", path)
        return
    aside = path.with_name(path.name + TORN_SUFFIX)
    with aside.open("ab") as out:
        out.write(torn + b"\n")
    f.truncate(start)
    f.seek(start)
    log.warning("%s ended in a torn line (a process stopped while writing it): its %d bytes were moved to %s; "
                "every complete record is kept", path, len(torn), aside)


def _complete(line: bytes) -> bool:
    """Whether ``line`` is a whole JSON object (a prefix of a record that parses is the record itself)."""
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records (JSON objects) of a JSON-lines file in file order; none when it does not exist. A line that is
    not a JSON object is skipped with a warning naming the file and line (a record appended onto a torn line is
    kept: module docstring)."""
    return [record for _, record in _lines(Path(path)) if record is not None]


def _lines(path: Path) -> list[tuple[str, dict[str, Any] | None]]:
    """Each non-empty line of ``path`` with the record read from it, or None (warned of: :func:`read_records`)."""
    if not path.is_file():
        return []
    out = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        record = _record(line)
        if record is None:
            log.warning("%s line %d is not a complete JSON record (%d characters: %r...); skipped", path, number,
                        len(line), line[:60])
        elif len(record[1]) < len(line):
            log.warning("%s line %d starts with %d characters of a torn record; skipped them, read the record "
                        "after them", path, number, len(line) - len(record[1]))
        out.append((line, record and record[0]))
    return out


def one_record(record: dict[str, Any]) -> None:
    """The identity of a record in a file of one record a step (``metrics.jsonl``: :func:`latest_per_step`)."""
    return None


def sample_identity(record: dict[str, Any]) -> Any:
    """What tells apart the records of one step in a samples file: a training sample's ``row`` in its step's
    batch, a validation sample's prompt ``index`` and ``sample`` number, else (a sample written by an older
    megarl) its whole content."""
    if "row" in record:
        return record["row"]
    if "index" in record and "sample" in record:
        return record["index"], record["sample"]
    return json.dumps(record, sort_keys=True, default=str)


def latest_per_step(records: Sequence[dict[str, Any]],
                    identity: Callable[[dict[str, Any]], Any] = sample_identity) -> list[int]:
    """The positions (ascending) of the records that hold each step once: a record written for step ``s``
    supersedes every record written before it for step ``s`` or a later step (a resumed run writes the steps
    after its checkpoint again), records of one step written one after another counting once each by
    ``identity`` (the last one kept: a run that resumed at the step it had logged, by an older megarl that
    did not cut its record back). Records without an integer ``step`` are all kept.

    Args:
        records: a run's records in file order (:func:`read_records`).
        identity: what tells a step's records apart (:func:`one_record` for one record a step, as metrics).
    """
    blocks: list[tuple[int, list[int]]] = []  # (step, positions) of the writes in effect, ascending steps
    kept: list[int] = []
    for i, record in enumerate(records):
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            kept.append(i)
        elif blocks and blocks[-1][0] == step:
            blocks[-1][1].append(i)
        else:
            while blocks and blocks[-1][0] >= step:
                blocks.pop()
            blocks.append((step, [i]))
    for _, positions in blocks:
        kept += {identity(records[i]): i for i in positions}.values()
    return sorted(kept)


def move_records(path: str | os.PathLike, aside: str | os.PathLike,
                 keep: Callable[[list[dict[str, Any]]], Iterable[int]]) -> int:
    """Move the records of the JSON-lines file ``path`` that ``keep`` (given its records, :func:`read_records`)
    does not name by position to the end of ``aside``; ``path`` is replaced (atomically) by its other lines, a
    torn last line first set aside as :func:`append_records` does, lines that are no record left in place.
    ``aside`` is written before ``path`` is replaced, so a crash between the two loses no record. Returns the
    number of records moved."""
    path, aside = Path(path), Path(aside)
    if not path.is_file():
        return 0
    with path.open("ab+") as f:
        _set_torn_tail_aside(path, f)
    lines = _lines(path)
    records = [(n, record) for n, (_, record) in enumerate(lines) if record is not None]
    kept = {records[i][0] for i in keep([record for _, record in records])}
    moved = [line for n, (line, record) in enumerate(lines) if record is not None and n not in kept]
    if not moved:
        return 0
    with aside.open("a") as out:
        out.write("".join(line + "\n" for line in moved))
        out.flush()
        os.fsync(out.fileno())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for n, (line, record) in enumerate(lines) if n in kept or record is None))
    os.replace(tmp, path)
    return len(moved)


def _record(line: str) -> tuple[dict[str, Any], str] | None:
    """The JSON object that ``line`` is, or the one that ends it after a torn record (one that begins with the
    same key as the torn one, so a nested object of the torn record is not taken for a record), with the text it
    was read from."""
    first = _FIRST_KEY.match(line)
    start = 0
    while start >= 0:
        try:
            value = json.loads(line[start:])
        except ValueError:
            value = None
        if isinstance(value, dict) and (not start or first is not None and next(iter(value), None) == first[1]):
            return value, line[start:]
        start = line.find("{", start + 1)
    return None


_FIRST_KEY = re.compile(r'\s*\{\s*"([^"\\]*)"')
