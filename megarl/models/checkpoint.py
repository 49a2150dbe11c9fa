"""Megatron distributed checkpoints: model import (HF/GGUF -> Megatron shards), save/load, HF export.

A megarl checkpoint is a directory::

    megarl.json          what it holds: {"format": "megarl", "hf_config": ..., "dtype": ..., "tokenizer": ...,
                         "files": {every other file's path: its size in bytes}, "hashes": {"xxh3_128": {every
                         other file's path: its content hash}}, plus whatever the trainer adds: step, dataloader
                         state, ...}
    model/               megatron-core dist checkpoint (torch_dist) of the actor ("model") and, when saved by
                         the trainer, its optimizer and the critic: metadata.json (its format), .metadata (the
                         index: every tensor's file, offset and length), __<rank>_<k>.distcp, common.pt
    ranks/               per-rank objects (the trainer's RNG states)

Checkpoints are written atomically: into ``<dir>.tmp`` and renamed once every rank has finished, so a crash
mid-save leaves the previous checkpoint intact. A checkpoint damaged afterwards (a file truncated, deleted or
overwritten, a torn ``megarl.json``) is found before anything loads it by
:func:`~megarl.models.integrity.checkpoint_fault` (sizes, JSON, megatron's index, content hashes; no tensor is
read), which :func:`read_meta`, every reader's first step, runs; :func:`sound_checkpoint` is a run folder's newest
checkpoint that passes it. Because megatron's dist checkpoints are layout-free, one saved
at TP=2 x PP=1 loads at TP=1 x PP=2, and one saved at PP=2 x VPP=2 (model chunks) at PP=1 (megatron-core's
resharding loader).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import queue
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megarl.config import DTYPE_TABLE
from megarl.models.hf_io import (HFCheckpoint, open_hf_checkpoint, read_generation_config, read_hf_config,
                                 resolve_model_path)
from megarl.models.integrity import META_FILE, checkpoint_fault, files_meta, record_files
from megarl.models.layout import VALUE_HEAD
from megarl.models.layout_lora import lora_canonical_shapes
from megarl.models.layout_megatron import megatron_rank_tensors
from megarl.models.lora import is_adapter
from megarl.models.spec import ModelSpec, SpecError
from megarl.models.weights import fill_local_tensors, preset_reader
from megarl.parallel.faults import fault_point
from megarl.parallel.mesh import ParallelLayout
from megarl.storage import STORAGE_ERRNOS, StorageError, describe, storage_cause, write_fault
from megarl.textfiles import read_json

log = logging.getLogger(__name__)

CHECKPOINT_FIX = "the checkpoint is damaged: restore the file, or use an older checkpoint"
CHECKPOINT_PREFIX = "step_"  # a run's checkpoints: <run folder>/checkpoints/step_<N>
RUN_CHECKPOINTS = "checkpoints"
DTYPES = {name: getattr(torch, name) for name in DTYPE_TABLE}  # model.dtype -> torch (megarl.config.DTYPE_TABLE)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_megarl_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / META_FILE).is_file()


def is_lora_checkpoint(source) -> bool:
    """A megarl checkpoint of a LoRA actor: its adapters, and the base model it names (``lora.base``)."""
    return isinstance(source, (str, os.PathLike)) and is_megarl_checkpoint(source) and "lora" in read_meta(source)


def is_training_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint that ``megarl train`` wrote (its ``megarl.json`` records the step; a
    conversion's does not), wherever it now lies."""
    try:
        return is_megarl_checkpoint(path) and "step" in json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError):
        return False


