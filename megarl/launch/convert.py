"""``megarl convert`` and ``megarl export`` as functions: each checks its input, then runs the per-rank work of
:mod:`megarl.models.convert` in a local world (one process per rank; gloo on CPU) through
:func:`megarl.parallel.launch.run_world`."""

from __future__ import annotations

from pathlib import Path

from megarl.models.convert import check_conversion, convert_rank, export_rank
from megarl.parallel.launch import run_world


def convert_to_megarl(src: str | None, out: str, *, tp: int = 1, pp: int = 1, dtype: str | None = None) -> Path:
    """Import a Hugging Face directory or GGUF file (``None``: the default SmolLM2 GGUF) into a megarl
    checkpoint, sharded by a TP x PP world of local processes.

    Args:
        dtype: "float32", "bfloat16" or "float16"; default: the checkpoint's own (float32 for GGUF).

    Raises:
        SpecError: unknown architecture, a TP that does not divide heads/query groups, a PP that does not
            divide layers (before any process starts), missing or mismatched tensors.
    """
    check_conversion(src, tp, pp, dtype)
    return Path(run_world(convert_rank, tp * pp, src, str(Path(out).resolve()), tp, pp, dtype)[0])


def export_to_hf(ckpt_dir: str, out: str) -> Path:
    """Write a megarl checkpoint (any TP/PP it was saved at) as a Hugging Face directory.

    Raises:
        FileNotFoundError: ``ckpt_dir`` is not a megarl checkpoint.
    """
    from megarl.models.checkpoint import read_meta

    read_meta(ckpt_dir)
    return Path(run_world(export_rank, 1, ckpt_dir, out)[0])
