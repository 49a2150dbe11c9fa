"""Damaged checkpoints on ``--resume`` (issue 33 item 8): a truncated file, a deleted metadata file, a torn
``megarl.json`` in a real saved checkpoint of a tiny run are found before any rank loads it, named in one line
(the file and the cause), passed over for the older complete checkpoint with a warning, and refused in one
line when no sound one is left, with a status (2) that ``--max-restarts`` never retries.

Each test damages a copy of one run (:mod:`tests.rl_tasks`' tiny model, world size 1) that saved steps 1 and 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts

REPO = Path(__file__).resolve().parent.parent
SMALL = ["data.prompts_per_step=2", "rollout.n=2", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4",
         "trainer.save_every=1", "trainer.keep_checkpoints=2"]


def _train(root: Path, model: Path, data: Path, name: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.cli", "train",
                           *task_overrides(model, data, root / "runs", name), *SMALL, *flags],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run folder whose run saved ``step_000001`` and ``step_000002`` (its 2 steps), and how to train in it."""
    root = tmp_path_factory.mktemp("damaged")
    model, data = make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 64)
    r = _train(root, model, data, "saved", "trainer.steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    return root, model, data


def _copy(saved, name: str) -> Path:
    """A copy of the saved run folder under ``name``; returns its folder."""
    root = saved[0]
    shutil.rmtree(root / "runs" / name, ignore_errors=True)
    shutil.copytree(root / "runs" / "saved", root / "runs" / name)
    return root / "runs" / name


def _distcp(step: Path) -> Path:
    return sorted((step / "model").glob("*.distcp"), key=lambda f: f.stat().st_size)[-1]


def test_a_truncated_file_is_passed_over_for_the_older_checkpoint_with_a_warning(saved):
    """The newest checkpoint's largest ``.distcp`` cut to half: the run says which file of which checkpoint is
    damaged and how, resumes from ``step_000001`` instead and trains step 2 again (it ended in an ``EOFError``
    traceback on every rank)."""
    run = _copy(saved, "truncated")
    f = _distcp(run / "checkpoints" / "step_000002")
    size = f.stat().st_size
    os.truncate(f, size // 2)
    r = _train(*saved, "truncated", "trainer.steps=3", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    warning = [x for x in r.stderr.splitlines() if "WARNING" in x and " is damaged" in x]
    assert len(warning) == 1, r.stderr[-3000:]
    assert warning[0].endswith(
        f"the checkpoint {run / 'checkpoints' / 'step_000002'} is damaged: model/{f.name} has {size // 2} bytes, "
        f"{size} were written; resuming from the older step_000001 instead (the steps after it are trained "
        "again)"), warning[0]
    assert "Traceback" not in r.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed"]["checkpoint"] == str(run / "checkpoints" / "step_000001") and summary["steps"] == 3
    assert (run / "checkpoints" / "step_000003").is_dir()


def test_a_deleted_metadata_file_with_no_older_checkpoint_is_refused_and_not_retried(saved):
    """megatron's ``model/metadata.json`` deleted from the only checkpoint kept (``trainer.keep_checkpoints=1``):
    one line names the checkpoint, the file, that nothing older is kept and how to go on; status 2, which
    ``--max-restarts 2`` does not retry (it was ``AssertionError: metadata is None`` on every rank, retried
    twice on the same files)."""
    run = _copy(saved, "no-metadata")
    shutil.rmtree(run / "checkpoints" / "step_000001")
    (run / "checkpoints" / "step_000002" / "model" / "metadata.json").unlink()
    r = _train(*saved, "no-metadata", "trainer.steps=3", "trainer.keep_checkpoints=1", "--resume",
               "--max-restarts", "2")
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"megarl: error: trainer.resume: the checkpoint {run / 'checkpoints' / 'step_000002'} is damaged: "
        "model/metadata.json is missing; no older checkpoint is kept (trainer.keep_checkpoints=1). Restore the "
        f"file, or start the run over without --resume after moving {run / 'checkpoints'} aside (or under "
        "another run.name)"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "restart" not in r.stderr, r.stderr[-3000:]
    assert not (run / "restarts.jsonl").exists()


def test_damaged_json_and_index_name_their_file(saved, caplog):
    """A torn ``megarl.json`` (it was ``Expecting value: line 137 column 15``, no file named), a torn or
    missing megatron index (``model/.metadata``) and a missing ``.distcp``: :func:`checkpoint_fault` names the
    file and the cause, and :func:`check_run_folder` passes the checkpoint over for the older one, warning once
    however often it is called (a run of one rank checks twice: its launcher, then the trainer)."""
    from megarl.config import load_config
    from megarl.models.checkpoint import checkpoint_fault
    from megarl.trainer.checkpointing import check_run_folder

    run = _copy(saved, "torn")
    step2 = run / "checkpoints" / "step_000002"
    assert checkpoint_fault(step2) is None and checkpoint_fault(run / "checkpoints" / "step_000001") is None
    meta = step2 / "megarl.json"
    text = meta.read_text()
    meta.write_text(text[:len(text) // 2])
    assert checkpoint_fault(step2).startswith("megarl.json is not valid JSON (")
    cfg = load_config(None, [*task_overrides(saved[1], saved[2], saved[0] / "runs", "torn"), *SMALL,
                             "trainer.steps=3", "trainer.resume=true"])
    with caplog.at_level("WARNING", logger="megarl"):
        check_run_folder(cfg, 1)
        check_run_folder(cfg, 1)
    warned = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warned) == 1 and f"{step2} is damaged: megarl.json is not valid JSON" in warned[0], warned
    assert "resuming from the older step_000001" in warned[0]
    meta.write_text(text)

    index = step2 / "model" / ".metadata"
    blob = index.read_bytes()
    index.write_bytes(blob[:len(blob) // 2])  # the size megarl.json recorded is caught first
    assert checkpoint_fault(step2) == f"model/.metadata has {len(blob) // 2} bytes, {len(blob)} were written"
    files = json.loads(text).pop("files")
    meta.write_text(json.dumps({k: v for k, v in json.loads(text).items() if k != "files"}))  # an older save's
    assert checkpoint_fault(step2).startswith("model/.metadata cannot be read (")
    index.unlink()
    assert checkpoint_fault(step2) == "model/.metadata is missing"
    index.write_bytes(blob)
    distcp = _distcp(step2)
    distcp.unlink()
    assert checkpoint_fault(step2) == f"model/{distcp.name} is missing (model/.metadata places tensors in it)"
    assert f"model/{distcp.name}" in files


def test_a_run_folder_given_as_the_model_is_refused_naming_its_newest_sound_checkpoint(saved, capsys):
    """``runs/<name>`` as ``model.path`` (train, eval) or as the checkpoint to export: one line naming the newest
    checkpoint that is sound, and the newer one passed over as damaged (it was ``unknown architecture:
    model_type=None``: the run's own config.json read as a model's)."""
    from megarl.cli import main

    run = _copy(saved, "as-model")
    argvs = [["train", *task_overrides(run, saved[2], saved[0] / "other", "x"), "--check"],
             ["eval", str(run), "--check"], ["export", str(run), str(saved[0] / "exported")]]

    def refusals():
        out = []
        for argv in argvs:
            status = main(argv)
            lines = capsys.readouterr().err.strip().splitlines()
            assert status == 2 and len(lines) == 1, lines
            out.append(lines[0])
        return out

    for line in refusals():
        assert line.endswith(f"{run} is a run folder, not a model: give one of its checkpoints, e.g. the newest "
                             f"sound one, {run / 'checkpoints' / 'step_000002'}"), line
    os.truncate(_distcp(run / "checkpoints" / "step_000002"), 10)
    for line in refusals():
        assert f"the newest sound one, {run / 'checkpoints' / 'step_000001'} (step_000002 is damaged: model/" in line
    assert not (saved[0] / "exported").exists() and not (saved[0] / "other").exists()


def test_a_checkpoint_without_rng_states_resumes_with_a_warning(saved):
    """A checkpoint without ``ranks/rng_0.pt`` (an older or hand-made one: no ``files`` entry for it either): the
    resume says in one line that the run will not reproduce the uninterrupted one, naming the checkpoint (it went
    on without a word)."""
    run = _copy(saved, "no-rng")
    step2 = run / "checkpoints" / "step_000002"
    shutil.rmtree(step2 / "ranks")
    meta = json.loads((step2 / "megarl.json").read_text())
    meta["files"] = {f: size for f, size in meta["files"].items() if not f.startswith("ranks/")}
    (step2 / "megarl.json").write_text(json.dumps(meta))
    r = _train(*saved, "no-rng", "trainer.steps=3", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    warning = [x for x in r.stderr.splitlines() if "RNG" in x]
    assert len(warning) == 1 and "WARNING" in warning[0], r.stderr[-3000:]
    assert warning[0].endswith(f"the checkpoint {step2} holds no RNG states (ranks/rng_<rank>.pt: an older or "
                               "hand-made checkpoint); the run goes on from the generators' seeds, so it will not "
                               "reproduce the uninterrupted run"), warning[0]


def _without_hashes(step: Path) -> None:
    """Make ``step`` a checkpoint written before content hashes were recorded (``megarl.json`` without them)."""
    meta = json.loads((step / "megarl.json").read_text())
    del meta["hashes"]
    (step / "megarl.json").write_text(json.dumps(meta))


@pytest.mark.slow  # CI time (45 minutes): one of the 30 slowest of the default tier
def test_bytes_overwritten_at_the_same_size_are_named_when_the_load_fails(saved):
    """64 bytes of a model tensor's item in the newest checkpoint overwritten, the file's size unchanged, in a
    checkpoint without content hashes (an older save's: the checks before the load see nothing): ``megarl eval``
    of it ends in one line naming the file, the tensor and its bytes (status 2), as does ``megarl export`` of it
    (its rank's error), and a resume passes it over for ``step_000001`` with a warning saying so (both ended in
    an ``UnpicklingError`` traceback, export a ``RuntimeError`` one; a resume's on every rank, and
    ``--max-restarts`` ran it again)."""
    from torch.distributed.checkpoint import FileSystemReader

    run = _copy(saved, "overwritten")
    step2 = run / "checkpoints" / "step_000002"
    _without_hashes(step2)
    index = FileSystemReader(str(step2 / "model")).read_metadata()
    key, info = next((k, i) for k, i in index.storage_data.items() if k.fqn.startswith("embedding.")
                     and "optimizer" not in k.fqn)
    with open(step2 / "model" / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\xa5" * 64)
    fault = (f"model/{info.relative_path}: {key.fqn} (bytes {info.offset}-{info.offset + info.length}) cannot be "
             "read (UnpicklingError: ")
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "eval", str(step2), f"validation.files=[{saved[2]}]",
                        "validation.num_prompts=2", "--out", str(saved[0] / "eval-overwritten")],
                       capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"megarl: error: the checkpoint {step2} is damaged: {fault}"), r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "export", str(step2), str(saved[0] / "export-overwritten")],
                       capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]  # its rank's error, not a traceback
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"megarl: error: the checkpoint {step2} is damaged: {fault}"), r.stderr[-3000:]
    r = _train(*saved, "overwritten", "trainer.steps=3", "--resume", "--max-restarts", "1")
    assert r.returncode == 0 and "Traceback" not in r.stderr and "restart 1/1" not in r.stderr, r.stderr[-3000:]
    warning = [x for x in r.stderr.splitlines() if "WARNING" in x and " is damaged" in x]
    assert len(warning) == 1 and f"the checkpoint {step2} is damaged: {fault}" in warning[0], r.stderr[-3000:]
    assert warning[0].endswith("resuming from the older step_000001 instead (the steps after it are trained again)")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed"]["checkpoint"] == str(run / "checkpoints" / "step_000001") and summary["steps"] == 3


def _run_cli(capfd, *args: str) -> subprocess.CompletedProcess:
    """``megarl *args`` run by :func:`megarl.cli.main` in this process (the refusals below come before any model
    loads: a new interpreter's imports cost more than the check), its status and output (this process's and its
    children's: ``--max-restarts`` runs the launcher as a child) as a subprocess's."""
    from megarl.cli import main

    capfd.readouterr()
    status = main(list(args))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["megarl", *args], status, out, err)


def _refused(r: subprocess.CompletedProcess, step: Path, fault: str) -> None:
    """``r`` ended in one ``megarl: error:`` line naming ``step`` and its ``fault``, status 2, no traceback."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("megarl: error:")]
    assert len(errors) == 1 and f"the checkpoint {step} is damaged: {fault}" in errors[0], r.stderr[-3000:]
    assert "restart" not in r.stderr, r.stderr[-3000:]


def test_bytes_overwritten_at_the_same_size_are_found_by_their_hash_before_any_load(saved, capfd):
    """Issue 48: 4 KB of a weight in the newest checkpoint zeroed, the file's size unchanged (zeros load as
    numbers: a resume went on silently from the changed state). The content hash ``megarl.json`` records
    finds it before anything loads: a resume passes the checkpoint over for ``step_000001`` with a warning naming
    the file, and eval, export and a new run from it (``model.path``) refuse it in one line each, status 2, never
    retried."""
    from torch.distributed.checkpoint import FileSystemReader

    run = _copy(saved, "zeroed")
    step2 = run / "checkpoints" / "step_000002"
    index = FileSystemReader(str(step2 / "model")).read_metadata()

    def window(info) -> bytes:  # the 4 KB zeroed: the middle of a weight's item (a padded vocabulary's rows are 0)
        with open(step2 / "model" / info.relative_path, "rb") as f:
            f.seek(info.offset + info.length // 2)
            return f.read(min(4096, info.length // 4))

    info = max((i for k, i in index.storage_data.items() if "optimizer" not in k.fqn and any(window(i))),
               key=lambda i: i.length)
    with open(step2 / "model" / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        f.write(bytes(min(4096, info.length // 4)))
    fault = f"model/{info.relative_path} does not hold the bytes that were written (its xxh3_128 hash is "
    r = _train(*saved, "zeroed", "trainer.steps=3", "--resume", "--max-restarts", "1")
    assert r.returncode == 0 and "Traceback" not in r.stderr and "restart 1/1" not in r.stderr, r.stderr[-3000:]
    warning = [x for x in r.stderr.splitlines() if "WARNING" in x and " is damaged" in x]
    assert len(warning) == 1 and f"the checkpoint {step2} is damaged: {fault}" in warning[0], r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed"]["checkpoint"] == str(run / "checkpoints" / "step_000001") and summary["steps"] == 3
    step2 = _copy(saved, "zeroed-read") / "checkpoints" / "step_000002"
    with open(step2 / "model" / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        f.write(bytes(min(4096, info.length // 4)))
    for args in (["eval", str(step2), f"validation.files=[{saved[2]}]", "validation.num_prompts=2", "--out",
                  str(saved[0] / "eval-zeroed")],
                 ["export", str(step2), str(saved[0] / "export-zeroed")],
                 ["train", *task_overrides(step2, saved[2], saved[0] / "runs", "from-zeroed"), *SMALL,
                  "trainer.steps=1", "--max-restarts", "1"]):
        _refused(_run_cli(capfd, *args), step2, fault)
    assert not (saved[0] / "eval-zeroed").exists() and not (saved[0] / "export-zeroed").exists()


def test_every_reader_refuses_a_truncated_checkpoint_before_any_process(saved, capfd):
    """Issue 48: the newest checkpoint's largest ``.distcp`` cut to half, the damage ``--resume`` names: ``megarl
    eval`` of it reported ``accuracy 0.0000`` with status 0; now eval (and its ``--check``), export, a new run from
    it (train and ``--check``) refuse it in one line naming the file, status 2, before any process starts."""
    step2 = _copy(saved, "cut") / "checkpoints" / "step_000002"
    f = _distcp(step2)
    size = f.stat().st_size
    os.truncate(f, size // 2)
    fault = f"model/{f.name} has {size // 2} bytes, {size} were written"
    train = ["train", *task_overrides(step2, saved[2], saved[0] / "runs", "from-cut"), *SMALL, "trainer.steps=1"]
    for args in (["eval", str(step2), f"validation.files=[{saved[2]}]", "validation.num_prompts=2", "--out",
                  str(saved[0] / "eval-cut")], ["eval", str(step2), "--check"],
                 ["export", str(step2), str(saved[0] / "export-cut")], train, [*train, "--check"]):
        r = _run_cli(capfd, *args)
        _refused(r, step2, fault)
        assert "launching" not in r.stdout and "loading" not in r.stdout, r.stdout[-2000:]
    assert not (saved[0] / "eval-cut").exists() and not (saved[0] / "export-cut").exists()