def run_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """A run folder's complete ``checkpoints/step_<N>`` checkpoints, oldest first (a ``step_<N>.tmp`` left by
    a save that died is never one of them)."""
    found = [p for p in (Path(run_dir) / RUN_CHECKPOINTS).glob(f"{CHECKPOINT_PREFIX}*")
             if re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name) and p.is_dir() and is_megarl_checkpoint(p)]
    return sorted(found, key=_step)


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix(CHECKPOINT_PREFIX))


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a run folder, or None."""
    found = run_checkpoints(run_dir)
    return found[-1] if found else None


class CheckpointDamagedError(ValueError):
    """A damaged checkpoint: one that :func:`checkpoint_fault` finds damaged when :func:`read_meta` reads it, or
    whose files passed it but did not load (bytes overwritten in a checkpoint written before content hashes):
    ``path`` and ``fault``, in words naming the file (and the tensor) and the cause."""

    def __init__(self, path: str | os.PathLike, fault: str):
        super().__init__(f"the checkpoint {path} is damaged: {fault}; {CHECKPOINT_FIX}")
        self.path, self.fault = Path(path), fault

    def __reduce__(self):  # a rank's error raised again by its parent (megarl.parallel.launch.run_world)
        return type(self), (self.path, self.fault)


def _load_error(e: BaseException) -> str:
    """A loader's error in one short phrase (torch's weights-only unpickler explains its default first)."""
    text = (str(e).split("WeightsUnpickler error:")[-1].strip().splitlines() or ["no detail"])[0]
    return f"{type(e).__name__}: {text[:200]}"


def read_fault(path: str | os.PathLike) -> str | None:
    """The first item of a checkpoint's ``model/`` that does not load, in words naming its file, its tensor and
    its bytes, or None when every item loads. Reads the whole checkpoint: called after a load failed, never
    before."""
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

    folder = Path(path) / "model"
    index = FileSystemReader(str(folder)).read_metadata()
    for key, info in sorted(index.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        tensor = isinstance(index.state_dict_metadata.get(key.fqn), TensorStorageMetadata)
        try:
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=tensor)
        except Exception as e:  # noqa: BLE001 (overwritten bytes: UnpicklingError, RuntimeError, EOFError, ...)
            return (f"model/{info.relative_path}: {key.fqn} (bytes {info.offset}-{info.offset + info.length}) "
                    f"cannot be read ({_load_error(e)})")
    return None


def sound_checkpoint(run_dir: str | os.PathLike, below: Path | None = None
                     ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint of a run folder that :func:`checkpoint_fault` finds sound (None: none is), and the
    newer ones found damaged, newest first, each with its fault; with ``below``, among those older than it."""
    damaged: list[tuple[Path, str]] = []
    found = run_checkpoints(run_dir)
    if below is not None:
        found = [p for p in found if _step(p) < _step(below)]
    for p in reversed(found):
        fault = checkpoint_fault(p)
        if fault is None:
            return p, damaged
        damaged.append((p, fault))
    return None, damaged


