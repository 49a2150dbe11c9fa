"""A new run in the folder of an earlier run that saved no checkpoint keeps that run's record (issue 33 item 2;
:mod:`megarl.trainer.run_record`): its metrics, samples, config, summary, report and restarts move to
``earlier/<k>/`` unchanged, and the new run's record starts empty."""

from __future__ import annotations

import json
import shutil

from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts

EARLIER = {"metrics.jsonl": '{"step": 1, "reward/mean": 0.125}\n{"step": 2, "reward/mean": 0.25}\n',
           "metrics.jsonl.torn": '{"step": 3, "rew\n', "samples.jsonl": '{"step": 1, "response": "earlier"}\n',
           "config.json": '{"run": {"name": "earlier"}}', "summary.json": '{"steps": 2}', "report.md": "# earlier",
           "report/reward.png": "png", "restarts.jsonl": '{"restart": 1, "reason": "the run failed"}\n',
           "notes.txt": "the user's own"}


def _write(run, files):
    for name, text in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)


def test_a_new_run_keeps_the_record_of_an_earlier_run_without_checkpoint(tmp_path):
    """The earlier run died before its first save: ``megarl train`` of a new run replaced its ``metrics.jsonl``,
    samples, ``config.json``, summary and report. Now they are in ``earlier/1/``, byte for byte; the new run's
    record holds its own step alone; a file that is not a run's record stays where it was."""
    model, data = make_tiny_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl", 8)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    _write(run, EARLIER)
    (run / "run.lock").write_text("")
    history = run_world(train_on_rank, 1, task_overrides(model, data, tmp_path / "runs", "r")
                        + ["data.prompts_per_step=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                           "actor.micro_batch_size=4", "trainer.steps=1"])[0]
    kept = run / "earlier" / "1"
    assert {name: (kept / name).read_text() for name in EARLIER if name != "notes.txt"} == \
        {name: text for name, text in EARLIER.items() if name != "notes.txt"}
    assert (run / "notes.txt").read_text() == "the user's own" and not (kept / "notes.txt").exists()
    assert [h["step"] for h in history] == [1] and history[0]["reward/mean"] != 0.125
    assert json.loads((run / "config.json").read_text())["run"]["name"] == "r"
    assert json.loads((run / "summary.json").read_text())["steps"] == 1
    assert [json.loads(x)["step"] for x in (run / "samples.jsonl").read_text().splitlines()] == [1, 1]
    assert not (run / "restarts.jsonl").exists() and not (run / "metrics.jsonl.torn").exists()


def test_a_restart_from_step_0_keeps_its_restarts_and_the_next_record_goes_to_the_next_folder(tmp_path, monkeypatch,
                                                                                              caplog):
    """``--max-restarts`` restarts a run that saved nothing from step 0: the failed attempt's record moves to the
    next ``earlier/<k>``, and ``restarts.jsonl`` (this run's) stays; a folder without a record moves nothing."""
    from megarl.parallel.restart import RESTART_ENV
    from megarl.trainer.run_record import keep_earlier_record

    run = tmp_path / "r"
    run.mkdir()
    assert keep_earlier_record(run) is None and not (run / "earlier").exists()
    (run / "earlier" / "1").mkdir(parents=True)
    _write(run, {"metrics.jsonl": "{}\n", "restarts.jsonl": '{"restart": 1}\n', "tensorboard/events": "x"})
    monkeypatch.setenv(RESTART_ENV, "1")
    assert keep_earlier_record(run) == run / "earlier" / "2"
    assert sorted(p.name for p in (run / "earlier" / "2").iterdir()) == ["metrics.jsonl", "tensorboard"]
    assert (run / "restarts.jsonl").read_text() == '{"restart": 1}\n'
    assert "held the record of a failed attempt of this run that saved no checkpoint (metrics.jsonl, tensorboard)" \
        in caplog.text


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_resumed_run_logs_each_step_once(tmp_path):
    """Issue 48: a run with ``trainer.save_every=2`` killed during step 4 had logged step 3 after its last
    checkpoint (step 2); resumed, it logs step 3 again. The folder now holds each step once: step 3's first
    records are moved to ``<file>.superseded`` (kept, named in a warning), ``metrics.jsonl`` and ``samples.jsonl``
    hold steps 1 to 4 once each, and the report shows each logged sample once. (The crash is the folder of a run
    of 3 steps without its step-3 checkpoint: what a kill in step 4 leaves.)"""
    model, data = make_tiny_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl", 16)
    base = task_overrides(model, data, tmp_path / "runs", "r") + [
        "data.prompts_per_step=2", "rollout.n=2", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4",
        "trainer.save_every=2", "trainer.keep_checkpoints=2", "trainer.log_samples=3"]
    run = tmp_path / "runs" / "r"
    run_world(train_on_rank, 1, base + ["trainer.steps=3"])
    shutil.rmtree(run / "checkpoints" / "step_000003")
    first = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert _steps(run / "metrics.jsonl") == [1, 2, 3] and _steps(run / "samples.jsonl") == [1] * 3 + [2] * 3 + [3] * 3
    history = run_world(train_on_rank, 1, base + ["trainer.steps=4", "trainer.resume=true", "trainer.report=true"])[0]
    assert _steps(run / "metrics.jsonl") == [1, 2, 3, 4] and [h["step"] for h in history] == [1, 2, 3, 4]
    assert _steps(run / "samples.jsonl") == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    assert [json.loads(line) for line in (run / "metrics.jsonl.superseded").read_text().splitlines()] == first[2:]
    assert _steps(run / "samples.jsonl.superseded") == [3] * 3
    assert history[2]["reward/mean"] == first[2]["reward/mean"]  # step 3 trained again, as before the crash
    shown = [s.split("\n## ")[0] for s in (run / "report.md").read_text().split("\n### ")[1:]]  # a sample each
    assert len(shown) == len(set(shown)) > 0, shown
