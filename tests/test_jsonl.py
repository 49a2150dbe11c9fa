"""JSON-lines record files after a crash (:mod:`megarl.jsonl`; issue 33 item 4): a torn last line of a run's
``metrics.jsonl`` is set aside before the next record is appended, and a line damaged by an older megarl (a record
appended onto a torn one) is read from where its record starts; no complete record is lost, and the summary and
``megarl report`` read the folder."""

from __future__ import annotations

import json
import logging

from megarl.jsonl import append_records, read_records
from megarl.parallel.restart import read_restarts, record_restart
from megarl.trainer.metrics import MetricsLogger, read_metrics, summary_text

STEPS = [{"step": s, "reward/mean": s / 10, "time/step": 1.0} for s in (1, 2)]


def test_a_resumed_run_appends_after_a_torn_metrics_line_and_the_summary_and_report_read_it(tmp_path, caplog):
    """The run crashed while writing step 3's record; resumed from step 2's checkpoint it logs steps 3 and 4."""
    run = tmp_path / "run"
    run.mkdir()
    torn = '{"step": 3, "reward/mean": 0.3, "time/st'
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in STEPS) + torn)
    logger = MetricsLogger(run / "metrics.jsonl", 4, 2, enabled=True, progress=False, loggers=("jsonl",))
    with caplog.at_level(logging.WARNING, logger="megarl.jsonl"):
        logger.log(3, {"reward/mean": 0.35, "time/step": 1.0})
        logger.log(4, {"reward/mean": 0.4, "time/step": 1.0})
    logger.close()
    assert [(h["step"], h["reward/mean"]) for h in read_metrics(run / "metrics.jsonl")] == [
        (1, 0.1), (2, 0.2), (3, 0.35), (4, 0.4)]
    assert (run / "metrics.jsonl.torn").read_text() == torn + "\n"           # its bytes kept aside
    assert [r.message for r in caplog.records if "torn line" in r.message] == [
        f"{run / 'metrics.jsonl'} ended in a torn line (a process stopped while writing it): its {len(torn)} bytes "
        f"were moved to {run / 'metrics.jsonl.torn'}; every complete record is kept"]
    text = summary_text(read_metrics(run / "metrics.jsonl"), run_dir=run, checkpoint=None, hf_export=None, wall_s=1,
                        steps_this_session=2)
    assert "finished at step 4" in text and "0.100 0.200 0.350 0.400" in text, text
    from megarl.trainer.report import write_report

    assert "4 steps; last step: reward 0.400" in write_report(run).read_text()


def test_a_record_appended_onto_a_torn_line_by_an_older_megarl_is_read(tmp_path, caplog):
    """A folder that an older megarl left (step 3's record appended onto step 2's torn one, a garbage line): every
    complete record is read, each damaged line named in a warning, and a nested object of a torn record is not
    taken for a record; ``megarl report`` and the restart records read such files too."""
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps(STEPS[0]), '{"step": 2, "reward/mean": 0.2, "ti' + json.dumps({"step": 3, "reward/mean": 0.3}),
             "\x00\x00garbage", '{"step": 4, "nested": {"a": 9}', json.dumps({"step": 5, "reward/mean": 0.5})]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="megarl.jsonl"):
        assert [h["step"] for h in read_metrics(run / "metrics.jsonl")] == [1, 3, 5]
    warned = [r.message for r in caplog.records]
    assert any("line 2 starts with 35 characters of a torn record" in m for m in warned), warned
    assert any("line 3 is not a complete JSON record" in m for m in warned), warned
    assert any("line 4 is not a complete JSON record" in m for m in warned), warned
    from megarl.trainer.report import write_report

    assert "5 steps; last step: reward 0.500" in write_report(run).read_text()

    record_restart(run, restart=1, reason="the run failed")
    with (run / "restarts.jsonl").open("a") as f:
        f.write('{"time": "2026')                                              # the supervisor killed mid-write
    record_restart(run, restart=2, reason="the run failed")
    assert [r["restart"] for r in read_restarts(run)] == [1, 2]
    append_records(run / "new" / "samples.jsonl", [{"step": 1}, {"step": 2}])  # folder made; nothing torn
    assert read_records(run / "new" / "samples.jsonl") == [{"step": 1}, {"step": 2}]
    assert not (run / "new" / "samples.jsonl.torn").exists()