def run_folder_as_model(path: str | os.PathLike) -> str | None:
    """When ``path`` is a training run's folder (``runs/<name>`` with its ``checkpoints/``, given where a model or
    a checkpoint goes: :func:`source_spec`, :func:`read_meta`), the
    one line that says so and names the checkpoint to give instead: the newest sound one (:func:`sound_checkpoint`)
    and the newer ones passed over, each with its fault; None when ``path`` is no run folder."""
    if is_megarl_checkpoint(path) or not (Path(path) / RUN_CHECKPOINTS).is_dir():
        return None
    sound, damaged = sound_checkpoint(path)
    passed = "; ".join(f"{p.name} is damaged: {fault}" for p, fault in damaged)
    if sound is not None:
        return (f"{path} is a run folder, not a model: give one of its checkpoints, e.g. the newest sound one, "
                f"{sound}" + (f" ({passed})" if passed else ""))
    return (f"{path} is a run folder, not a model, and holds no sound checkpoint"
            + (f" ({passed})" if passed else "") + ": give a model (a Hugging Face directory, a .gguf file or a "
            "megarl checkpoint)")


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``megarl.json`` of a checkpoint whose files are sound: every reader of a checkpoint (a resume, eval,
    export, a model or reference load) reads it here, so each refuses a damaged one alike, before it loads
    anything (:func:`checkpoint_fault`: sizes, megatron's index and content hashes, read once per process).

    Raises:
        FileNotFoundError: not a megarl checkpoint directory.
        CheckpointDamagedError: a file is missing, cut short or holds other bytes than were written.
    """
    f = Path(path) / META_FILE
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} does not exist (expected a megarl checkpoint: a folder with {META_FILE})")
    if not f.is_file():
        raise FileNotFoundError(run_folder_as_model(path) or f"{path} is not a megarl checkpoint (no {META_FILE}); "
                                "convert a Hugging Face checkpoint with `megarl convert`")
    meta = read_json(f, CHECKPOINT_FIX)  # a torn megarl.json named with its line and column
    if fault := checkpoint_fault(path):
        raise CheckpointDamagedError(path, fault)
    return meta


def checkpoint_spec(path: str | os.PathLike) -> ModelSpec:
    """The model spec stored in a megarl checkpoint."""
    return ModelSpec.from_hf_config(read_meta(path)["hf_config"])


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare ``GPTModel`` under megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def as_chunks(model) -> list[torch.nn.Module]:
    """A rank's model as its list of bare chunks: ``[model]`` for one model, the chunks of a list (VPP)."""
    return [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]


def chunk_parameters(model) -> dict[str, torch.Tensor]:
    """The parameters of a rank's model by local name: a single model's own names
    (``decoder.layers.0.mlp.linear_fc1.weight``), with VPP prefixed by the chunk (``1.decoder.layers.0...``, as
    ``torch.nn.ModuleList(chunks).named_parameters()`` names them); the names of
    :func:`megarl.models.layout_megatron.megatron_rank_tensors`.

    Args:
        model: a ``GPTModel`` or a list of chunks (possibly DDP-wrapped: the wrapper's ``module.`` is left out).
    """
    chunks = as_chunks(model)
    if len(chunks) == 1:
        return dict(chunks[0].named_parameters())
    return {f"{c}.{n}": p for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()}


def chunks_sharded_state_dict(model) -> dict:
    """megatron's sharded state dict of a rank's model: one chunk's own, or with VPP one per chunk under
    ``model0``, ``model1``... (as Megatron-LM saves them). The sharded tensors carry global layer numbers
    (``get_transformer_layer_offset``), so the checkpoint is the same whatever the PP x VPP it was saved at."""
    chunks = as_chunks(model)
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{c}": chunk.sharded_state_dict() for c, chunk in enumerate(chunks)}


def load_chunks_state_dict(model, state: dict) -> None:
    """Load what :func:`load_checkpoint` returned for :func:`chunks_sharded_state_dict` into the chunks."""
    chunks = as_chunks(model)
    if len(chunks) == 1:
        chunks[0].load_state_dict(state, strict=False)
        return
    for c, chunk in enumerate(chunks):
        chunk.load_state_dict(state[f"model{c}"], strict=False)


def _coords() -> tuple[ParallelLayout, int, int, int]:
    """This rank's mesh and its TP, PP and EP ranks, from megatron's ``parallel_state``."""
    from megatron.core import parallel_state as ps

    mesh = ParallelLayout(tp=ps.get_tensor_model_parallel_world_size(),
                          pp=ps.get_pipeline_model_parallel_world_size(),
                          dp=ps.get_data_parallel_world_size(),
                          ep=ps.get_expert_model_parallel_world_size(),
                          cp=ps.get_context_parallel_world_size(),
                          vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1)
    return (mesh, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_expert_model_parallel_rank())


def load_hf_weights(model, ckpt: HFCheckpoint) -> None:
    """Fill this rank's Megatron shard of ``model`` (actor or critic, local or TE layer spec; a model or, with
    VPP, the list of its chunks) from a Hugging Face checkpoint, reading only the slices this rank holds. A critic
    built from a causal-LM checkpoint keeps its zero value head.

    Raises:
        SpecError: the checkpoint misses a tensor or has another shape than the model's spec.
    """
    bare = as_chunks(model)[0]
    spec: ModelSpec = bare.megarl_spec
    if ckpt.spec.hf_tensor_shapes() != spec.hf_tensor_shapes():
        raise SpecError(f"checkpoint {ckpt.path} describes another model than the one built: "
                        f"{ckpt.spec} vs {spec}")
    _fill_from_canonical(model, ckpt.read, value_head=VALUE_HEAD in ckpt.tensor_names)


def _fill_from_canonical(model, read, *, value_head: bool = True) -> None:
    """Fill this rank's Megatron shard of ``model`` (a model or the list of its chunks) from canonical tensors
    (``read(name, box)``, :func:`~megarl.models.weights.fill_local_tensors`); a critic without ``value_head``
    keeps its own (zero) value head."""
    bare = as_chunks(model)[0]
    mesh, tp_rank, pp_rank, ep_rank = _coords()
    local = megatron_rank_tensors(bare.megarl_spec, mesh, tp_rank, pp_rank, role=bare.megarl_role,
                                  use_te=bare.megarl_use_te, padded_vocab=bare.vocab_size, ep_rank=ep_rank,
                                  moe_experts=bare.megarl_moe_experts)
    if bare.megarl_role == "critic" and not value_head:
        local = {n: t for n, t in local.items() if not any(b.name == VALUE_HEAD for b in t.blocks)}
    fill_local_tensors(local, chunk_parameters(as_chunks(model)), read)


def load_preset_weights(model, seed: int) -> None:
    """Give this rank's shard of a ``preset:NAME`` model (a model or the list of its chunks) its random weights:
    the canonical tensors of :func:`~megarl.models.weights.preset_reader` (megatron's init distribution, drawn
    from ``seed`` and each tensor's name), sliced like a Hugging Face checkpoint's, so the model is the same at
    every TP / PP / EP / VPP layout (a critic's value head zero, as one built from a causal LM)."""
    bare = as_chunks(model)[0]
    device = next(bare.parameters()).device
    _fill_from_canonical(model, preset_reader(bare.megarl_spec, bare.megarl_role, seed, device))


def init_adapters(model, seed: int) -> None:
    """Give this rank's LoRA adapters (a model built with ``lora``, or the list of its chunks) their start values,
    the same at every layout: each canonical ``A`` uniform in ``[-1/sqrt(cols), 1/sqrt(cols)]`` (PEFT's and
    ``torch.nn.Linear``'s Kaiming-uniform init), drawn by a generator seeded with ``seed`` and the tensor's name,
    and every ``B`` zero, so the model starts as its base."""
    bare = as_chunks(model)[0]
    spec, lora = bare.megarl_spec, bare.megarl_lora
    shapes = lora_canonical_shapes(spec, lora)
    mesh, tp_rank, pp_rank, ep_rank = _coords()
    local = megatron_rank_tensors(spec, mesh, tp_rank, pp_rank, use_te=bare.megarl_use_te,
                                  padded_vocab=bare.vocab_size, ep_rank=ep_rank, lora=lora,
                                  moe_experts=bare.megarl_moe_experts)
    drawn: dict[str, torch.Tensor] = {}

    def start(name: str, box: tuple[slice, ...]) -> torch.Tensor:
        if ".lora_B." in name:
            return torch.zeros(shapes[name])[box]
        if name not in drawn:
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            bound = 1.0 / shapes[name][1] ** 0.5
            drawn[name] = torch.empty(shapes[name]).uniform_(-bound, bound, generator=g)
        return drawn[name][box]

    fill_local_tensors({n: t for n, t in local.items() if is_adapter(n)}, chunk_parameters(as_chunks(model)), start)


def _write_results_in_process() -> None:
    """Give megatron-core's checkpoint writer a plain thread queue for its results, once per process.

    The writer passes its threads' results to the saving process through a queue that megatron-core makes on first
    use as a ``multiprocessing`` Manager's (``get_write_results_queue``), for saves written by another process. megarl
    saves in this process (``dist_checkpointing.save``: the writer's threads, synchronously), so that Manager was a
    Python process spawned by every rank at its first save for nothing (a second or more of start-up on a busy CPU;
    each test's training run paid it). The writer's ``put`` and ``get_nowait`` are those of :class:`queue.Queue`.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(directory: str | os.PathLike, sharded_state_dict: dict, meta: dict[str, Any], *,
                    per_rank: dict[str, Any] | None = None) -> Path:
    """Save a megatron sharded state dict and ``meta`` as a megarl checkpoint, atomically. Collective.

    Args:
        directory: final checkpoint directory (replaced if it exists).
        sharded_state_dict: e.g. ``{"model": model.sharded_state_dict(), "optimizer": ...}``.
        meta: JSON-serialisable description (must include ``hf_config``).
        per_rank: objects that differ between ranks (RNG states), saved as ``ranks/<name>_<rank>.pt``.

    Returns:
        The checkpoint directory.

    Raises:
        StorageError: the checkpoint could not be written for a fault of the storage (a full disk or quota, a
            read-only file system, a file where a folder must be: :mod:`megarl.storage`), naming the folder and
            the cause. On a failure each rank that meets it removes the partial ``<directory>.tmp`` once its own
            writes have stopped (a rank's writer may still add files after another rank failed and removed the
            folder); the previous checkpoint of that name, if any, is kept.
    """
    from megatron.core import dist_checkpointing

    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    writer_errors: list[str] = []
    try:
        with _writer_errors(writer_errors):
            if rank == 0:
                if tmp.exists():
                    shutil.rmtree(tmp)
                (tmp / "model").mkdir(parents=True)
            dist.barrier()
            _write_results_in_process()
            dist_checkpointing.save(sharded_state_dict, str(tmp / "model"))
        if per_rank:
            (tmp / "ranks").mkdir(exist_ok=True)
            for name, obj in per_rank.items():
                torch.save(obj, tmp / "ranks" / f"{name}_{rank}.pt")
        dist.barrier()
        records = [None] * dist.get_world_size()  # every rank's files are written: each rank hashes its share
        dist.all_gather_object(records, record_files(tmp, rank, dist.get_world_size()))
        if rank == 0:
            meta = {**meta, **files_meta({k: v for part in records for k, v in part.items()})}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
            fault_point("checkpoint.before_rename")
            if final.exists():
                old = final.with_name(final.name + ".old")
                if old.exists():
                    shutil.rmtree(old)
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old)
            else:
                tmp.rename(final)
    except BaseException as e:  # torch's CheckpointException is a BaseException
        fault = _save_fault(e, writer_errors, tmp)  # first: removing the partial files frees the full disk
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint would keep a full disk full
        if fault is None:
            for message in writer_errors:  # held back while the save ran, in case they were the fault's
                log.error("megatron-core's checkpoint writer: %s", message)
            raise
        raise StorageError(f"cannot save the checkpoint {final}: {fault[0]}; the partial {tmp.name} was removed. "
                           "Free space or fix the folder, then --resume continues from the newest complete checkpoint",
                           fault[1]) from e
    dist.barrier()
    fault_point("checkpoint.saved")
    return final


WRITER_LOGGER = "megatron.core.dist_checkpointing"  # its file writer logs a worker's error, then raises without it


@contextlib.contextmanager
def _writer_errors(messages: list[str]) -> Iterator[None]:
    """Collect the errors that megatron-core's checkpoint writer logs while the block runs into ``messages``
    instead of printing them: it raises ``Worker failure: ... error: <class 'OSError'>`` and names the cause
    (``[Errno 28] No space left on device: '<file>'``) only in its log."""
    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(logging.ERROR)
    logger = logging.getLogger(WRITER_LOGGER)
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _save_fault(exc: BaseException, writer_errors: list[str], folder: Path) -> tuple[str, int | None] | None:
    """The storage fault behind a failed save on this rank, in words and its errno, or None: an ``OSError`` it was
    raised from, one that megatron's writer logged (``writer_errors``) or reported, the state of the file system
    and of this process's limits (full, read-only, a file size limit: :func:`megarl.storage.write_fault`; torch's
    serialization reports a short write as ``unexpected pos``, without the cause), or another rank's writer
    failing on an ``OSError`` (megatron's coordinator hears of it without the cause, which that rank names)."""
    cause = storage_cause(exc)
    for text in [] if cause else [*writer_errors, str(exc)]:
        m = re.search(r"\[Errno (\d+)\] ([^:\n']+)(?::\s*'([^']+)')?", text)
        if m and int(m[1]) in STORAGE_ERRNOS:
            cause = OSError(int(m[1]), m[2].strip(), m[3])
            break
    cause = cause or write_fault(folder, failed=True)
    if cause is not None:
        return describe(cause), cause.errno
    failures = getattr(exc, "failures", None) or {}  # megatron's coordinator: rank -> (exception, traceback)
    ranks = [r for r, f in failures.items() if _names_os_error(str(f[0] if isinstance(f, tuple) else f))]
    if ranks:
        return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))} could not write "
                "its part (an OSError; that rank's message names it)", None)
    return None


