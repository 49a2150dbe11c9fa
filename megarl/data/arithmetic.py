"""A synthetic arithmetic task: "What is a + b?" over small integers, the CPU main job's data.

A 135M instruct model answers such questions correctly about 4 times in 10 (greedy) and writes far more
text than the answer, so GRPO has signal from the first step and the reward rises within minutes on a CPU
(perf/RESULTS.md, "CPU main job"); GSM8K, the GPU main job, is out of a 135M model's reach at CPU speed.

Output: ``<out>/train.parquet`` and ``<out>/test.parquet``, every pair ``(a, b)`` with ``0 <= a, b < 20`` once
(400 problems), the test split the first ``TEST_PROBLEMS`` of a seeded shuffle and disjoint from train; columns
``index`` (int64), ``question`` ("What is 7 + 12? Reply with only the number.") and ``ground_truth`` (the sum
as a string, what ``reward.fn=arithmetic``, :mod:`megarl.rewards.arithmetic`, compares the response's last
number with). The files are the same on every machine: the shuffle's seed is fixed.

The calculator task (:func:`calculator_rows`, ``data.prepare=calculator``, ``megarl data calculator``): the same
question over 5-digit operands ("What is 48213 + 93847?"), too large for a 135M model to add reliably in its
head, for the multi-turn runs that offer it the calculator tool (:mod:`megarl.agents.calculator`,
``parallel_configs/cpu_smollm2_calculator.yaml``): ``CALCULATOR_TRAIN`` training and ``TEST_PROBLEMS`` test
problems, drawn with a fixed seed, no pair in both.

Command line: ``megarl data arithmetic --out DIR``, ``megarl data calculator --out DIR`` (:mod:`megarl.cli`;
the output folder's rule: :mod:`megarl.output_folder`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Callable

from megarl.data.dataset import write_splits

SPLITS = ("train", "test")
OPERAND_LIMIT = 20  # operands 0..19
TEST_PROBLEMS = 64
SEED = 0
CALCULATOR_DIGITS = 5
CALCULATOR_TRAIN = 2048


def arithmetic_rows() -> dict[str, list[dict]]:
    """The train and test rows (module docstring), each ``{"question": str, "ground_truth": str}``."""
    pairs = [(a, b) for a in range(OPERAND_LIMIT) for b in range(OPERAND_LIMIT)]
    random.Random(SEED).shuffle(pairs)
    rows = [{"question": f"What is {a} + {b}? Reply with only the number.", "ground_truth": str(a + b)}
            for a, b in pairs]
    return {"train": rows[TEST_PROBLEMS:], "test": rows[:TEST_PROBLEMS]}


def calculator_rows() -> dict[str, list[dict]]:
    """The calculator task's train and test rows (module docstring), as :func:`arithmetic_rows`."""
    rng = random.Random(SEED)
    low, high = 10 ** (CALCULATOR_DIGITS - 1), 10 ** CALCULATOR_DIGITS - 1
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < CALCULATOR_TRAIN + TEST_PROBLEMS:
        pairs[(rng.randint(low, high), rng.randint(low, high))] = None
    rows = [{"question": f"What is {a} + {b}?", "ground_truth": str(a + b)} for a, b in pairs]
    return {"train": rows[TEST_PROBLEMS:], "test": rows[:TEST_PROBLEMS]}


def prepare_arithmetic(out_dir: str | os.PathLike, *, overwrite: bool = False) -> dict[str, Path]:
    """Write the task's train and test splits as parquet into ``out_dir`` (created if missing), with the list of
    the files written, ``megarl_data_arithmetic.json``.

    Args:
        overwrite: replace the command's earlier output in ``out_dir``, or write into a folder that holds
            other files, keeping them (:mod:`megarl.output_folder`).

    Returns:
        split name -> written file.

    Raises:
        OutputFolderError: ``out_dir`` holds files that this command did not write or an earlier run's output of
            it (without ``overwrite``; with it, a ``train.parquet`` or ``test.parquet`` of someone else's), or is
            part of a training run.
    """
    return _write_task(arithmetic_rows, out_dir, "data arithmetic", overwrite)


def prepare_calculator(out_dir: str | os.PathLike, *, overwrite: bool = False) -> dict[str, Path]:
    """Write the calculator task's splits (:func:`calculator_rows`) as :func:`prepare_arithmetic` does
    (``megarl_data_calculator.json``)."""
    return _write_task(calculator_rows, out_dir, "data calculator", overwrite)


def _write_task(rows: Callable[[], dict[str, list[dict]]], out_dir: str | os.PathLike, command: str,
                overwrite: bool) -> dict[str, Path]:
    """``megarl <command>``'s output: the ``rows()`` of each split as ``<out_dir>/<split>.parquet`` (columns
    ``index``, ``question``, ``ground_truth``; :func:`megarl.data.dataset.write_splits`)."""
    import pyarrow as pa

    def tables():
        return {split: pa.table({"index": pa.array(range(len(split_rows)), pa.int64()),
                                 "question": [r["question"] for r in split_rows],
                                 "ground_truth": [r["ground_truth"] for r in split_rows]})
                for split, split_rows in rows().items()}
    return write_splits(SPLITS, tables, out_dir, command, overwrite=overwrite)