def test_a_complete_last_record_without_its_newline_is_kept(tmp_path, caplog):
    """Issue 48: the process stopped after writing step 3's whole record but before its newline; the record parses,
    so it is kept (its line ended) and nothing is set aside; the next record starts a line of its own."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in STEPS) + json.dumps({"step": 3, "reward/mean": 0.3}))
    with caplog.at_level(logging.WARNING, logger="megarl.jsonl"):
        append_records(path, [{"step": 4, "reward/mean": 0.4}])
    assert [(h["step"], h["reward/mean"]) for h in read_metrics(path)] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert not (tmp_path / "metrics.jsonl.torn").exists()
    assert path.read_text().endswith('{"step": 3, "reward/mean": 0.3}\n{"step": 4, "reward/mean": 0.4}\n')
    assert any("complete record without its newline" in r.message for r in caplog.records), caplog.records


def test_readers_take_one_record_a_step_from_a_folder_an_older_megarl_resumed(tmp_path):
    """Issue 48: an older megarl did not cut its record back on resume. Killed in step 4 after logging step 3
    (checkpoint at step 2) and resumed, it logged 1, 2, 3, 3, 4 and step 3's samples twice; killed after step 5
    and resumed from step 3's checkpoint, it logged 4 and 5 again (other responses: vLLM without request seeds).
    The summary, the report and its plots read each step once, the later record winning, and the steps a resume
    trained again count from the resume on."""
    from megarl.trainer.report import _read_jsonl, write_report

    run = tmp_path / "run"
    run.mkdir()
    metrics = [{"step": s, "reward/mean": r} for s, r in
               [(1, 0.1), (2, 0.2), (3, 0.3), (3, 0.31), (4, 0.4), (5, 0.5), (4, 0.41), (5, 0.51), (6, 0.6)]]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    assert [(h["step"], h["reward/mean"]) for h in read_metrics(run / "metrics.jsonl")] == [
        (1, 0.1), (2, 0.2), (3, 0.31), (4, 0.41), (5, 0.51), (6, 0.6)]

    def sample(step, response, **more):
        return {"step": step, "prompt": "p", "response": response, "score": 1.0, "finish_reason": "stop", **more}

    samples = [sample(3, "a"), sample(3, "b"), sample(3, "a"), sample(3, "b"),  # step 3 twice, as it was logged
               sample(4, "c"), sample(5, "d"), sample(4, "e"), sample(5, "f")]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    assert [(s["step"], s["response"]) for s in _read_jsonl(run / "samples.jsonl")] == [
        (3, "a"), (3, "b"), (4, "e"), (5, "f")]
    page = write_report(run).read_text()
    assert "6 steps; last step: reward 0.600" in page
    assert [page.count(f"\n    {r}\n") for r in "abcdef"] == [1, 1, 0, 0, 1, 1], page
    from megarl.jsonl import latest_per_step, sample_identity

    # a step's records that are told apart (their row in the batch, a validation prompt's index and sample) all
    # count, however alike; a write of a step supersedes the earlier writes of that step and the later steps
    rows = [{"step": 1, "row": 0, "response": "x"}, {"step": 1, "row": 1, "response": "x"},
            {"step": 2, "index": 7, "sample": 0}, {"step": 2, "index": 7, "sample": 1}, {"note": "no step"},
            {"step": 1, "row": 0, "response": "y"}]
    assert latest_per_step(rows, sample_identity) == [4, 5]
    assert latest_per_step(rows[:5], sample_identity) == [0, 1, 2, 3, 4]


def test_cut_record_back_moves_the_records_after_the_checkpoint_aside(tmp_path, caplog):
    """Issue 48: the cut a resume from step 2's checkpoint makes (:func:`megarl.trainer.run_record.
    cut_record_back`): records past step 2 (a torn tail first set aside) and a step logged twice go to
    ``<file>.superseded``, byte for byte; the live files keep the rest, a damaged line left in place."""
    from megarl.trainer.run_record import cut_record_back, record_entries

    run = tmp_path / "run"
    run.mkdir()
    metrics = ['{"step": 0, "val/accuracy": 0.5}', '{"step": 1, "a": 1}', '{"step": 1, "a": 1.5}', "garbage",
               '{"step": 2, "a": 2}', '{"step": 3, "a": 3}']
    (run / "metrics.jsonl").write_text("\n".join(metrics) + '\n{"step": 4, "a"')
    (run / "samples.jsonl").write_text('{"step": 2, "row": 0}\n{"step": 3, "row": 0}\n{"step": 3, "row": 1}\n')
    (run / "val_samples.jsonl").write_text('{"step": 0, "index": 3, "sample": 0}\n')
    with caplog.at_level(logging.WARNING):
        assert cut_record_back(run, 2) == {"metrics.jsonl": 2, "samples.jsonl": 2}
    assert (run / "metrics.jsonl").read_text().splitlines() == [metrics[0], metrics[2], "garbage", metrics[4]]
    assert (run / "metrics.jsonl.superseded").read_text().splitlines() == [metrics[1], metrics[5]]
    assert (run / "metrics.jsonl.torn").read_text() == '{"step": 4, "a"\n'
    assert (run / "samples.jsonl").read_text() == '{"step": 2, "row": 0}\n'
    assert (run / "samples.jsonl.superseded").read_text() == '{"step": 3, "row": 0}\n{"step": 3, "row": 1}\n'
    assert (run / "val_samples.jsonl").read_text() == '{"step": 0, "index": 3, "sample": 0}\n'
    assert any("moved to samples.jsonl.superseded" in r.message for r in caplog.records)
    assert "metrics.jsonl.superseded" in record_entries(run)  # a new run in the folder moves it to earlier/
    assert cut_record_back(run, 2) == {}


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path):
    """Issue 48: the attempt that crashed wrote steps 1-3 to TensorBoard; resumed from step 2's checkpoint, the
    run writes 3 and 4; TensorBoard reads steps 1-4, step 3 as the resumed run logged it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for start, steps in ((0, (1, 2, 3)), (2, (3, 4))):
        logger = MetricsLogger(tmp_path / "metrics.jsonl", 4, start, enabled=True, progress=False,
                               loggers=("jsonl", "tensorboard"))
        for s in steps:
            logger.log(s, {"reward/mean": s / 10 + start})
        logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2), (3, 2.3),
                                                                                     (4, 2.4)]