def _names_os_error(text: str) -> bool:
    """Whether megatron's worker-failure text names an ``OSError`` class (``error: <class 'OSError'>``)."""
    import builtins

    return any(isinstance(t := getattr(builtins, name, None), type) and issubclass(t, OSError)
               for name in re.findall(r"<class '(\w+)'>", text))


def load_per_rank(directory: str | os.PathLike, name: str, rank: int) -> Any | None:
    """The ``per_rank`` object ``name`` that ``rank`` saved, or None (another world size, or none saved)."""
    f = Path(directory) / "ranks" / f"{name}_{rank}.pt"
    if not f.is_file():
        return None
    try:
        return torch.load(f, weights_only=False)
    except Exception as e:  # noqa: BLE001 (overwritten bytes)
        if storage_cause(e):
            raise
        raise CheckpointDamagedError(directory, f"ranks/{f.name} cannot be read ({_load_error(e)})") from e


def load_checkpoint(directory: str | os.PathLike, sharded_state_dict: dict) -> dict:
    """Load a megatron sharded state dict from a megarl checkpoint (any TP/PP). Collective.

    Raises:
        FileNotFoundError: not a megarl checkpoint.
        CheckpointDamagedError: the load failed on an item that does not load (:func:`read_fault`, which each
            rank runs after the failure: megatron's loader raises on every rank).
    """
    from megatron.core import dist_checkpointing

    read_meta(directory)
    try:
        return dist_checkpointing.load(sharded_state_dict, str(Path(directory) / "model"))
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException" or storage_cause(e):
            raise
        fault = read_fault(directory)
        if fault is None:  # not the files: the loader's own error
            raise
        raise CheckpointDamagedError(directory, fault) from e


