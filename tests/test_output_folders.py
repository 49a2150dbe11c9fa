"""The outputs of megarl's commands (:mod:`megarl.output_folder`). The folders of ``megarl convert``, ``megarl
export`` and ``megarl data``: a new or empty folder is written; the command's own earlier output is replaced only
with ``--overwrite``, whole or not at all (written beside, renamed in); a folder holding anything else is refused
unless ``--overwrite``, which keeps the other files and never replaces one of them; a training run's folder or
checkpoint is refused always. The files of ``megarl report``, ``megarl bench ... --json`` and ``megarl sweep``: one
that exists is replaced only with ``--overwrite``. megarl never replaces a file it did not write in this run.

The conversion and export worlds are replaced by functions that write what the ranks write (a folder replaced
whole, as :func:`megarl.models.checkpoint.save_checkpoint` and :func:`megarl.models.hf_io.save_hf_checkpoint`
do), so these tests check the folder handling alone, in seconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import megarl.launch.convert as lc
import megarl.models.checkpoint as ck
from megarl.cli import main


def _fake_world(fn, world_size, *args, reraise=()):
    """What the ranks of ``convert_rank`` / ``export_rank`` leave: their output folder, replaced whole."""
    out = Path(args[1])
    shutil.rmtree(out, ignore_errors=True)
    (out / "model").mkdir(parents=True) if fn is lc.convert_rank else out.mkdir(parents=True)
    if fn is lc.convert_rank:
        (out / "megarl.json").write_text(json.dumps({"format": "megarl"}))
        (out / "model" / "shard").write_text("weights")
    else:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text(name)
    return [str(out)]


@pytest.fixture
def cli(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(lc, "run_world", _fake_world)
    monkeypatch.setattr(lc, "check_conversion", lambda *a: None)
    monkeypatch.setattr(ck, "checkpoint_fault", lambda path: None)  # the stand-in checkpoints hold no tensors
    monkeypatch.chdir(tmp_path)

    def run(*argv):
        status = main(list(argv))
        return status, capsys.readouterr().err
    return run


def test_convert_refuses_a_folder_of_other_files_and_overwrite_keeps_them(cli, tmp_path):
    assert cli("convert", "src", "ckpt")[0] == 0
    status, err = cli("convert", "src", "ckpt")                       # its own earlier output: only with the flag
    assert status == 2 and err.strip() == (f"megarl: error: megarl convert: the output folder {tmp_path / 'ckpt'} "
                                           "holds a megarl checkpoint converted earlier (megarl.json, model); pass "
                                           "--overwrite to replace it, or name a new or empty folder"), err
    assert cli("convert", "src", "ckpt", "--overwrite")[0] == 0      # replaced
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    status, err = cli("convert", "src", "ckpt")
    assert status == 2 and "holds files that megarl convert did not write (notes.txt)" in err and "--overwrite" in err
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "mine"
    assert cli("convert", "src", "ckpt", "--overwrite")[0] == 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["megarl.json", "model", "notes.txt"]
    assert not list(tmp_path.glob(".ckpt*"))                          # no staging folder left


def test_export_refuses_a_full_folder_and_replaces_only_its_own_files(cli, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "megarl.json").write_text("{}")
    user = tmp_path / "hf"
    user.mkdir()
    for k in range(30):
        (user / f"file{k}.txt").write_text(str(k))
    status, err = cli("export", str(ckpt), "hf")
    assert status == 2 and "megarl export did not write (file0.txt, file1.txt" in err and "and 25 more" in err, err
    assert len(list(user.iterdir())) == 30
    assert cli("export", str(ckpt), "hf", "--overwrite")[0] == 0
    names = sorted(p.name for p in user.iterdir())
    assert len(names) == 34 and {"config.json", "model.safetensors", "megarl_export.json"} <= set(names)
    assert json.loads((user / "megarl_export.json").read_text())["files"] == \
        ["config.json", "model.safetensors", "tokenizer.json"]
    # a folder holding only an earlier export: replaced only with --overwrite (issue 48)
    assert cli("export", str(ckpt), "fresh")[0] == 0
    written = _files(tmp_path / "fresh")
    status, err = cli("export", str(ckpt), "fresh")
    assert status == 2 and err.strip() == (
        f"megarl: error: megarl export: the output folder {tmp_path / 'fresh'} holds the output of an earlier megarl "
        "export (config.json, megarl_export.json, model.safetensors, tokenizer.json); pass --overwrite to replace "
        "it, or name a new or empty folder"), err
    assert _files(tmp_path / "fresh") == written
    assert cli("export", str(ckpt), "fresh", "--overwrite")[0] == 0
    (tmp_path / "fresh" / "README.md").write_text("mine")
    assert cli("export", str(ckpt), "fresh")[0] == 2
    assert cli("export", str(ckpt), "not_a_folder")[0] == 0
    (tmp_path / "afile").write_text("x")
    status, err = cli("export", str(ckpt), "afile")
    assert status == 2 and "is a file; name a folder" in err


def _training_run(root: Path) -> dict[Path, bytes]:
    """A run folder as ``megarl train`` leaves it, with one checkpoint; returns every file and its bytes."""
    run = root / "runs" / "r"
    step = run / "checkpoints" / "step_000002"
    (step / "model").mkdir(parents=True)
    (step / "ranks").mkdir()
    (step / "megarl.json").write_text(json.dumps({"format": "megarl", "step": 2, "loader": {"epoch": 0}}))
    (step / "model" / "shard").write_text("trained weights and Adam state")
    (step / "ranks" / "rng_0.pt").write_text("rng")
    for name in ("run.lock", "metrics.jsonl", "config.json", "summary.json"):
        (run / name).write_text(name)
    return _files(root)


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_convert_never_replaces_a_training_checkpoint_nor_writes_into_a_run(cli, tmp_path):
    """Issue 33 item 1: ``convert SRC runs/<name>/checkpoints/step_N`` replaced the run's checkpoint (a megarl
    checkpoint, so "its own output") with a fresh conversion, without ``--overwrite``."""
    _training_run(tmp_path)
    step = tmp_path / "runs" / "r" / "checkpoints" / "step_000002"
    shutil.copytree(step, tmp_path / "best")  # a training checkpoint copied out of its run
    before = _files(tmp_path)
    for out, what in ((step, "in the checkpoints of the training run in"),
                      (step.with_name("step_000009"), "in the checkpoints of the training run in"),
                      (step.parent.parent, "the folder of a training run"),
                      (tmp_path / "best", "a training checkpoint")):
        for flags in ((), ("--overwrite",)):
            status, err = cli("convert", "src", str(out), *flags)
            assert status == 2 and what in err and "--overwrite included" in err, (out, flags, err)
    assert _files(tmp_path) == before
    assert not step.with_name("step_000009").exists() and not list(tmp_path.rglob(".*megarl-*"))


def test_export_overwrite_keeps_every_file_it_did_not_write(cli, tmp_path):
    """Issue 33 item 3: ``export CKPT runs/<name> --overwrite`` replaced the run's ``config.json`` (then ``megarl
    eval`` of the run failed), although the refusal said the files export did not write stay."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "megarl.json").write_text("{}")
    _training_run(tmp_path)
    user = tmp_path / "hf"
    user.mkdir()
    (user / "config.json").write_text("the user's")
    (user / "notes.txt").write_text("mine")
    before = _files(tmp_path)
    status, err = cli("export", str(ckpt), str(tmp_path / "runs" / "r"), "--overwrite")
    assert status == 2 and "is the folder of a training run" in err, err
    status, err = cli("export", str(ckpt), "hf", "--overwrite")   # known before the export runs
    assert status == 2 and "holds config.json, which megarl export writes but did not write there" in err, err
    (user / "config.json").unlink()
    (user / "tokenizer.json").write_text("the user's")              # found once the export has written its files
    before = _files(tmp_path)
    status, err = cli("export", str(ckpt), "hf", "--overwrite")
    assert status == 2 and "holds tokenizer.json, which megarl export writes" in err, err
    assert _files(tmp_path) == before and not list(tmp_path.glob(".hf*"))
    (user / "tokenizer.json").unlink()
    assert cli("export", str(ckpt), "hf", "--overwrite")[0] == 0
    assert (user / "notes.txt").read_text() == "mine" and (user / "config.json").read_text() == "config.json"
    assert cli("export", str(ckpt), "hf", "--overwrite")[0] == 0    # its own files, replaced


