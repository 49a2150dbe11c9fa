"""Batched box copies: many 2-D boxes copied between tensors in one call (one kernel launch on CUDA).

Every copy of the reshard (same-rank region to region, pack into a staging buffer, unpack out of it) is a
:class:`BoxBatch`: a fixed list of ``(src, dst)`` :class:`Box` pairs over tensors named by keys, compiled once
into an int64 table (the executor caches them with the plan) and run many times on whatever tensors the keys
are bound to. Running it is one call of ``megarl._C.box_copy(table, tensors)``, which reads each tensor's
address once, checks every box against its tensor's bounds and copies all boxes with one CUDA kernel launch
(16-byte vector copies where aligned) or ``at::parallel_for`` + ``memcpy`` on CPU.

Pairs whose dtypes differ (a cast, e.g. fp32 master weights into a bf16 engine) are copied by torch, one
``Tensor.copy_`` of two strided views per box; so is everything where the extension is not built
(``python setup.py build_ext --inplace``), with one warning.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Hashable, Mapping, NamedTuple, Sequence

import torch

log = logging.getLogger(__name__)

try:
    from megarl import _C
except ImportError:  # not built: the pure-torch path is used, with one warning
    _C = None

_warned_missing = False


class FallbackWarning(RuntimeWarning):
    """The reshard runs on a GPU without ``megarl._C``: one torch ``copy_`` per box, several times slower."""


def warn_fallback(device: torch.device, boxes: int) -> None:
    """Say that box copies on ``device`` run without ``megarl._C``, and what it costs: on a GPU a
    :class:`FallbackWarning` (one kernel launch per box, measured on an H200), on a CPU a log line."""
    fix = "build it with: python setup.py build_ext --inplace"
    if device.type == "cuda":
        warnings.warn(f"megarl._C is not built: the reshard's box copies on {device} run as one torch copy_ per "
                      f"box ({boxes} kernel launches for this batch instead of one); on an H200 that reached 0.10 "
                      "to 0.72 of the device's copy bandwidth against 0.84 to 0.93 with the extension "
                      f"(perf/RESULTS.md), so each reshard takes up to ~8x longer; {fix}", FallbackWarning,
                      stacklevel=3)
    else:
        log.warning("megarl._C is not built: reshard copies use the pure-torch fallback, one copy_ per box (%s)",
                    fix)


class Box(NamedTuple):
    """One end of a box copy, in elements of the tensor bound to ``key`` when the batch runs.

    Attributes:
        key: names the tensor (e.g. ``("src", "decoder.layers.0.mlp.linear_fc1.weight")``).
        start: start of the box in the tensor (1-D or 2-D tensor, last dim contiguous); for a packed box,
            ``(offset,)`` in a contiguous 1-D buffer.
        size: extent of the box, one int per dim (1-D or 2-D; or n-D covering every dim after the first whole,
            e.g. a depthwise convolution's ``[channels, 1, width]`` rows, copied as its ``[rows, prod(rest)]`` view).
        packed: the box's ``prod(size)`` elements lie contiguously at ``start[0]`` of a 1-D buffer (a
            staging buffer), row after row.
    """

    key: Hashable
    start: tuple[int, ...]
    size: tuple[int, ...]
    packed: bool = False


def choose_extension(use_extension: bool | None, device: torch.device, boxes: int) -> bool:
    """Whether a batch of ``boxes`` copies (or tiles) on ``device`` runs on ``megarl._C``: ``use_extension`` as
    given, None meaning where built (the first run without it warns once, :func:`warn_fallback`).

    Raises:
        ValueError: ``use_extension=True`` without the extension.
    """
    global _warned_missing
    if use_extension and _C is None:
        raise ValueError("use_extension=True but megarl._C is not built (python setup.py build_ext --inplace)")
    if use_extension is None:
        use_extension = _C is not None
        if not use_extension and not _warned_missing:
            warn_fallback(device, boxes)
            _warned_missing = True
    return use_extension


def extension_available() -> bool:
    """True where ``megarl._C`` is built and importable."""
    return _C is not None


class BoxBatch:
    """A fixed list of box copies, compiled once, run on tensors bound to its keys.

    Attributes:
        keys: the tensor keys, in the order of the table's tensor indices.
        table: int64 ``[n, 8]``: (src tensor index, src row, src col, dst tensor index, dst row, dst col, rows,
            cols), elements; a box in a 1-D tensor is ``rows * cols`` elements packed from ``col`` on.

    Args:
        pairs: ``(src, dst)`` boxes of equal shape (a 1-D box is one row).

    Raises:
        ValueError: a pair whose boxes differ in shape.
    """

    def __init__(self, pairs: Sequence[tuple[Box, Box]]):
        pairs = [(s, d) for s, d in pairs if all(s.size) and all(d.size)]
        self.keys: tuple[Hashable, ...] = tuple(dict.fromkeys(b.key for pair in pairs for b in pair))
        position = {k: i for i, k in enumerate(self.keys)}
        rows = []
        for s, d in pairs:
            shape = self._rows_cols(s)
            if shape != self._rows_cols(d):
                raise ValueError(f"box copy of {s.size} elements into {d.size}")
            rows.append((position[s.key], *self._row_col(s), position[d.key], *self._row_col(d), *shape))
        self.table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 8)

    def __len__(self) -> int:
        return self.table.shape[0]

    @staticmethod
    def _rows_cols(b: Box) -> tuple[int, int]:
        return (1, b.size[0]) if len(b.size) == 1 else (b.size[0], math.prod(b.size[1:]))

    @staticmethod
    def _row_col(b: Box) -> tuple[int, int]:
        if len(b.start) > 2 and not b.packed and any(b.start[1:]):
            raise ValueError(f"a box of {len(b.start)} dims must cover every dim after the first, got start {b.start}")
        return (0, b.start[0]) if b.packed or len(b.start) == 1 else (b.start[0], b.start[1])

    def dst_keys(self) -> list[Hashable]:
        """Keys of the tensors the batch writes."""
        return [self.keys[i] for i in sorted(set(self.table[:, 3].tolist()))]

    def total_elements(self) -> int:
        """Elements the batch copies."""
        return int((self.table[:, 6] * self.table[:, 7]).sum())

    def run(self, tensors: Mapping[Hashable, torch.Tensor], use_extension: bool | None = None) -> int:
        """Copy every pair between the tensors bound to the keys (casting where dtypes differ).

        All tensors must be on one device, 1-D or 2-D with a contiguous last dim; boxes must lie inside their
        tensors (checked) and destinations must not overlap. On CUDA the copies are enqueued on the current
        stream.

        Args:
            tensors: key -> tensor for every key of the batch.
            use_extension: None: ``megarl._C`` where built; False: the pure-torch path; True: require it.

        Returns:
            Bookkeeping bytes allocated for the call (descriptor tables, host and device).

        Raises:
            ValueError: ``use_extension=True`` without the extension.
            RuntimeError: a box outside its tensor, tensors on several devices or without a contiguous last dim.
        """
        if not len(self):
            return 0
        bound = [t.flatten(1) if t.dim() > 2 else t for t in (tensors[k] for k in self.keys)]  # views
        use_extension = choose_extension(use_extension, bound[0].device, len(self))
        booked = 0
        if use_extension:
            booked, left = _C.box_copy(self.table, bound)
            booked += self.table.numel() * 8
            slow = left.tolist()
        else:
            slow = range(len(self))
        with torch.no_grad():  # destinations are often parameters (leaves that require grad)
            for row in self.table[slow].tolist():
                rows, cols = row[6], row[7]
                views = []
                for t, r, c in (bound[row[0]], row[1], row[2]), (bound[row[3]], row[4], row[5]):
                    stride = t.stride(0) if t.dim() == 2 else cols
                    views.append(t.as_strided((rows, cols), (stride, 1), t.storage_offset() + r * stride + c))
                views[1].copy_(views[0])
        return booked
