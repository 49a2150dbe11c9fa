"""JSON-lines record files (a run's ``metrics.jsonl``, ``samples.jsonl``, ``val_samples.jsonl``,
``restarts.jsonl``): appended a record at a time, and read back whatever a crash left in them.

A process killed in the middle of an append leaves a torn last line: part of a record, no newline.
:func:`append_records` first sets such a tail aside, appending its bytes to ``<file>.torn`` with a warning that
names both files, and cuts the file back to its last complete line, so that the new record starts a line of its
own; a last line that is a whole record, only its newline missing, is kept and its newline added. :func:`read_records` returns every complete record: a line that does not parse is skipped with a warning
naming the file and the line, except for the record that an older megarl appended onto a torn line (``{"step":
3, "rew{"step": 4, ...}``), which is read from where it starts. Complete records are never lost, and one damaged
line never makes a run folder unreadable.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterable

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
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        record = _record(line)
        if record is None:
            log.warning("%s line %d is not a complete JSON record (%d characters: %r...); skipped", path, number,
                        len(line), line[:60])
            continue
        if len(record[1]) < len(line):
            log.warning("%s line %d starts with %d characters of a torn record; skipped them, read the record "
                        "after them", path, number, len(line) - len(record[1]))
        records.append(record[0])
    return records


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