def model_meta(spec: ModelSpec, dtype: torch.dtype, tokenizer: str | None, *, use_te: bool = False,
               **extra) -> dict[str, Any]:
    """The ``megarl.json`` content describing a model checkpoint; ``transformer_engine`` records the layer spec
    it was written from (dense models load across specs through megatron's key map; MoE experts do not)."""
    cfg = spec.to_hf_config().to_dict()
    return {"format": "megarl", "hf_config": cfg, "dtype": dtype_name(dtype), "tokenizer": tokenizer,
            "transformer_engine": use_te, **extra}


def save_model(directory: str | os.PathLike, model, *, tokenizer: str | None = None, **extra) -> Path:
    """Save one model's weights (no optimizer; a model or, with VPP, the list of its chunks) as a megarl
    checkpoint. Collective."""
    bare = as_chunks(model)[0]
    dtype = next(bare.parameters()).dtype
    return save_checkpoint(directory, {"model": chunks_sharded_state_dict(model)},
                           model_meta(bare.megarl_spec, dtype, tokenizer, use_te=bare.megarl_use_te, **extra))


def load_model(directory: str | os.PathLike, model, key: str = "model") -> None:
    """Load one model's weights (a model or, with VPP, the list of its chunks) from a megarl checkpoint
    written at any TP x PP x VPP. Collective.

    Raises:
        SpecError: the checkpoint holds another model than ``model``'s spec, or an MoE model's experts written
            from the other layer spec (TE's grouped experts vs the local spec's sequential ones).
    """
    stored = checkpoint_spec(directory)
    bare = as_chunks(model)[0]
    spec = bare.megarl_spec
    if stored.hf_tensor_shapes() != spec.hf_tensor_shapes():
        raise SpecError(f"checkpoint {directory} holds another model: {stored} vs {spec}")
    if is_lora_checkpoint(directory):
        _load_lora_model(directory, model, key)
        return
    written_te = checkpoint_uses_te(directory)
    if stored.is_moe and written_te != bare.megarl_use_te:
        raise SpecError(f"checkpoint {directory} holds MoE experts written from the "
                        f"{'Transformer Engine' if written_te else 'local'} layer spec; load it with "
                        f"actor.kernels.transformer_engine={str(written_te).lower()}"
                        + (" (a GPU with TE: perf/gpu_te.sh)" if written_te else ""))
    loaded = load_checkpoint(directory, {key: chunks_sharded_state_dict(model)})
    load_chunks_state_dict(model, loaded[key])


