"""The folders that megarl's commands write into (``megarl convert``, ``megarl export``, ``megarl data ...``), and
the one rule for them: megarl never deletes or replaces a file it did not write.

A command writes into its output folder OUT when OUT is

- new or empty;
- or holds only what an earlier run of the same command wrote there, known by the command's own marker: for
  ``convert`` a megarl checkpoint that is no training checkpoint (its ``megarl.json`` records no training step),
  for the others the manifest ``megarl_<command>.json`` listing the files it wrote (:func:`manifest_name`). That
  earlier output is replaced (``convert``'s only with ``overwrite``: :func:`megarl.launch.convert.convert_to_megarl`).

Any other folder is refused, the message naming its files, unless ``overwrite`` (``--overwrite``): the command's
files then go in beside the others, which stay as they were; a file of the same name as one the command writes
is refused, never replaced (delete or move it first). A path naming a file is refused. A training run's folder
(:func:`is_run_folder`) and a training checkpoint (a ``megarl.json`` with a step, or anything in a run's
``checkpoints/``) are refused even with ``overwrite``: their weights, optimizer state, data position and RNG
states cannot be made again by any other command.

A command :meth:`OutputFolder.claim` s the folder before any work, writes into :attr:`OutputFolder.staging`
(OUT itself when it holds nothing else, else a hidden sibling whose entries then move in), and
:meth:`OutputFolder.finish` es: the manifest, the move, and the removal of files of its earlier output that
it did not write again.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

# what `megarl train` leaves in every run folder: its lock (taken before anything is written), the metrics of
# its steps, its checkpoints (megarl.parallel.run_lock.LOCK_FILE, megarl.trainer.metrics, megarl.models.checkpoint)
RUN_FOLDER_SIGNS = ("run.lock", "metrics.jsonl", "checkpoints")
RUN_CHECKPOINTS = "checkpoints"  # megarl.models.checkpoint.RUN_CHECKPOINTS (that module imports none of this one)


class OutputFolderError(ValueError):
    """An output folder that a command may not write into; the message names the folder, the files and the way
    out."""


def manifest_name(command: str) -> str:
    """The manifest of the files ``command`` wrote (``"export"``: ``megarl_export.json``; ``"data gsm8k"``:
    ``megarl_data_gsm8k.json``)."""
    return f"megarl_{command.replace(' ', '_')}.json"


def is_run_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is the folder of a training run (it holds one of :data:`RUN_FOLDER_SIGNS`)."""
    return Path(path).is_dir() and any((Path(path) / sign).exists() for sign in RUN_FOLDER_SIGNS)


def training_run_part(path: Path) -> str | None:
    """What of a training run ``path`` (absolute) is, in words, or None: the run's folder, a folder in its
    ``checkpoints/`` (whether it exists or not), or a training checkpoint anywhere."""
    from megarl.models.checkpoint import is_training_checkpoint

    if is_run_folder(path):
        return "the folder of a training run (megarl train's metrics, samples, config and checkpoints)"
    for folder in path.parents:
        if folder.name == RUN_CHECKPOINTS and is_run_folder(folder.parent):
            return (f"in the checkpoints of the training run in {folder.parent} (weights, optimizer state, data "
                    "position and RNG states, which only that run can write)")
    if is_training_checkpoint(path):
        return "a training checkpoint (weights, optimizer state, data position and RNG states of a run)"
    return None


