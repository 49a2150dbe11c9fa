"""Prepare GSM8K (Cobbe et al. 2021) as the parquet files the trainer reads.

Sources: a local directory holding ``train.jsonl`` and ``test.jsonl`` (or ``.parquet``) with the fields
``question`` and ``answer`` (e.g. our copy, ``/work/shared/data/gsm8k``, from github.com/openai/grade-school-math),
or, where the machine is online, the Hugging Face hub dataset ``openai/gsm8k`` (config "main", downloaded with
``huggingface_hub``; ``"hub"`` is short for it).

Output: ``<out>/train.parquet`` and ``<out>/test.parquet``, one row per problem in source order, columns
``index`` (int64, row number), ``question`` (the prompt), ``answer`` (the reference solution) and
``ground_truth`` (the normalised final number after ``####``, what :mod:`megarl.rewards.gsm8k` compares with).

Command line: ``megarl data gsm8k --src SRC --out DIR`` (:mod:`megarl.cli`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from megarl.data.dataset import read_rows, write_splits
from megarl.data.template import DataError
from megarl.rewards.gsm8k import ground_truth_number
from megarl.rewards.registry import RewardError

SPLITS = ("train", "test")
HF_REPO = "openai/gsm8k"
HF_FILES = {split: f"main/{split}-00000-of-00001.parquet" for split in SPLITS}


def prepare_gsm8k(src: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False
                  ) -> dict[str, Path]:
    """Read GSM8K from ``src`` and write its train and test splits as parquet (module docstring), with the list
    of the files written, ``megarl_data_gsm8k.json``.

    Args:
        src: a local directory with ``{train,test}.jsonl`` (or ``.parquet``), or a hub dataset id
            ("openai/gsm8k", or "hub" for it).
        out_dir: where to write ``train.parquet`` and ``test.parquet`` (created if missing).
        overwrite: replace the command's earlier output in ``out_dir``, or write into a folder that holds
            other files, keeping them (:mod:`megarl.output_folder`).

    Returns:
        split name -> written file.

    Raises:
        DataError: ``src`` is neither a directory nor a reachable hub dataset, a split is missing, or a row
            lacks ``question``/``answer`` or a number after ``####`` (the message names the file and row).
        OutputFolderError: ``out_dir`` holds files that this command did not write or an earlier run's output of
            it (without ``overwrite``; with it, a ``train.parquet`` or ``test.parquet`` of someone else's), or is
            part of a training run.
    """
    src = HF_REPO if str(src) == "hub" else src
    if not Path(src).is_dir() and not re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", str(src)):
        raise DataError(f"GSM8K source {str(src)!r} is not a directory (expected one holding train.jsonl and "
                        "test.jsonl) nor a hub dataset id like openai/gsm8k; pass --src DIR or --src hub")
    # both splits read before anything is written: a source that fails leaves no folder behind
    return write_splits(SPLITS, lambda: {split: _split_table(src, split) for split in SPLITS}, out_dir, "data gsm8k",
                        overwrite=overwrite)


def _split_table(src: str | os.PathLike, split: str):
    """One split of the GSM8K source as the output's ``pyarrow.Table`` (module docstring).

    Raises:
        DataError: naming the file and row (:func:`prepare_gsm8k`).
    """
    import pyarrow as pa

    source = _local_split(Path(src), split) if Path(src).is_dir() else _hub_split(str(src), split)
    rows = read_rows(source)
    questions, answers, truths = [], [], []
    for k, row in enumerate(rows):
        if not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
            raise DataError(f"{source}: row {k} needs string fields 'question' and 'answer', has {sorted(row)}")
        try:
            truths.append(ground_truth_number(row["answer"]))
        except RewardError as e:
            raise DataError(f"{source}: row {k}: {e}") from None
        questions.append(row["question"])
        answers.append(row["answer"])
    return pa.table({"index": pa.array(range(len(rows)), pa.int64()), "question": questions, "answer": answers,
                     "ground_truth": truths})


def _local_split(src: Path, split: str) -> Path:
    for name in (f"{split}.jsonl", f"{split}.parquet"):
        if (src / name).is_file():
            return src / name
    raise DataError(f"{src} has no {split}.jsonl or {split}.parquet; expected the GSM8K files "
                    "train.jsonl and test.jsonl (from github.com/openai/grade-school-math, grade_school_math/data)")


def _hub_split(repo_id: str, split: str) -> Path:
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id=repo_id, filename=HF_FILES[split], repo_type="dataset"))
    except Exception as e:  # offline, unknown repo, missing huggingface_hub: one answer for all
        raise DataError(f"cannot download {HF_FILES[split]} of the dataset {repo_id!r} from the Hugging Face hub "
                        f"({type(e).__name__}: {e}); on an offline machine pass --src DIR, a directory with "
                        "GSM8K's train.jsonl and test.jsonl") from e
