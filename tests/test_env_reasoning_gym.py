"""reasoning-gym as megarl data and reward (megarl/environments/reasoning_gym.py), against the library itself:
the rows are the library's entries for the task names, seed and size of the config, the reward is the library's
own ``score_answer`` on the same completions, and a task name the library lacks is one ``megarl: error:`` line
before anything starts."""

from __future__ import annotations

import json

import pytest
import torch

from megarl.cli import main
from megarl.config import ConfigError
from megarl.data.dataset import read_rows
from megarl.environments.reasoning_gym import check_prepared, prepare_reasoning_gym, reasoning_gym_rows
from megarl.rewards import load_reward_fn
from megarl.rewards.registry import task_metrics
from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts

rg = pytest.importorskip("reasoning_gym")


def _completions(entry):
    """Completions of every kind for one entry: the answer alone, within text, padded, wrong, empty, tagged."""
    a = str(entry["answer"])
    return [a, f"The answer is {a}.", f"  {a}\n", a + "0", "", f"<answer>{a}</answer>", "I do not know"]


def test_single_task_rows_and_reward_are_the_librarys():
    config = {"min_terms": 2, "max_terms": 3, "max_digits": 2}
    kwargs = {"tasks": {"basic_arithmetic": {"config": config}}, "size": 12, "test_size": 4, "seed": 5}
    rows = reasoning_gym_rows(kwargs)
    assert [len(rows["test"]), len(rows["train"])] == [4, 12]
    reference = rg.create_dataset("basic_arithmetic", seed=5, size=16, **config)
    every = rows["test"] + rows["train"]
    assert [r["question"] for r in every] == [reference[i]["question"] for i in range(16)]
    assert {r["task"] for r in every} == {"basic_arithmetic"}

    reward = load_reward_fn("reasoning_gym")
    responses, truths, expected = [], [], []
    for i, row in enumerate(every):
        for c in _completions(reference[i]):
            responses.append(c)
            truths.append(row["ground_truth"])
            expected.append(reference.score_answer(c.strip(), reference[i]))
    scores = reward([""] * len(responses), responses, truths)
    assert scores.tolist() == pytest.approx(expected, abs=1e-6)
    assert 0 < scores.mean() < 1 and len(set(expected)) > 2  # exact, partial and zero scores all seen

    from reasoning_gym.utils import extract_answer

    tagged = load_reward_fn("reasoning_gym", {"answer_tag": "answer"})([""] * len(responses), responses, truths)
    entries = [reference[i] for i in range(16) for _ in _completions(reference[i])]
    assert tagged.tolist() == pytest.approx([reference.score_answer(extract_answer(c), e)
                                             for c, e in zip(responses, entries)], abs=1e-6)


def test_composite_rows_follow_the_weights_and_score_as_the_library():
    kwargs = {"tasks": {"letter_counting": 3, "spell_backward": {"weight": 1, "config": {"min_word_len": 3}}},
              "size": 40, "test_size": 0, "seed": 2}
    rows = reasoning_gym_rows(kwargs)["train"]
    from reasoning_gym.composite import DatasetSpec

    reference = rg.create_dataset("composite", size=40, seed=2, datasets=[
        DatasetSpec("letter_counting", 3.0, {}), DatasetSpec("spell_backward", 1.0, {"min_word_len": 3})])
    entries = [reference[i] for i in range(40)]
    assert [r["task"] for r in rows] == [e["metadata"]["source_dataset"] for e in entries]
    assert [r["question"] for r in rows] == [e["question"] for e in entries]
    counts = {t: sum(r["task"] == t for r in rows) for t in ("letter_counting", "spell_backward")}
    assert counts["letter_counting"] > counts["spell_backward"] > 0
    responses = [f"It is {e['answer']}" if i % 3 else str(e["answer"]) for i, e in enumerate(entries)]
    scores = load_reward_fn("reasoning_gym")([""] * 40, responses, [r["ground_truth"] for r in rows])
    assert scores.tolist() == pytest.approx([reference.score_answer(r, e) for r, e in zip(responses, entries)])

    tasks = [r["task"] for r in rows] + [None]
    all_scores = torch.cat([scores, torch.tensor([0.5])])
    correct = (all_scores >= 1).tolist()
    m = task_metrics(tasks, all_scores, correct, torch.ones(41, dtype=torch.bool))
    for t in counts:
        picked = [s for s, task in zip(scores.tolist(), tasks) if task == t]
        assert m[f"reward/{t}/mean"] == pytest.approx(sum(picked) / len(picked))
        assert m[f"reward/{t}/accuracy"] == pytest.approx(sum(s >= 1 for s in picked) / len(picked))


def test_prepared_files_and_other_settings(tmp_path):
    kwargs = {"tasks": "letter_counting", "size": 6, "test_size": 2, "seed": 1}
    written = prepare_reasoning_gym(tmp_path / "reasoning_gym", kwargs)
    train, test = read_rows(written["train"]), read_rows(written["test"])
    assert [len(test), len(train)] == [2, 6] and set(train[0]) == {"index", "question", "ground_truth", "task",
                                                                   "answer"}
    assert json.loads(train[0]["ground_truth"])["index"] == 2  # after the test rows: no row in both
    check_prepared([str(written["train"])], kwargs)
    with pytest.raises(ConfigError, match=r"data.prepare_kwargs: .*train.parquet was generated from"):
        check_prepared([str(written["train"])], {**kwargs, "seed": 2})
    with pytest.raises(ConfigError, match=r"data.prepare_kwargs.tasks.letter_counting.config: reasoning-gym "
                                          r"refuses \{'min_words': 0\}"):
        reasoning_gym_rows({"tasks": {"letter_counting": {"config": {"min_words": 0}}}})


def test_unknown_task_is_one_error_line_before_anything_starts(tmp_path, monkeypatch, capsys):
    import megarl.parallel.launch
    import megarl.trainer.trainer

    def started(*_, **__):
        raise AssertionError("a process, world or model was started for a bad input")

    monkeypatch.setattr(megarl.parallel.launch, "run_world", started)
    monkeypatch.setattr(megarl.trainer.trainer, "train", started)
    model = make_tiny_model(tmp_path / "model")
    data = write_prompts(tmp_path / "prompts.jsonl", 8)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    status = main(["train", *task_overrides(model, data, "runs", "bad"), "data.prepare=reasoning_gym",
                   "data.train_files=[data/reasoning_gym/train.parquet]", "reward.fn=reasoning_gym",
                   "data.prepare_kwargs.tasks=[basic_arithmetic, leter_counting]"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("megarl: error: data.prepare_kwargs.tasks: reasoning-gym has no task "
                               "'leter_counting'; did you mean one of ['letter_counting'"), lines[0]
    assert list(work.iterdir()) == []


def test_a_misspelt_config_field_is_named_with_the_tasks_fields():
    """``max_digit`` for ``max_digits``: the error lists the task's config fields (reasoning-gym's dataclass), the
    fix a TypeError alone did not give."""
    from megarl.environments.reasoning_gym import normalise_kwargs

    with pytest.raises(ConfigError, match=r"data.prepare_kwargs.tasks.basic_arithmetic.config: reasoning-gym refuses "
                                          r"\{'max_digit': 1\}: TypeError: .*'max_digit'; basic_arithmetic's config "
                                          r"fields: \['min_terms', 'max_terms', 'min_digits', 'max_digits'"):
        normalise_kwargs({"tasks": {"basic_arithmetic": {"config": {"max_digit": 1}}}})
