"""A run's record: what ``megarl train`` writes into its run folder beside the checkpoints (metrics, samples,
config, summary, report, logger folders, the HF export, the restarts), and where an earlier run's record goes
when a new run starts in the same folder.

A new run (``--resume`` not given) is refused in a folder that holds checkpoints
(:func:`megarl.trainer.checkpointing.check_run_folder`); in a folder whose earlier run saved none (it died
before its first save, or its checkpoints were deleted to free disk) it starts, and :func:`keep_earlier_record`
first moves that run's record into ``<run folder>/earlier/<k>/`` (k = 1, 2, ... oldest first), saying so: a
new run's files never replace an earlier run's. A restart of the run by ``--max-restarts`` that starts over at
step 0 (no checkpoint yet) moves its failed attempt's record there too, and keeps ``restarts.jsonl``, which is
this run's own.

A resumed run first cuts its record back to its checkpoint's step (:func:`cut_record_back`): the records of the
steps it trains again (logged after that checkpoint by the attempt that crashed) move to
``<file>.superseded``, so the folder holds each step once; readers take one record a step from folders an older
megarl left (:func:`megarl.jsonl.latest_per_step`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from megarl.jsonl import TORN_SUFFIX, latest_per_step, move_records, one_record, sample_identity
from megarl.parallel.restart import RESTARTS_FILE, restart_number

log = logging.getLogger(__name__)

RECORD = ("metrics.jsonl", "samples.jsonl", "val_samples.jsonl", "config.json", "summary.json", "report.md",
          "report", "tensorboard", "wandb", "hf", "dpo_reference.pt", RESTARTS_FILE)
EARLIER = "earlier"
# the JSON-lines files keyed by "step", with what tells a step's records apart (megarl.jsonl.latest_per_step)
STEP_RECORDS = {"metrics.jsonl": one_record, "samples.jsonl": sample_identity, "val_samples.jsonl": sample_identity}
SUPERSEDED_SUFFIX = ".superseded"


def record_entries(run_dir: str | os.PathLike) -> list[str]:
    """The entries of ``run_dir`` that belong to a run's record (:data:`RECORD` and the ``.torn`` tails of its
    JSON-lines files and the records they superseded), in that order."""
    names = [n for name in RECORD for n in (name, name + TORN_SUFFIX, name + SUPERSEDED_SUFFIX)]
    return [n for n in names if (Path(run_dir) / n).exists()]


def keep_earlier_record(run_dir: str | os.PathLike) -> Path | None:
    """Before a run starts at step 0 in ``run_dir`` (rank 0, holding the run's lock): move the record of an
    earlier run (or of this run's failed attempt; its ``restarts.jsonl`` stays) into the next free
    ``earlier/<k>/``, with a warning naming what moved where. Returns that folder, or None when there was
    nothing to move."""
    run_dir = Path(run_dir)
    moved = [n for n in record_entries(run_dir) if not (n.startswith(RESTARTS_FILE) and restart_number() > 0)]
    if not moved:
        return None
    k = 1
    while (run_dir / EARLIER / str(k)).exists():
        k += 1
    dest = run_dir / EARLIER / str(k)
    dest.mkdir(parents=True)
    for name in moved:
        os.replace(run_dir / name, dest / name)
    log.warning("run folder %s held the record of %s that saved no checkpoint (%s): moved to %s; this run starts "
                "at step 0 with a record of its own", run_dir,
                "a failed attempt of this run" if restart_number() > 0 else "an earlier run", ", ".join(moved), dest)
    return dest


def cut_record_back(run_dir: str | os.PathLike, step: int) -> dict[str, int]:
    """Before a run resumed from the checkpoint of ``step`` logs anything (rank 0, holding the run's lock): move
    the records of :data:`STEP_RECORDS` past ``step`` (the steps it trains again), and the earlier copies of a
    step logged twice (by an older megarl), to ``<file>.superseded``, with a warning naming both files.
    Returns ``{file name: records moved}`` of the files that had any."""
    run_dir = Path(run_dir)
    moved = {}
    for name, identity in STEP_RECORDS.items():
        def keep(records, identity=identity):
            return [i for i in latest_per_step(records, identity)
                    if not isinstance(records[i].get("step"), int) or records[i]["step"] <= step]

        n = move_records(run_dir / name, run_dir / (name + SUPERSEDED_SUFFIX), keep)
        if n:
            moved[name] = n
            log.warning("resuming %s at step %d: %d records of %s logged after that checkpoint (or logged twice) "
                        "were moved to %s; the steps after it are logged again", run_dir, step, n, name,
                        name + SUPERSEDED_SUFFIX)
    return moved
