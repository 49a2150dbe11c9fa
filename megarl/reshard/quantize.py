"""Batched block-FP8 quantisation: the reshard's pack (and same-rank copy) for block-FP8 destination tensors.

A :class:`QuantBatch` is a fixed list of tiles (:data:`megarl.models.fp8.BLOCK` x ``BLOCK`` at most, the format
of :mod:`megarl.models.fp8`), each quantised from one or more source boxes (its parts: the pieces of canonical
tensors that make up the tile, from one rank's source tensors) into a box of an E4M3 (or uint8) tensor, with its
float32 scale written into one element of a scale tensor. Like :class:`~megarl.reshard.boxcopy.BoxBatch` it is
compiled once into int64 tables over tensors named by keys and run many times on whatever tensors the keys are
bound to: one call of ``megarl._C.quantize_fp8_blocks`` (one CUDA launch, one thread block a tile: one read of
the source from device memory, one write of E4M3 bytes and scales), or, where the extension is not built, torch
ops per tile (:func:`megarl.models.fp8.quantize_tile`: the same bytes).

Destinations and scales may be 2-D tensors (a box at (row, col)) or 1-D buffers (a staging buffer: the tile's
``rows * cols`` bytes packed from the given offset, the scale one float32 at the given element offset), as in
:class:`~megarl.reshard.boxcopy.Box`.
"""

from __future__ import annotations

from typing import Hashable, Mapping, NamedTuple, Sequence

import torch

from megarl.models.fp8 import FP8_DTYPE, quantize_tile
from megarl.reshard import boxcopy
from megarl.reshard.boxcopy import Box, choose_extension


class TileJob(NamedTuple):
    """One tile to quantise.

    Attributes:
        dst: the tile's box in its E4M3 / uint8 destination (``size`` = the tile's rows, cols).
        scale: where its float32 scale goes (a one-element box).
        parts: ``(src box, (row, col) offset in the tile)`` for each source box of the tile; elements of the
            tile covered by no part are neither read nor written.
    """

    dst: Box
    scale: Box
    parts: tuple[tuple[Box, tuple[int, int]], ...]


def _row_col(b: Box) -> tuple[int, int]:
    return (0, b.start[0]) if b.packed or len(b.start) == 1 else (b.start[0], b.start[1])


def _rows_cols(size: tuple[int, ...]) -> tuple[int, int]:
    return (1, size[0]) if len(size) == 1 else (size[0], size[1])