def test_data_arithmetic_never_replaces_the_users_parquet_files(cli, tmp_path):
    """Issue 33 item 5: ``megarl data arithmetic --out DIR`` replaced a user's ``DIR/train.parquet``."""
    import pyarrow.parquet as pq

    out = tmp_path / "mydata"
    out.mkdir()
    (out / "train.parquet").write_text("the user's own data")
    for flags in ((), ("--overwrite",)):
        status, err = cli("data", "arithmetic", "--out", "mydata", *flags)
        assert status == 2 and "train.parquet" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["train.parquet"]
    assert (out / "train.parquet").read_text() == "the user's own data"
    (out / "train.parquet").rename(out / "notes.parquet")
    assert cli("data", "arithmetic", "--out", "mydata", "--overwrite")[0] == 0
    assert (out / "notes.parquet").read_text() == "the user's own data"
    assert json.loads((out / "megarl_data_arithmetic.json").read_text())["files"] == ["test.parquet", "train.parquet"]
    assert pq.read_metadata(out / "train.parquet").num_rows == 336
    (out / "notes.parquet").unlink()
    written = _files(out)
    status, err = cli("data", "arithmetic", "--out", "mydata")       # its own earlier output: only with the flag
    assert status == 2 and "holds the output of an earlier megarl data arithmetic" in err and "--overwrite" in err
    assert _files(out) == written
    assert cli("data", "arithmetic", "--out", "mydata", "--overwrite")[0] == 0
    assert cli("data", "arithmetic", "--out", "new/folder")[0] == 0
    assert sorted(p.name for p in (tmp_path / "new" / "folder").iterdir()) == [
        "megarl_data_arithmetic.json", "test.parquet", "train.parquet"]


