"""``megarl convert`` and ``megarl export`` as functions: each checks its input and claims its output folder
(:class:`megarl.output_folder.OutputFolder`: new or empty; its own earlier output only with ``overwrite``,
replaced; other files only with ``overwrite``, and kept; never a training run's folder or checkpoint), then runs
the per-rank work of :mod:`megarl.models.convert` in a local world (one process per rank; gloo on CPU) through
:func:`megarl.parallel.launch.run_world`.

A conversion's own output is its megarl checkpoint (``megarl.json`` without a training step, ``model/``,
``ranks/``); an export's, the files that its manifest :data:`EXPORT_MANIFEST` lists.
"""

from __future__ import annotations

import json
from pathlib import Path

from megarl.models.checkpoint import META_FILE, is_training_checkpoint
from megarl.models.convert import check_conversion, convert_rank, export_rank
from megarl.output_folder import OutputFolder, manifest_name
from megarl.parallel.launch import run_world

EXPORT_MANIFEST = manifest_name("export")  # the files an export wrote, so that a later export may replace them
CHECKPOINT_ENTRIES = (META_FILE, "model", "ranks")
HF_CONFIG = "config.json"  # what every export writes (megarl.models.hf_io.save_hf_checkpoint)
# a rank's errors that name the fix (a damaged checkpoint, a missing or mismatched tensor, a storage fault):
# raised as they are, so the command's line is theirs and not a rank's traceback
USER_ERRORS = (ValueError, OSError)


def convert_to_megarl(src: str | None, out: str, *, tp: int = 1, pp: int = 1, vpp: int = 1,
                      dtype: str | None = None, overwrite: bool = False) -> Path:
    """Import a Hugging Face directory or GGUF file (``None``: the default SmolLM2 GGUF) into a megarl
    checkpoint, sharded by a TP x PP world of local processes (``vpp`` model chunks per pipeline rank).

    Args:
        dtype: "float32", "bfloat16" or "float16"; default: the checkpoint's own (float32 for GGUF).
        overwrite: replace the command's earlier output in ``out``, or write into a folder that holds other
            files, keeping them (:mod:`megarl.output_folder`).

    Raises:
        SpecError: unknown architecture, a TP that does not divide heads/query groups, a PP that does not
            divide layers, a VPP without PP or whose PP x VPP does not divide layers (before any process
            starts), missing or mismatched tensors.
        OutputFolderError: ``out`` may not be written (:meth:`~megarl.output_folder.OutputFolder.claim`): a
            training run's folder or checkpoint, or files that no conversion wrote; or, without ``overwrite``, a
            checkpoint converted earlier.
    """
    check_conversion(src, tp, pp, dtype, vpp)
    folder = OutputFolder.claim(out, "convert", overwrite=overwrite, earlier=_converted_entries(Path(out).resolve()),
                                earlier_what="a megarl checkpoint converted earlier", writes=CHECKPOINT_ENTRIES)
    with folder:
        run_world(convert_rank, tp * pp, src, str(folder.staging), tp, pp, dtype, vpp, reraise=USER_ERRORS)
    return folder.target


def export_to_hf(ckpt_dir: str, out: str, *, overwrite: bool = False) -> Path:
    """Write a megarl checkpoint (any TP x PP x VPP it was saved at) as a Hugging Face directory, with the list of
    the files written (:data:`EXPORT_MANIFEST`).

    Raises:
        FileNotFoundError: ``ckpt_dir`` is not a megarl checkpoint.
        OutputFolderError: ``out`` may not be written (:meth:`~megarl.output_folder.OutputFolder.claim`): a
            training run's folder or checkpoint; without ``overwrite``, files that no export wrote or an earlier
            export; with it, a file of a name the export writes that no export wrote.
    """
    from megarl.models.checkpoint import read_meta

    read_meta(ckpt_dir)
    folder = OutputFolder.claim(out, "export", overwrite=overwrite, writes=(HF_CONFIG,))
    with folder:
        run_world(export_rank, 1, ckpt_dir, str(folder.staging), reraise=USER_ERRORS)
    return folder.target


def _converted_entries(folder: Path) -> set[str]:
    """The entries of ``folder`` that a conversion wrote: those of a megarl checkpoint that is no training
    checkpoint (:func:`~megarl.models.checkpoint.is_training_checkpoint`)."""
    if not (folder / META_FILE).is_file() or is_training_checkpoint(folder):
        return set()
    try:
        if json.loads((folder / META_FILE).read_text()).get("format") != "megarl":
            return set()
    except (ValueError, OSError, AttributeError):
        return set()
    return {name for name in CHECKPOINT_ENTRIES if (folder / name).exists()}
