"""The outputs of megarl's commands, and the one rule for them: megarl never replaces a file or folder that it
did not write in this run, the same command's output of an earlier run included, unless asked (``--overwrite``);
and what it replaces, it replaces whole: written beside, then renamed into place.

Output folders (``megarl convert``, ``megarl export``, ``megarl data ...``): a command writes into its output
folder OUT when OUT is new or empty. OUT may also hold

- what an earlier run of the same command wrote there, known by the command's own marker: for ``convert`` a
  megarl checkpoint that is no training checkpoint (its ``megarl.json`` records no training step), for the
  others the manifest ``megarl_<command>.json`` listing the files it wrote (:func:`manifest_name`). Refused,
  the message naming the folder and ``--overwrite``; with ``overwrite`` that earlier output is replaced;
- files of no earlier run of the command: refused, the message naming them, unless ``overwrite``: the command's
  files then go in beside the others, which stay as they were; a file of the same name as one the command writes
  is refused, never replaced (delete or move it first).

A path naming a file is refused. A training run's folder (:func:`is_run_folder`) and a training checkpoint (a
``megarl.json`` with a step, or anything in a run's ``checkpoints/``) are refused even with ``overwrite``: their
weights, optimizer state, data position and RNG states cannot be made again by any other command.

A command :meth:`OutputFolder.claim` s the folder before any work, then, in ``with folder:``, writes into
:attr:`OutputFolder.staging` (a hidden sibling of OUT); at the block's end :meth:`OutputFolder.finish` writes
the manifest, renames each entry into OUT and removes the files of its earlier output that it did not write
again. A command that fails (or dies) leaves OUT as it was: its staging folder is removed (by the next claim).

Output files (``megarl report``'s page and figures, ``megarl bench ... --json``, ``megarl sweep``'s table, CSV,
plot and job script): :func:`claim_outputs` refuses, before any work, the ones that exist unless ``overwrite``;
:func:`write_beside` writes each beside its place and renames it there.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

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
        staging: where the command writes: a hidden sibling of ``target`` (:func:`staging_path`).
        earlier: the entries of ``target`` that an earlier run of the command wrote (replaced; only with
            ``overwrite``).
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
              earlier: Iterable[str] | None = None, earlier_what: str | None = None,
              writes: Iterable[str] = ()) -> "OutputFolder":
        """Check that ``command`` may write into ``out``, before any of its work.

        Args:
            earlier: the entries of ``out`` that an earlier run of the command wrote, for a command whose output is
                its own marker; None: the ones its manifest lists.
            earlier_what: that earlier output in the refusal's words (default: "the output of an earlier megarl
                <command>").
            writes: names the command is known to write, refused up front when another file holds one.

        Raises:
            OutputFolderError: ``out`` is a file or part of a training run; without ``overwrite``, it holds files
                the command did not write, or an earlier run's output of the command (the message names the folder
                and ``--overwrite``); with it, a file of a name the command writes that the command did not write.
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
        if kept and not overwrite:
            raise OutputFolderError(f"megarl {command}: the output folder {target} holds files that megarl {command} "
                                    f"did not write ({_listed(kept)}); name a new or empty folder, or pass "
                                    f"--overwrite to write beside them (they are kept, never replaced)")
        if ours and not overwrite:
            raise OutputFolderError(f"megarl {command}: the output folder {target} holds "
                                    f"{earlier_what or f'the output of an earlier megarl {command}'} "
                                    f"({_listed(ours)}); pass --overwrite to replace it, or name a new or empty folder")
        staging = staging_path(target, command)
        folder = cls(target, command, staging, frozenset(ours), frozenset(kept), manifest)
        folder._refuse_clashes(set(writes))
        shutil.rmtree(staging, ignore_errors=True)  # a staging folder of this pid, left by a command that died
        remove_stale_stagings(target, command)
        return folder

    def __enter__(self) -> "OutputFolder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """:meth:`finish` after the command's work; after its failure, the staging folder removed."""
        if exc_type is None:
            self.finish()
        else:
            shutil.rmtree(self.staging, ignore_errors=True)

    def _refuse_clashes(self, names: set[str]) -> None:
        clash = names & self.kept
        if clash:
            raise OutputFolderError(f"megarl {self.command}: the output folder {self.target} holds {_listed(clash)}, "
                                    f"which megarl {self.command} writes but did not write there; it never replaces "
                                    "a file it did not write: delete or move it, or name another folder")

    def finish(self) -> list[str]:
        """After the command wrote :attr:`staging`: write the manifest, rename the staged entries into
        :attr:`target` (each replacing the earlier output's entry of its name, :func:`_rename_over`; a new
        ``target``: the staging folder renamed), delete the earlier output's files not written again. Returns the
        names written.

        Raises:
            OutputFolderError: the command wrote a file of a name that a kept file has (nothing of
                :attr:`target` was changed; the staged files are removed).
        """
        self.staging.mkdir(parents=True, exist_ok=True)  # a command that wrote nothing
        written = sorted(p.name for p in self.staging.iterdir() if p.name != self.manifest)
        try:
            self._refuse_clashes(set(written))
        except OutputFolderError:
            shutil.rmtree(self.staging, ignore_errors=True)
            raise
        if self.manifest:
            tmp = self.staging / f"{self.manifest}.tmp"
            tmp.write_text(json.dumps({"files": written}, indent=2) + "\n")
            os.replace(tmp, self.staging / self.manifest)
        if not self.target.exists():
            os.rename(self.staging, self.target)
        else:
            for entry in sorted(self.staging.iterdir()):
                _rename_over(entry, self.target / entry.name)
            self.staging.rmdir()
        for name in self.earlier - set(written) - {self.manifest}:
            _remove(self.target / name)
        return written


