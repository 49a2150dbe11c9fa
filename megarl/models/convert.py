"""``megarl convert`` (HF directory or GGUF -> megarl/Megatron dist checkpoint) and ``megarl export`` (back).

Both run a local world (one process per rank; gloo on CPU) through :func:`megarl.parallel.launch.run_world`.
Convert builds the Megatron model at the requested TP x PP, each rank reading only the safetensors slices it
holds, and saves a layout-free dist checkpoint. Export loads that checkpoint at TP=1 x PP=1 (megatron-core
reshards on load), assembles the canonical tensors and writes config.json + safetensors: the round trip
reproduces every HF tensor bit for bit when the dtype is kept.
"""

from __future__ import annotations

import logging
from pathlib import Path

from megarl.parallel.launch import run_world

log = logging.getLogger(__name__)


def _convert_rank(rank: int, world: int, src: str, out: str, tp: int, pp: int, dtype_name: str | None) -> str:
    from megarl.models import checkpoint as ck
    from megarl.models.hf_io import open_hf_checkpoint
    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    ckpt = open_hf_checkpoint(src)
    ckpt.check_complete()
    dtype = ck.DTYPES[dtype_name] if dtype_name else ckpt.dtype
    mesh = ParallelLayout(tp=tp, pp=pp, dp=1)
    initialize_model_parallel(mesh)
    model = build_model(ckpt.spec, mesh, params_dtype=dtype, init_weights=False)
    ck.load_hf_weights(model, ckpt)
    return str(ck.save_model(out, model, tokenizer=str(ckpt.path), source=str(ckpt.path)))


def convert_to_megarl(src: str | None, out: str, *, tp: int = 1, pp: int = 1, dtype: str | None = None) -> Path:
    """Import a Hugging Face directory or GGUF file (``None``: the default SmolLM2 GGUF) into a megarl
    checkpoint, sharded by a TP x PP world of local processes.

    Args:
        dtype: "float32", "bfloat16" or "float16"; default: the checkpoint's own (float32 for GGUF).

    Raises:
        SpecError: unknown architecture, a TP that does not divide heads/query groups, a PP that does not
            divide layers, missing or mismatched tensors (raised before any process starts where possible).
    """
    from megarl.models.checkpoint import DTYPES, source_spec
    from megarl.models.megatron import check_layout
    from megarl.parallel.mesh import ParallelLayout

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    spec, _, _ = source_spec(src)
    check_layout(spec, ParallelLayout(tp=tp, pp=pp))
    return Path(run_world(_convert_rank, tp * pp, src, out, tp, pp, dtype)[0])


def _export_rank(rank: int, world: int, ckpt_dir: str, out: str) -> str:
    from megarl.models import checkpoint as ck
    from megarl.models.hf_io import save_hf_checkpoint
    from megarl.models.megatron import build_model
    from megarl.models.weights import assemble_canonical
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.reshard.layout import megatron_rank_tensors

    meta = ck.read_meta(ckpt_dir)
    spec = ck.checkpoint_spec(ckpt_dir)
    mesh = ParallelLayout()
    initialize_model_parallel(mesh)
    model = build_model(spec, mesh, params_dtype=ck.DTYPES[meta["dtype"]], init_weights=False)
    ck.load_model(ckpt_dir, model)
    tensors = assemble_canonical(megatron_rank_tensors(spec, mesh, 0, 0, padded_vocab=model.vocab_size),
                                 dict(model.named_parameters()), spec.hf_tensor_shapes())
    path = save_hf_checkpoint(out, spec, tensors)
    _copy_tokenizer(meta.get("tokenizer"), path)
    return str(path)


def _copy_tokenizer(source: str | None, out_dir: Path) -> None:
    """Save the tokenizer of the original model beside the exported weights, where one is known."""
    if not source:
        return
    try:
        from megarl.models.hf_io import load_tokenizer

        load_tokenizer(source).save_pretrained(str(out_dir))
    except (OSError, ValueError) as e:
        log.warning("exported weights without a tokenizer: could not load one from %s (%s)", source, e)


def export_to_hf(ckpt_dir: str, out: str) -> Path:
    """Write a megarl checkpoint (any TP/PP it was saved at) as a Hugging Face directory.

    Raises:
        FileNotFoundError: ``ckpt_dir`` is not a megarl checkpoint.
    """
    from megarl.models.checkpoint import read_meta

    read_meta(ckpt_dir)
    return Path(run_world(_export_rank, 1, ckpt_dir, out)[0])
