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

Command line: ``megarl data arithmetic --out DIR``, ``megarl data calculator --out DIR`` (:mod:`megarl.cli`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

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


def prepare_arithmetic(out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write the task's train and test splits as parquet into ``out_dir`` (created if missing).

    Returns:
        split name -> written file.
    """
    return write_splits(out_dir, arithmetic_rows())


def prepare_calculator(out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write the calculator task's splits (:func:`calculator_rows`) as :func:`prepare_arithmetic` does."""
    return write_splits(out_dir, calculator_rows())


def write_splits(out_dir: str | os.PathLike, splits: dict[str, list[dict]]) -> dict[str, Path]:
    """Write ``{split: rows}`` as ``<out_dir>/<split>.parquet`` (columns ``index``, ``question``,
    ``ground_truth``), each file atomically; returns split name -> written file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, rows in splits.items():
        table = pa.table({"index": pa.array(range(len(rows)), pa.int64()),
                          "question": [r["question"] for r in rows],
                          "ground_truth": [r["ground_truth"] for r in rows]})
        path = out / f"{split}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)  # a reader never sees half a file
        written[split] = path
    return written
