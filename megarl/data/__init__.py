"""Prompt data: jsonl/parquet datasets, chat templates, tokenisation, resumable batching, GSM8K preparation.

``PromptDataset.from_file(path, tokenizer, ...)`` -> ``PromptLoader(dataset, batch_size, ...)`` yields
:class:`~megarl.data.loader.PromptBatch` es; ``prepare_gsm8k(src, out_dir)`` writes the GSM8K parquet files.
"""

from megarl.data.dataset import PromptDataset, read_rows
from megarl.data.gsm8k import prepare_gsm8k
from megarl.data.loader import PromptBatch, PromptLoader
from megarl.data.template import DataError, PromptTemplate

__all__ = ["DataError", "PromptBatch", "PromptDataset", "PromptLoader", "PromptTemplate", "prepare_gsm8k",
           "read_rows"]