def lora_meta(spec_dict: dict, base: str | None) -> dict[str, Any]:
    """The ``lora`` entry of a LoRA actor's ``megarl.json``: its :class:`~megarl.models.lora.LoRASpec` fields and
    ``base``, the model it adapts (``model.path``; None = the default model)."""
    return {**spec_dict, "base": base}


def adapters_only(sharded: dict) -> dict:
    """A sharded state dict (one chunk's, or ``model0``, ``model1``... of several) without the frozen weights:
    a LoRA actor's adapters."""
    return {k: (adapters_only(v) if isinstance(v, dict) else v) for k, v in sharded.items()
            if isinstance(v, dict) or is_adapter(k)}


def _load_lora_model(directory: str | os.PathLike, model, key: str) -> None:
    """The base a LoRA checkpoint names, then its adapters (into a model built with the same LoRA settings).

    Raises:
        SpecError: the model has no adapters or other LoRA settings than the checkpoint's.
    """
    from megarl.models.lora import LoRASpec

    meta = read_meta(directory)["lora"]
    stored = LoRASpec(**{k: v for k, v in meta.items() if k != "base"})
    built = as_chunks(model)[0].megarl_lora
    if built != stored:
        raise SpecError(f"checkpoint {directory} holds LoRA adapters {stored.as_dict()}, the model was built with "
                        f"{built.as_dict() if built else 'none'}: build it with the checkpoint's actor.lora, or "
                        f"`megarl export {directory}` the merged model to start from")
    load_weights(model, meta["base"])
    loaded = load_checkpoint(directory, {key: adapters_only(chunks_sharded_state_dict(model))})
    load_chunks_state_dict(model, loaded[key])