def staging_path(target: Path, command: str, pid: int | None = None) -> Path:
    """Where ``command`` in process ``pid`` (default: this one) writes its output ``target`` (a file or folder)
    before renaming it there: a hidden sibling, on the same file system (so that the rename is one step), of
    this process's own (two runs that prepare the same data at once each stage their own copy)."""
    pid = os.getpid() if pid is None else pid
    return target.with_name(f".{target.name}.megarl-{command.replace(' ', '-')}-{pid}")


def remove_stale_stagings(target: Path, command: str) -> None:
    """Remove the staging copies of ``target`` (:func:`staging_path`) left by processes that died before their
    rename; another live process's copy stays."""
    prefix = staging_path(target, command, 0).name[:-1]
    for path in target.parent.glob(glob.escape(prefix) + "*"):
        pid = path.name[len(prefix):]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def _rename_over(new: Path, dest: Path) -> None:
    """Put ``new`` at ``dest`` by renames: a file replaces a file in one step (``os.replace``); an entry in the way
    of a folder (or a folder in the way of a file) is renamed aside first and removed after."""
    if not (dest.exists() or dest.is_symlink()) or (new.is_file() and dest.is_file() and not dest.is_symlink()):
        os.replace(new, dest)
        return
    aside = dest.with_name(f".{dest.name}.megarl-replaced-{os.getpid()}")
    _remove(aside)  # left by a command that died between the renames
    os.rename(dest, aside)
    os.rename(new, dest)
    _remove(aside)


def claim_outputs(paths: Iterable[str | os.PathLike], command: str, *, overwrite: bool = False,
                  alternative: str = "") -> list[Path]:
    """Check, before any of ``command``'s work, that it may write its output files or folders ``paths``: each is
    new, or with ``overwrite`` replaced (:func:`write_beside`); one that exists is never replaced otherwise,
    whoever wrote it (an earlier run of the command included). Returns the paths (absolute).

    Raises:
        OutputFolderError: without ``overwrite``, naming the paths that exist and ``--overwrite`` (and
            ``alternative``, another way out, e.g. ", or give another --json").
    """
    paths = [Path(p).absolute() for p in paths]
    there = [p for p in paths if p.exists() or p.is_symlink()]
    if there and not overwrite:
        names = ", ".join(str(p) for p in there)
        raise OutputFolderError(f"megarl {command}: {names} exist{'s' if len(there) == 1 else ''} (an earlier run's "
                                f"output, or not megarl's); megarl {command} replaces no file it did not write: "
                                f"pass --overwrite to replace {'it' if len(there) == 1 else 'them'}{alternative}")
    return paths


def write_beside(path: str | os.PathLike, write: Callable[[Path], object], command: str) -> Path:
    """Make the file or folder ``path`` with ``write(tmp)``, ``tmp`` a hidden sibling (:func:`staging_path`),
    then rename ``tmp`` to ``path`` (:func:`_rename_over`): a reader sees the earlier ``path`` or the new one,
    never half of one, and a ``write`` that raises leaves ``path`` as it was. Claim ``path`` first
    (:func:`claim_outputs`). Returns ``path``."""
    path = Path(path)
    tmp = staging_path(path, command)
    _remove(tmp)
    remove_stale_stagings(path, command)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        write(tmp)
    except BaseException:
        _remove(tmp)
        raise
    _rename_over(tmp, path)
    return path


def _manifest_files(path: Path) -> set[str]:
    """The files a manifest lists (none when it cannot be read: then nothing counts as the command's)."""
    try:
        files = json.loads(path.read_text())["files"]
        return {f for f in files if isinstance(f, str) and "/" not in f and f not in ("", ".", "..")}
    except (OSError, ValueError, KeyError, TypeError):
        return set()