def test_a_failed_overwrite_leaves_the_earlier_output_as_it_was(cli, tmp_path, monkeypatch):
    """Issue 48: ``convert --overwrite`` of a folder holding an earlier conversion wrote into the folder itself, so a
    conversion that failed halfway had already replaced (here: deleted) the earlier checkpoint. The new output is
    written beside and renamed in at the end: a failure leaves the earlier one whole, and no staging folder."""
    assert cli("convert", "src", "ckpt")[0] == 0
    before = _files(tmp_path / "ckpt")

    def failing_world(fn, world_size, *args, reraise=()):
        out = Path(args[1])
        shutil.rmtree(out, ignore_errors=True)
        (out / "model").mkdir(parents=True)
        (out / "model" / "shard").write_text("half a conversion")
        raise ValueError("rank 1: the source is damaged")
    monkeypatch.setattr(lc, "run_world", failing_world)
    status, err = cli("convert", "src", "ckpt", "--overwrite")
    assert status == 2 and "the source is damaged" in err, err
    assert _files(tmp_path / "ckpt") == before and not list(tmp_path.glob(".ckpt*"))


def _refused(status: int, err: str, *paths: Path) -> bool:
    """One ``megarl: error:`` line naming each path and ``--overwrite``, status 2."""
    lines = err.strip().splitlines()
    return (status == 2 and len(lines) == 1 and lines[0].startswith("megarl: error:") and "--overwrite" in lines[0]
            and all(str(p) in lines[0] for p in paths))


def test_report_replaces_an_earlier_report_only_with_overwrite(cli, tmp_path):
    """Issue 48: ``megarl report RUN`` replaced the report that the run (or an earlier ``megarl report``) wrote,
    and a user's own ``report.md`` with it; now refused, naming the files and ``--overwrite``, which replaces them
    (each renamed into place; no staging file left)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n"
                                               for s in (1, 2)))
    (run / "report.md").write_text("my notes")
    status, err = cli("report", str(run))
    assert _refused(status, err, run / "report.md"), err
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "report.md"]
    assert cli("report", str(run), "--overwrite")[0] == 0
    page = (run / "report.md").read_text()
    assert "2 steps; last step: reward 0.200" in page and "](report/reward.png)" in page
    assert (run / "report" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    status, err = cli("report", str(run))                            # megarl report's own earlier report
    assert _refused(status, err, run / "report.md", run / "report"), err
    assert cli("report", str(run), "--overwrite")[0] == 0
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "report", "report.md"]


def test_bench_and_sweep_files_of_an_earlier_run_are_refused_before_any_work(cli, tmp_path, monkeypatch):
    """Issue 48: ``megarl bench step|generation|reshard --json PATH`` and ``megarl sweep`` replaced an earlier
    run's report, table, CSV and plot. Each is refused before anything runs, naming the file and ``--overwrite``."""
    import yaml

    import megarl.bench.generation
    import megarl.bench.reshard
    import megarl.bench.step
    import megarl.launch.sweep
    from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts

    def started(*args, **kwargs):
        raise AssertionError("the benchmark started")
    for module, name in ((megarl.bench.step, "bench_step"), (megarl.bench.generation, "bench_generation"),
                         (megarl.bench.reshard, "run"), (megarl.launch.sweep, "run_local")):
        monkeypatch.setattr(module, name, started)
    model, data = make_tiny_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl", 8)
    task = task_overrides(model, data, tmp_path / "runs", "b")
    earlier = tmp_path / "earlier.json"
    earlier.write_text("an earlier run's report")
    for argv in (["bench", "step", *task, "--json", str(earlier)],
                 ["bench", "generation", *task, "rollout.engine=vllm", "--json", str(earlier)],
                 ["bench", "reshard", "micro", "--json", str(earlier)]):
        status, err = cli(*argv)
        assert _refused(status, err, earlier) and "or give another --json" in err, (argv, err)
    assert earlier.read_text() == "an earlier run's report"
    sweep = tmp_path / "again.yaml"
    sweep.write_text(yaml.safe_dump({"name": "again", "output": str(tmp_path / "sweeps"), "overrides": task,
                                     "grid": {"actor.parallel.tp": [1]}, "job": {"ntasks_per_node": 1}}))
    table = tmp_path / "sweeps" / "again" / "results.csv"
    table.parent.mkdir(parents=True)
    table.write_text("an earlier sweep's table")
    status, err = cli("sweep", str(sweep), "--local")
    assert _refused(status, err, table), err
    assert sorted(p.name for p in table.parent.iterdir()) == ["results.csv"]
    monkeypatch.setattr(megarl.launch.sweep, "run_local", lambda *a: None)  # the point ran, and wrote nothing
    assert cli("sweep", str(sweep), "--local", "--overwrite")[0] == 0
    assert table.read_text().startswith("point,") and (table.parent / "throughput.png").is_file()
    assert not list(table.parent.glob(".*"))