class QuantBatch:
    """A fixed list of :class:`TileJob`, compiled once, run on tensors bound to its keys.

    Attributes:
        keys: the tensor keys, in the order of the tables' tensor indices.
        tiles: int64 ``[n, 9]``: (dst tensor index, dst row, dst col, rows, cols, scale tensor index, scale row,
            scale col, first part); tile ``i`` is made of parts ``[tiles[i, 8], tiles[i + 1, 8])``.
        parts: int64 ``[m, 7]``: (src tensor index, src row, src col, rows, cols, row offset, col offset).

    Raises:
        ValueError: a part that does not fit its tile.
    """

    def __init__(self, jobs: Sequence[TileJob]):
        self.keys: tuple[Hashable, ...] = tuple(dict.fromkeys(
            k for j in jobs for k in (j.dst.key, j.scale.key, *(p.key for p, _ in j.parts))))
        index = {k: i for i, k in enumerate(self.keys)}
        tiles, parts = [], []
        for j in jobs:
            rows, cols = _rows_cols(j.dst.size)
            tiles.append((index[j.dst.key], *_row_col(j.dst), rows, cols, index[j.scale.key], *_row_col(j.scale),
                          len(parts)))
            for src, (r, c) in j.parts:
                pr, pc = _rows_cols(src.size)
                if r < 0 or c < 0 or r + pr > rows or c + pc > cols:
                    raise ValueError(f"a part of {pr} x {pc} at ({r}, {c}) does not fit its tile of {rows} x {cols}")
                parts.append((index[src.key], *_row_col(src), pr, pc, r, c))
        self.tiles = torch.tensor(tiles, dtype=torch.int64).reshape(len(tiles), 9)
        self.parts = torch.tensor(parts, dtype=torch.int64).reshape(len(parts), 7)

    def __len__(self) -> int:
        return self.tiles.shape[0]

    def run(self, tensors: Mapping[Hashable, torch.Tensor], use_extension: bool | None = None) -> int:
        """Quantise every tile into the tensors bound to the keys (on CUDA: enqueued on the current stream).

        Args:
            tensors: key -> tensor for every key: sources float32 / bfloat16 / float16, destinations
                float8_e4m3fn or uint8, scales float32; all on one device, 1-D or 2-D, last dim contiguous.
            use_extension: None: ``megarl._C`` where built; False: torch ops per tile; True: require it.

        Returns:
            Bookkeeping bytes allocated for the call (descriptor tables, host and device).

        Raises:
            ValueError: ``use_extension=True`` without the extension.
            RuntimeError: a box outside its tensor, a wrong dtype, tensors on several devices (the extension's
                checks; the torch path raises torch's errors).
        """
        if not len(self):
            return 0
        bound = [tensors[k] for k in self.keys]
        if choose_extension(use_extension, bound[0].device, len(self)):
            return boxcopy._C.quantize_fp8_blocks(self.tiles, self.parts, bound) + \
                (self.tiles.numel() + self.parts.numel()) * 8
        rows_of = self.tiles[:, 8].tolist() + [len(self.parts)]
        parts = self.parts.tolist()
        with torch.no_grad():
            for i, (d, dr, dc, rows, cols, s, sr, sc, first) in enumerate(self.tiles.tolist()):
                tile = torch.zeros(rows, cols, dtype=torch.float32, device=bound[d].device)
                mine = parts[first:rows_of[i + 1]]
                for src, r0, c0, pr, pc, ro, co in mine:
                    tile[ro:ro + pr, co:co + pc] = _view(bound[src], r0, c0, pr, pc)
                q, scale = quantize_tile(tile)
                out = _view(bound[d], dr, dc, rows, cols)
                for src, r0, c0, pr, pc, ro, co in mine:
                    out[ro:ro + pr, co:co + pc].copy_(q[ro:ro + pr, co:co + pc].view(out.dtype)
                                                      if out.dtype != FP8_DTYPE else q[ro:ro + pr, co:co + pc])
                _view(bound[s], sr, sc, 1, 1).fill_(scale)
        return 0


def _view(t: torch.Tensor, row: int, col: int, rows: int, cols: int) -> torch.Tensor:
    """The box (2-D tensor) or packed run (1-D buffer) as a ``[rows, cols]`` view (the Box convention)."""
    if t.dim() == 2:
        return t[row:row + rows, col:col + cols]
    return t[col:col + rows * cols].view(rows, cols)


def quantize_tensor(weight: torch.Tensor, use_extension: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a whole 2-D tensor on its own device, tile by tile, with one :class:`QuantBatch` (the reshard's
    kernel; :func:`megarl.models.fp8.quantize_blocks` is the torch reference).

    Returns:
        ``(E4M3 [rows, cols], float32 scales [ceil(rows / 128), ceil(cols / 128)])`` on ``weight``'s device.
    """
    from megarl.models.fp8 import BLOCK, scale_shape

    rows, cols = weight.shape
    jobs = []
    for i in range(0, rows, BLOCK):
        for j in range(0, cols, BLOCK):
            size = (min(BLOCK, rows - i), min(BLOCK, cols - j))
            jobs.append(TileJob(Box("q", (i, j), size), Box("s", (i // BLOCK, j // BLOCK), (1, 1)),
                                ((Box("w", (i, j), size), (0, 0)),)))
    out = {"w": weight, "q": torch.empty(rows, cols, dtype=FP8_DTYPE, device=weight.device),
           "s": torch.empty(scale_shape((rows, cols)), dtype=torch.float32, device=weight.device)}
    QuantBatch(jobs).run(out, use_extension)
    return out["q"], out["s"]