def _listed(names: Iterable[str], limit: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


@dataclass(frozen=True)
class OutputFolder:
    """One command's claim on its output folder (module docstring).

    Attributes:
        target: the output folder (absolute).
        command: the command's name in messages (``"convert"``, ``"data arithmetic"``).
        staging: where the command writes: ``target`` itself, or a hidden sibling when ``target`` holds files
            the command did not write.
        earlier: the entries of ``target`` that an earlier run of the command wrote (replaced).
        kept: the entries of ``target`` it did not write (kept; only with ``overwrite``).
        manifest: the manifest file's name, or None for a command whose output is its own marker (convert).
    """

    target: Path
    command: str
    staging: Path
    earlier: frozenset[str]
    kept: frozenset[str]
    manifest: str | None

    @classmethod
    def claim(cls, out: str | os.PathLike, command: str, *, overwrite: bool = False,
              earlier: Iterable[str] | None = None, writes: Iterable[str] = ()) -> "OutputFolder":
        """Check that ``command`` may write into ``out``, before any of its work.

        Args:
            earlier: the entries of ``out`` that an earlier run of the command wrote, for a command whose output is
                its own marker; None: the ones its manifest lists.
            writes: names the command is known to write, refused up front when another file holds one.

        Raises:
            OutputFolderError: ``out`` is a file, part of a training run, or holds files the command did not
                write (without ``overwrite``; with it, a file of a name the command writes).
        """
        target = Path(out).resolve()
        if target.exists() and not target.is_dir():
            raise OutputFolderError(f"megarl {command}: the output {target} is a file; name a folder")
        part = training_run_part(target)
        if part:
            raise OutputFolderError(f"megarl {command}: the output folder {target} is {part}; megarl {command} "
                                    "never writes there, --overwrite included: name another folder")
        manifest = None if earlier is not None else manifest_name(command)
        if earlier is None:
            earlier = _manifest_files(target / manifest) | {manifest} if (target / manifest).is_file() else set()
        present = {p.name for p in target.iterdir()} if target.is_dir() else set()
        ours = present & set(earlier)
        kept = present - ours
        folder = cls(target, command, target, frozenset(ours), frozenset(kept), manifest)
        if not kept:
            return folder
        if not overwrite:
            raise OutputFolderError(f"megarl {command}: the output folder {target} holds files that megarl {command} "
                                    f"did not write ({_listed(kept)}); name a new or empty folder, or pass "
                                    f"--overwrite to write beside them (they are kept, never replaced)")
        folder._refuse_clashes(set(writes))
        staging = target.with_name(f".{target.name}.megarl-{command.replace(' ', '-')}")
        shutil.rmtree(staging, ignore_errors=True)  # a staging folder left by a command that died
        return cls(target, command, staging, frozenset(ours), frozenset(kept), manifest)

    def _refuse_clashes(self, names: set[str]) -> None:
        clash = names & self.kept
        if clash:
            raise OutputFolderError(f"megarl {self.command}: the output folder {self.target} holds {_listed(clash)}, "
                                    f"which megarl {self.command} writes but did not write there; it never replaces "
                                    "a file it did not write: delete or move it, or name another folder")

    def finish(self) -> list[str]:
        """After the command wrote :attr:`staging`: write the manifest, move the staged entries into
        :attr:`target` (replacing those of the earlier output), delete the earlier output's files not written
        again. Returns the names written.

        Raises:
            OutputFolderError: the command wrote a file of a name that a kept file has (nothing of
                :attr:`target` was changed; the staged files are removed).
        """
        written = sorted(p.name for p in self.staging.iterdir() if p.name != self.manifest)
        if self.staging != self.target:
            try:
                self._refuse_clashes(set(written))
            except OutputFolderError:
                shutil.rmtree(self.staging, ignore_errors=True)
                raise
        if self.manifest:
            tmp = self.staging / f"{self.manifest}.tmp"
            tmp.write_text(json.dumps({"files": written}, indent=2) + "\n")
            os.replace(tmp, self.staging / self.manifest)
        if self.staging != self.target:
            for entry in sorted(self.staging.iterdir()):
                dest = self.target / entry.name
                if dest.is_dir() and not dest.is_symlink():
                    shutil.rmtree(dest)
                elif dest.exists() or dest.is_symlink():
                    dest.unlink()
                os.replace(entry, dest)
            self.staging.rmdir()
        for name in self.earlier - set(written) - {self.manifest}:
            stale = self.target / name
            shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink(missing_ok=True)
        return written


def _manifest_files(path: Path) -> set[str]:
    """The files a manifest lists (none when it cannot be read: then nothing counts as the command's)."""
    try:
        files = json.loads(path.read_text())["files"]
        return {f for f in files if isinstance(f, str) and "/" not in f and f not in ("", ".", "..")}
    except (OSError, ValueError, KeyError, TypeError):
        return set()
