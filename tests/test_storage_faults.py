"""Faults of the storage (issue 33 item 9; :mod:`megarl.storage`): a full disk during a checkpoint save, a file
too large for the process's limit, a file where the run folder must be, a read-only file system. Each ends in one
line naming the folder and the cause, exit status 74 (``EXIT_STORAGE``), never restarted by ``--max-restarts``,
and a failed save leaves no partial ``step_N.tmp`` behind.

Root ignores permissions, so the faults are made otherwise: megatron-core's checkpoint writer meets an
``ENOSPC`` on one rank (its ``open`` replaced there), a real run writes under ``RLIMIT_FSIZE`` (``EFBIG`` from
the writer's own ``write``), a file stands at ``run.output_dir``, and ``statvfs`` reports a read-only file system.
"""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("storage")
    return root, make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 16)


def _save_on_full_disks(rank: int, world: int, model_dir: str, out: str) -> list[dict]:
    """Save the tiny model at TP=2, then save it again to the same folder twice, each time while every file that
    megatron's writer opens on one rank (0, then 1) fails with ENOSPC; what each rank raised each time, and what
    the folder holds after, and the processes the saves left running (megatron's writer started a multiprocessing
    Manager on each rank's first save)."""
    import multiprocessing

    import megatron.core.dist_checkpointing.strategies.filesystem_async as writer
    import torch.distributed as dist

    from megarl.models import checkpoint as ck
    from megarl.models.hf_io import open_hf_checkpoint
    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    def full(file, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file)

    mesh = ParallelLayout(tp=2)
    initialize_model_parallel(mesh)
    model = build_model(open_hf_checkpoint(model_dir).spec, mesh)
    ck.save_model(out, model)
    results = []
    for full_rank in (0, 1):
        if rank == full_rank:
            writer.open = full
        try:
            ck.save_model(out, model)
            raised = None
        except BaseException as e:  # noqa: BLE001 (what a rank raises is the result)
            raised = (type(e).__name__, str(e), getattr(e, "errno", None))
        finally:
            vars(writer).pop("open", None)
        dist.barrier()
        results.append({"raised": raised, "entries": sorted(p.name for p in Path(out).parent.iterdir()),
                        "format": ck.read_meta(out)["format"],
                        "children": [p.name for p in multiprocessing.active_children()]})
        dist.barrier()  # every rank has looked before rank 0 starts the next save's ckpt.tmp
    return results


def test_a_full_disk_during_a_save_names_the_cause_and_leaves_no_partial_checkpoint(task):
    """Megatron's writer reports ``RuntimeError: Worker failure`` (the cause only in its log): the rank that met
    the full disk names ``No space left on device`` and the file; megatron's coordinator (rank 0) names the rank
    that failed; the partial ``ckpt.tmp`` is removed and the folder's earlier checkpoint stays. No save starts a
    process (the writer's results go through a thread queue: megarl saves in the rank's own process)."""
    root, model, _ = task
    out = root / "full" / "ckpt"
    ranks = run_world(_save_on_full_disks, 2, str(model), str(out))
    tail = ("; the partial ckpt.tmp was removed. Free space or fix the folder, then --resume continues from the "
            "newest complete checkpoint")
    for full_rank in (0, 1):
        results = [r[full_rank] for r in ranks]
        assert all(r["entries"] == ["ckpt"] and r["format"] == "megarl" and r["children"] == [] for r in results), \
            results
        kind, message, code = results[full_rank]["raised"]
        assert kind == "StorageError" and code == errno.ENOSPC, results
        assert message.startswith(f"cannot save the checkpoint {out}: No space left on device (ENOSPC): "
                                  f"{out}.tmp/model/") and message.endswith(tail), message
    assert ranks[0][1]["raised"] == ("StorageError", f"cannot save the checkpoint {out}: rank 1 could not write "
                                     f"its part (an OSError; that rank's message names it){tail}", None), ranks
    assert ranks[1][0]["raised"][0] == "CheckpointException"  # megatron tells the others nothing (a disk with room)


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))


def test_a_run_whose_checkpoint_cannot_be_written_ends_in_one_line_and_is_not_restarted(task):
    """``megarl train --max-restarts 2`` whose files may not exceed 256 KiB (``ulimit -f``): the step's metrics
    are written, its checkpoint is not (``EFBIG`` in megatron's writer); one line names the checkpoint and the
    cause, the status is 74, no restart is made, and no ``step_N.tmp`` is left."""
    root, model, data = task
    run = root / "runs" / "fsize"
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "train",
                        *task_overrides(model, data, root / "runs", "fsize"),
                        "data.prompts_per_step=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                        "actor.micro_batch_size=4", "trainer.steps=2", "trainer.save_every=1", "--max-restarts", "2"],
                       capture_output=True, text=True, timeout=600, cwd=REPO, preexec_fn=_limit_file_size)
    assert r.returncode == 74, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    step = run / "checkpoints" / "step_000001"
    assert last == (f"megarl: error: cannot save the checkpoint {step}: File too large for this process's limit of "
                    f"262144 bytes (ulimit -f) (EFBIG): {step}.tmp; the partial step_000001.tmp was removed. Free "
                    "space or fix the folder, then --resume continues from the newest complete checkpoint"), \
        r.stderr[-3000:]
    assert [line for line in r.stderr.splitlines() if "ERROR" in line or "error" in line] == [last], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "restart" not in r.stderr, r.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == []
    assert (run / "metrics.jsonl").read_text().count('"step": 1') == 1 and not (run / "restarts.jsonl").exists()


def test_a_run_folder_that_cannot_be_made_or_written_is_refused_before_any_process(task, tmp_path, monkeypatch):
    """``run.output_dir`` naming a file: one line, status 74, no restart, nothing started (it was a
    ``NotADirectoryError`` traceback that ``--max-restarts`` retried). A read-only file system is refused in the
    same words by :func:`megarl.storage.check_writable`."""
    from megarl.storage import StorageError, check_writable

    root, model, data = task
    (tmp_path / "runs").write_text("a file")
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "train",
                        *task_overrides(model, data, tmp_path / "runs", "x"),
                        "--max-restarts", "2"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 74, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"megarl: error: run.output_dir: {tmp_path / 'runs'} is a file, so the folder {tmp_path / 'runs' / 'x'} "
        "cannot be made there; name another folder, or move the file"), r.stderr[-3000:]
    assert "restart" not in r.stderr and "launching" not in r.stdout

    class ReadOnly:
        f_flag, f_bavail = os.ST_RDONLY, 1000
    monkeypatch.setattr("megarl.storage.os.statvfs", lambda path: ReadOnly())
    with pytest.raises(StorageError, match=rf"^run.output_dir: the folder {tmp_path / 'new'} cannot be written: "
                                           rf"Read-only file system \(EROFS\): {tmp_path}; name another folder"):
        check_writable(tmp_path / "new", "run.output_dir")
