"""Prompt datasets: rows from jsonl or parquet, templated, tokenised and filtered by length; the parquet splits that
``megarl data`` writes."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from megarl.data.template import DataError, PromptTemplate
from megarl.textfiles import FileFormatError, read_text

logger = logging.getLogger(__name__)


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a ``.jsonl`` (one JSON object per non-empty line) or ``.parquet`` file, in file order.

    Raises:
        DataError: a missing file, an unknown extension, a ``.parquet`` file that is not one, or a jsonl line
            that is not UTF-8 (with its line number and byte offset) or not a JSON object (with its line number).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist (for GSM8K, write it with "
                        "`megarl data gsm8k --src DIR --out DIR`)")
    if path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except pyarrow.ArrowInvalid as e:  # a text file named .parquet, a truncated one
            raise DataError(f"{path}: not a parquet file ({' '.join(str(e).split())[:200]}); write it again, e.g. "
                            "with `megarl data`, or give a .jsonl file") from None
    if path.suffix != ".jsonl":
        raise DataError(f"data file {str(path)!r}: unknown format {path.suffix!r}; use .jsonl or .parquet")
    rows = []
    try:
        text = read_text(path)
    except FileFormatError as e:  # bytes that are not UTF-8, their line and offset named
        raise DataError(str(e)) from None
    for line_no, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{line_no}: expected a JSON object per line, got {type(row).__name__}")
        rows.append(row)
    return rows



def write_splits(splits: Sequence[str], make_tables: Callable[[], Mapping[str, Any]], out_dir: str | os.PathLike,
                 command: str, *, overwrite: bool = False) -> dict[str, Path]:
    """``megarl <command>``'s output: claim ``out_dir`` (:class:`megarl.output_folder.OutputFolder`), then write
    each ``pyarrow.Table`` that ``make_tables()`` returns for the ``splits`` as ``<out_dir>/<split>.parquet``, each
    file whole or not at all, listed in the folder's manifest.

    Returns:
        split name -> written file.

    Raises:
        OutputFolderError: ``out_dir`` may not be written (:meth:`~megarl.output_folder.OutputFolder.claim`),
            before ``make_tables`` is called. Whatever ``make_tables`` raises (nothing is written then).
    """
    import pyarrow.parquet as pq

    from megarl.output_folder import OutputFolder

    names = {split: f"{split}.parquet" for split in splits}
    folder = OutputFolder.claim(out_dir, command, overwrite=overwrite, writes=names.values())
    tables = make_tables()
    with folder:
        folder.staging.mkdir(parents=True, exist_ok=True)
        for split, name in names.items():
            pq.write_table(tables[split], folder.staging / name)
    return {split: folder.target / name for split, name in names.items()}

class PromptDataset:
    """Tokenised prompts with their metadata, in the source's order, without the too-long ones.

    Args:
        rows: the source rows (dicts), e.g. from :func:`read_rows`.
        tokenizer: a Hugging Face tokenizer (with a chat template when ``template.use_chat_template``).
        prompt_key: the field holding the prompt (``data.prompt_key``): a string, or a list of
            ``{"role", "content"}`` messages.
        ground_truth_key: the field holding the ground truth (``data.answer_key``; stored as a string), or
            None for none.
        template: system prompt, instruction and chat template (:class:`PromptTemplate`).
        max_prompt_length: drop prompts longer than this many tokens (after templating); None keeps all.
            What was dropped is logged (count and row numbers) and kept in :attr:`dropped`.
        source: the rows' origin, for messages.

    Attributes:
        input_ids: token ids of each kept prompt.
        index: the row number (0-based, in the source) of each kept prompt.
        raw_prompts: each kept prompt's text before templating (the last user message's for message lists).
        ground_truths: each kept prompt's ground truth as a string, or None.
        rows: each kept prompt's source row (a dict of its fields).
        dropped: row numbers of the prompts dropped for length.

    Raises:
        DataError: no rows; a row without the prompt (or ground-truth) field or with a null one, or with an
            empty or non-text prompt, or one that is no tokens once templated (the message names the row, the
            field, its config setting and the fix); no prompt left after filtering.
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]], tokenizer: Any, *, prompt_key: str = "question",
                 ground_truth_key: str | None = "ground_truth", template: PromptTemplate = PromptTemplate(),
                 max_prompt_length: int | None = None, source: str = "<rows>"):
        if not rows:
            raise DataError(f"{source}: no rows")
        prompts = [_field(row, k, prompt_key, source, "data.prompt_key") for k, row in enumerate(rows)]
        for k, p in enumerate(prompts):
            if not (isinstance(p, str) and p.strip()) and not (isinstance(p, list) and p):
                raise DataError(f"{source}: row {k} has an empty or non-text prompt in field {prompt_key!r}: "
                                f"{p!r:.80}; fix or remove the row")
        truths = [None if ground_truth_key is None else str(_field(row, k, ground_truth_key, source,
                                                                   "data.answer_key"))
                  for k, row in enumerate(rows)]
        ids = template.tokenize(tokenizer, prompts)
        empty = [k for k, x in enumerate(ids) if not x]
        if empty:
            raise DataError(f"{source}: row {empty[0]}'s prompt in field {prompt_key!r} is no tokens once templated "
                            f"({len(empty)} such rows: {empty[:10]}): {prompts[empty[0]]!r:.80}; fix or remove the "
                            "rows")
        fits = [max_prompt_length is None or len(x) <= max_prompt_length for x in ids]
        keep = [k for k, ok in enumerate(fits) if ok]
        self.dropped = [k for k, ok in enumerate(fits) if not ok]
        if not keep:
            raise DataError(f"{source}: all {len(ids)} prompts are longer than max_prompt_length="
                            f"{max_prompt_length} tokens (the shortest has {min(map(len, ids))}); raise "
                            "max_prompt_length")
        if self.dropped:
            logger.warning("%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens (rows %s%s)",
                           source, len(self.dropped), len(ids), max_prompt_length, self.dropped[:20],
                           " ..." if len(self.dropped) > 20 else "")
        self.source = source
        self.input_ids = [ids[k] for k in keep]
        self.index = keep
        self.raw_prompts = [_raw_text(prompts[k]) for k in keep]
        self.ground_truths = [truths[k] for k in keep]
        self.rows = [dict(rows[k]) for k in keep]

    @classmethod
    def from_file(cls, path: str | os.PathLike, tokenizer: Any, **kwargs: Any) -> "PromptDataset":
        """Load a ``.jsonl`` or ``.parquet`` file (:func:`read_rows`); ``kwargs`` as for the constructor."""
        return cls(read_rows(path), tokenizer, source=str(path), **kwargs)

    def __len__(self) -> int:
        return len(self.input_ids)

    def remove(self, raw_prompts: set[str]) -> list[int]:
        """Drop the prompts whose text (before templating) is in ``raw_prompts`` (e.g. held-out validation
        prompts); returns their row numbers.

        Raises:
            DataError: no prompt would be left.
        """
        keep = [k for k, p in enumerate(self.raw_prompts) if p not in raw_prompts]
        removed = [self.index[k] for k in range(len(self)) if self.raw_prompts[k] in raw_prompts]
        if not keep:
            raise DataError(f"{self.source}: every prompt is also a validation prompt; point validation.files "
                            "at other data, or lower validation.num_prompts")
        for name in ("input_ids", "index", "raw_prompts", "ground_truths", "rows"):
            setattr(self, name, [getattr(self, name)[k] for k in keep])
        return removed


def _field(row: Mapping[str, Any], k: int, key: str, source: str, setting: str) -> Any:
    """``row[key]``; ``setting`` is the config field that names ``key``, for the message.

    Raises:
        DataError: the row has no such field, or it is null.
    """
    if key not in row:
        raise DataError(f"{source}: row {k} has no field {key!r} (its fields: {sorted(row)}); set {setting} to "
                        "the field that holds it, or fix the row")
    if row[key] is None:
        raise DataError(f"{source}: row {k}'s field {key!r} ({setting}) is null; fix or remove the row")
    return row[key]


def _raw_text(prompt: str | list[Mapping[str, Any]]) -> str:
    if isinstance(prompt, str):
        return prompt
    return next(m["content"] for m in reversed(prompt) if m["role"] == "user")