def checkpoint_uses_te(directory: str | os.PathLike) -> bool:
    """Whether a megarl checkpoint was written from Transformer Engine's layer spec (False for checkpoints
    older than that record)."""
    return bool(read_meta(directory).get("transformer_engine", False))


PRESET_PREFIX = "preset:"


def is_preset(source) -> bool:
    """``preset:NAME``: a named shape of :data:`megarl.models.spec.PRESETS` with random weights (benchmarks)."""
    return isinstance(source, str) and source.startswith(PRESET_PREFIX)


def load_weights(model: torch.nn.Module, source: str | os.PathLike | None, *, seed: int = 0) -> None:
    """Load ``model``'s weights (a model or, with VPP, the list of its chunks) from a megarl checkpoint, a
    Hugging Face directory or a GGUF file; a ``preset:NAME`` source gets the random weights of ``seed``, the
    same at every layout (:func:`load_preset_weights`)."""
    if is_preset(source):
        load_preset_weights(model, seed)
        return
    if source is not None and is_megarl_checkpoint(source):
        load_model(source, model)
    else:
        load_hf_weights(model, open_hf_checkpoint(source))


def source_spec(source: str | os.PathLike | None) -> tuple[ModelSpec, torch.dtype | None, str | None]:
    """Spec, stored dtype and tokenizer location (an absolute path) of a model source (megarl checkpoint, HF
    dir, GGUF file, or ``preset:NAME``, which has neither stored dtype nor tokenizer), read from its config
    alone: no weight is loaded (a GGUF file is not dequantised).

    Raises:
        SpecError: unknown preset or architecture. FileNotFoundError: a path that does not exist, or a training
            run's folder (naming its checkpoint to give instead: :func:`run_folder_as_model`).
    """
    if is_preset(source):
        from megarl.models.spec import preset

        return preset(source[len(PRESET_PREFIX):]), None, None
    if source is not None and is_megarl_checkpoint(source):
        meta = read_meta(source)
        return ModelSpec.from_hf_config(meta["hf_config"]), DTYPES[meta["dtype"]], meta.get("tokenizer")
    path = resolve_model_path(source)
    if run := run_folder_as_model(path):
        raise FileNotFoundError(run)
    if path.suffix == ".gguf":
        return ModelSpec.from_hf_config(read_hf_config(path)), torch.float32, str(path)
    ckpt = open_hf_checkpoint(path)
    return ckpt.spec, ckpt.dtype, str(ckpt.path)


def source_config(source: str | os.PathLike | None) -> dict[str, Any] | None:
    """The Hugging Face config a model came from, as its source wrote it (``config.json`` or GGUF metadata;
    for a megarl checkpoint the one it recorded), so an export gives it back unchanged; None for a preset."""
    if is_preset(source):
        return None
    if source is not None and is_megarl_checkpoint(source):
        meta = read_meta(source)
        return meta.get("source_config") or meta["hf_config"]
    return read_hf_config(source)


def source_generation_config(source: str | os.PathLike | None) -> dict[str, Any] | None:
    """The ``generation_config.json`` a model came with (for a megarl checkpoint: the one it recorded), so an
    export carries it; None for a preset, a GGUF file or a source without one."""
    if is_preset(source):
        return None
    if source is not None and is_megarl_checkpoint(source):
        return read_meta(source).get("generation_config")
    return read_generation_config(source)
