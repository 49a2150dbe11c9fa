"""``megarl convert`` and ``megarl export`` as functions: each checks its input and its output folder, then runs
the per-rank work of :mod:`megarl.models.convert` in a local world (one process per rank; gloo on CPU) through
:func:`megarl.parallel.launch.run_world`.

The output folder: a new or empty one is written; one holding only what an earlier run of the same command
wrote (a megarl checkpoint: ``megarl.json``, ``model/``, ``ranks/``; an export: the files its
:data:`EXPORT_MANIFEST` lists) is replaced, atomically; any other is refused, unless ``overwrite``: then the
command's files replace those of the same names there and every other file stays. megarl never deletes a file
it did not write.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from megarl.models.checkpoint import META_FILE
from megarl.models.convert import check_conversion, convert_rank, export_rank
from megarl.parallel.launch import run_world

EXPORT_MANIFEST = "megarl_export.json"  # the files an export wrote, so that a later export may replace them
CHECKPOINT_ENTRIES = (META_FILE, "model", "ranks")


class OutputFolderError(ValueError):
    """An output folder holding files that megarl did not write; the message names them and the way out."""


def convert_to_megarl(src: str | None, out: str, *, tp: int = 1, pp: int = 1, vpp: int = 1,
                      dtype: str | None = None, overwrite: bool = False) -> Path:
    """Import a Hugging Face directory or GGUF file (``None``: the default SmolLM2 GGUF) into a megarl
    checkpoint, sharded by a TP x PP world of local processes (``vpp`` model chunks per pipeline rank).

    Args:
        dtype: "float32", "bfloat16" or "float16"; default: the checkpoint's own (float32 for GGUF).
        overwrite: write into a folder that holds other files (module docstring).

    Raises:
        SpecError: unknown architecture, a TP that does not divide heads/query groups, a PP that does not
            divide layers, a VPP without PP or whose PP x VPP does not divide layers (before any process
            starts), missing or mismatched tensors.
        OutputFolderError: ``out`` holds files that no conversion wrote, without ``overwrite``.
    """
    check_conversion(src, tp, pp, dtype, vpp)
    target = Path(out).resolve()
    staging = _staging(target, "convert", _megarl_entries(target), overwrite)
    run_world(convert_rank, tp * pp, src, str(staging), tp, pp, dtype, vpp)
    if staging != target:
        _move_into(staging, target, stale=())
    return target


def export_to_hf(ckpt_dir: str, out: str, *, overwrite: bool = False) -> Path:
    """Write a megarl checkpoint (any TP x PP x VPP it was saved at) as a Hugging Face directory, with the list of
    the files written (:data:`EXPORT_MANIFEST`).

    Raises:
        FileNotFoundError: ``ckpt_dir`` is not a megarl checkpoint.
        OutputFolderError: ``out`` holds files that no export wrote, without ``overwrite``.
    """
    from megarl.models.checkpoint import read_meta

    read_meta(ckpt_dir)
    target = Path(out).resolve()
    earlier = _exported_files(target)
    staging = _staging(target, "export", earlier, overwrite)
    run_world(export_rank, 1, ckpt_dir, str(staging))
    written = sorted(p.name for p in staging.iterdir())
    (staging / EXPORT_MANIFEST).write_text(json.dumps({"files": written}, indent=2) + "\n")
    if staging != target:
        _move_into(staging, target, stale=[f for f in earlier if f not in written])
    return target


def _megarl_entries(folder: Path) -> set[str]:
    """The entries of ``folder`` that a conversion wrote: those of a megarl checkpoint, when it is one."""
    if not (folder / META_FILE).is_file():
        return set()
    try:
        if json.loads((folder / META_FILE).read_text()).get("format") != "megarl":
            return set()
    except (ValueError, OSError):
        return set()
    return {name for name in CHECKPOINT_ENTRIES if (folder / name).exists()}


def _exported_files(folder: Path) -> set[str]:
    """The files of ``folder`` that an export wrote (its manifest, and the manifest itself)."""
    try:
        return {*json.loads((folder / EXPORT_MANIFEST).read_text())["files"], EXPORT_MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _staging(target: Path, command: str, ours: set[str], overwrite: bool) -> Path:
    """Where ``command`` writes: ``target`` itself when it is new, empty or entirely ``ours`` (the ranks
    replace it atomically), else, with ``overwrite``, a hidden sibling whose files then move in.

    Raises:
        OutputFolderError: ``target`` is a file, or holds files that are not ``ours``, without ``overwrite``.
    """
    if target.exists() and not target.is_dir():
        raise OutputFolderError(f"megarl {command}: the output {target} is a file; name a folder")
    foreign = sorted(p.name for p in target.iterdir() if p.name not in ours) if target.is_dir() else []
    if not foreign:
        return target
    if not overwrite:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputFolderError(f"megarl {command}: the output folder {target} holds files that megarl {command} "
                                f"did not write ({shown}); name a new or empty folder, or pass --overwrite to "
                                f"replace only the files {command} writes and keep the others")
    return target.with_name(f".{target.name}.megarl-{command}")


def _move_into(staging: Path, target: Path, stale) -> None:
    """Move every entry of ``staging`` into ``target`` (replacing entries of the same names), delete the
    ``stale`` files (an earlier export's that this one did not write again), then remove ``staging``."""
    for entry in sorted(staging.iterdir()):
        dest = target / entry.name
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        elif dest.exists() or dest.is_symlink():
            dest.unlink()
        os.replace(entry, dest)
    for name in stale:
        (target / name).unlink(missing_ok=True)
    staging.rmdir()
