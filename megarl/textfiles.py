"""Text and JSON files that users hand megarl (a YAML config, a jsonl data file, a model folder's JSON files, a
checkpoint's ``megarl.json``), read so that a damaged one is named in one line: the file, where in it, and what to
do, instead of the decoder's ``'utf-8' codec can't decode byte 0xe9 in position 25`` or ``Expecting value: line
137 column 15`` with no file named.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class FileFormatError(ValueError):
    """A file that is not what it must be (not UTF-8 text, not valid JSON); the message names the file, the
    place in it and the fix. A ``ValueError``: the CLI reports it in one line, exit status 2."""


def not_utf8(path: str | os.PathLike, data: bytes, e: UnicodeDecodeError) -> str:
    """The words for ``e``, met decoding all of ``data`` (the bytes of ``path``) as UTF-8: the file, the line
    (1-based), the byte offset in the file (0-based) and the byte itself, and the fix."""
    line = data.count(b"\n", 0, e.start) + 1
    return (f"{path}: line {line} (byte offset {e.start}) holds byte 0x{data[e.start]:02x}, which is not UTF-8 "
            "text; save the file as UTF-8")


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of ``path``.

    Raises:
        FileFormatError: bytes that are not UTF-8, naming their line and byte offset (:func:`not_utf8`).
        OSError: the file cannot be read (FileNotFoundError: it does not exist).
    """
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileFormatError(not_utf8(path, data, e)) from None


def read_json(path: str | os.PathLike, fix: str = "the file is damaged or cut short: restore it") -> Any:
    """The JSON value in ``path``.

    Args:
        fix: what the user should do about a file that does not parse (said after the place).

    Raises:
        FileFormatError: not UTF-8 (:func:`read_text`), or not valid JSON, naming the line and column
            (``json.JSONDecodeError.lineno``/``colno``) and ``fix``.
        OSError: the file cannot be read (FileNotFoundError: it does not exist).
    """
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FileFormatError(f"{path}: not valid JSON at line {e.lineno}, column {e.colno} ({e.msg}); {fix}") \
            from None