def test_a_run_folder_is_known_by_what_megarl_train_writes_first():
    """:data:`megarl.output_folder.RUN_FOLDER_SIGNS` names the trainer's own files (the module sits below the
    trainer and cannot import their names)."""
    from megarl.output_folder import RUN_CHECKPOINTS, RUN_FOLDER_SIGNS
    from megarl.parallel.run_lock import LOCK_FILE
    from megarl.trainer.run_record import RECORD

    assert LOCK_FILE in RUN_FOLDER_SIGNS and RUN_CHECKPOINTS in RUN_FOLDER_SIGNS
    assert set(RUN_FOLDER_SIGNS) - {LOCK_FILE, RUN_CHECKPOINTS} <= set(RECORD)


@pytest.mark.slow  # CI time (45 minutes): one of the 30 slowest of the default tier
def test_a_real_conversion_into_its_earlier_output_needs_overwrite_and_ends_without_a_traceback(tmp_path):
    """Issue 48: ``megarl convert`` into a folder holding a checkpoint it converted earlier rewrote it without
    ``--overwrite`` (status 0; a ``multiprocessing.resource_tracker`` KeyError traceback at exit): now one line
    naming the flag, status 2, the earlier checkpoint unchanged; with ``--overwrite`` it is replaced, and no
    conversion prints a traceback (the tiny model of :mod:`tests.rl_tasks`, real conversion worlds)."""
    import subprocess
    import sys

    from tests.rl_tasks import make_tiny_model

    model, out = make_tiny_model(tmp_path / "model"), tmp_path / "ckpt"

    def convert(*flags):
        return subprocess.run([sys.executable, "-m", "megarl.cli", "convert", str(model), str(out), *flags],
                              capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)

    def files():
        return {f: f.read_bytes() for f in sorted(out.rglob("*")) if f.is_file()}

    first = convert()
    assert first.returncode == 0 and "Traceback" not in first.stderr, first.stderr[-3000:]
    written = files()
    again = convert()
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"megarl: error: megarl convert: the output folder {out} holds a megarl checkpoint converted earlier "
        "(megarl.json, model); pass --overwrite to replace it, or name a new or empty folder"], again.stderr
    assert files() == written
    replaced = convert("--overwrite")
    assert replaced.returncode == 0 and "Traceback" not in replaced.stderr, replaced.stderr[-3000:]
    assert set(files()) == set(written)


def test_two_processes_stage_apart_and_a_dead_ones_staging_is_removed(tmp_path):
    """Two runs preparing the same data at once each write their own staging copy (the name carries the pid):
    the second's claim used to delete the first's copy mid-write (seen with two CPU runs of one data.prepare).
    A copy whose process is gone is removed; a live process's copy stays."""
    import subprocess
    import sys

    from megarl.output_folder import OutputFolder, staging_path

    target = tmp_path / "arithmetic"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        live_copy, dead_copy = staging_path(target, "data", other.pid), staging_path(target, "data", dead.pid)
        for path in (live_copy, dead_copy):
            path.mkdir()
            (path / "train.parquet").write_text("half written")
        assert staging_path(target, "data") not in (live_copy, dead_copy)
        with OutputFolder.claim(target, "data") as folder:
            folder.staging.mkdir()
            (folder.staging / "train.parquet").write_text("ours")
        assert (target / "train.parquet").read_text() == "ours"
        assert (live_copy / "train.parquet").read_text() == "half written" and not dead_copy.exists()
    finally:
        other.kill()
        other.wait()
