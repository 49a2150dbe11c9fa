"""Validation in a run, loggers (TensorBoard, W&B), ``megarl report`` and ``megarl eval``.

The run is the tiny model of :mod:`tests.rl_tasks` learning its synthetic task with GRPO (as in
tests/test_trainer.py), validated greedily on held-out prompts of the same task before step 1, after step 6
and after step 12.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts

ROOT = Path(__file__).resolve().parents[1]
LEARN = ["trainer.steps=12", "trainer.save_every=0", "data.prompts_per_step=8", "rollout.n=8",
         "actor.ppo_mini_batch_size=32", "actor.micro_batch_size=16", "actor.optim.lr=3e-3",
         "algorithm.kl.coef=0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 12-step run with validation on 16 held-out prompts and every logger but W&B."""
    root = tmp_path_factory.mktemp("val")
    model = make_tiny_model(root / "model")
    data = write_prompts(root / "prompts.jsonl", 64)
    held_out = write_prompts(root / "held_out.jsonl", 16, seed=2)
    overrides = task_overrides(model, data, root / "runs", "val") + LEARN + [
        "validation.enabled=true", f"validation.files=[{held_out}]", "validation.num_prompts=0",
        "validation.every=6", "trainer.loggers=[console,jsonl,tensorboard]", "trainer.report=true"]
    run_world(train_on_rank, 1, overrides)
    return root / "runs" / "val", held_out


def test_validation_accuracy_rises(run):
    from megarl.trainer.metrics import read_metrics

    run_dir, held_out = run
    history = read_metrics(run_dir / "metrics.jsonl")
    val = {h["step"]: h for h in history if "val/accuracy" in h}
    assert sorted(val) == [0, 6, 12]  # before step 1, every 6 steps, after the last
    assert set(history[0]) == {"step", *(k for k in val[0] if k.startswith("val/"))}  # step 0: validation only
    assert val[0]["val/num_prompts"] == 16 and val[0]["val/clip_ratio"] > 0
    assert val[0]["val/accuracy"] < 0.5, val  # the random policy rarely answers with the target first
    assert val[12]["val/accuracy"] > 0.9, val
    samples = [json.loads(line) for line in (run_dir / "val_samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 16 + [6] * 16 + [12] * 16
    prompts = [json.loads(line)["question"] for line in held_out.read_text().splitlines()]
    assert [s["prompt"] for s in samples[:16]] == prompts  # greedy responses to every held-out prompt, in order
    acc = sum(s["correct"] for s in samples[-16:]) / 16
    assert val[12]["val/accuracy"] == pytest.approx(acc)


def test_validation_split_over_two_ranks_equals_one_rank(run):
    """Two data-parallel ranks each generate and score half of the validation prompts: the gathered figures and
    responses equal the one-rank run's before step 1."""
    run_dir, held_out = run
    root = run_dir.parents[1]
    overrides = task_overrides(root / "model", root / "prompts.jsonl", root / "runs", "val_dp2") + LEARN + [
        "trainer.steps=1", "validation.enabled=true", f"validation.files=[{held_out}]", "validation.num_prompts=0",
        "validation.at_end=false", "trainer.report=false"]
    run_world(train_on_rank, 2, overrides)
    one, two = ([json.loads(line) for line in (d / "val_samples.jsonl").read_text().splitlines()]
                for d in (run_dir, root / "runs" / "val_dp2"))
    assert [s for s in one if s["step"] == 0] == two and len(two) == 16


def test_eval_of_the_start_model_and_the_final_checkpoint_matches_the_run(run):
    """`megarl eval` of the model the run started from (HF directory) and of its final megarl checkpoint gives
    the run's own validation figures before step 1 and after step 12 (greedy, same prompts and weights)."""
    from megarl.trainer.metrics import read_metrics

    run_dir, held_out = run
    val = {h["step"]: h for h in read_metrics(run_dir / "metrics.jsonl") if "val/accuracy" in h}
    task = task_overrides(run_dir.parents[1] / "model", held_out, run_dir.parent, "eval")
    common = [o for o in task if not o.startswith("model.path")] + [f"validation.files=[{held_out}]",
                                                                    "validation.num_prompts=0"]
    for model, step in ((run_dir.parents[1] / "model", 0), (run_dir / "checkpoints" / "step_000012", 12)):
        out = run_dir.parent / f"eval{step}"
        r = subprocess.run([sys.executable, "-m", "megarl.cli", "eval", str(model), *common, f"--out={out}"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "megarl eval: generating 16 prompts of" in r.stdout and "megarl eval: generating took" in r.stdout
        result = json.loads((out / "eval.json").read_text())
        assert result["model"] == str(model.resolve())  # the same from any working folder
        got = result["metrics"]
        for key in ("val/accuracy", "val/reward_mean", "val/response_length_mean", "val/num_prompts"):
            assert got[key] == pytest.approx(val[step][key]), (step, key)
        in_run = [json.loads(line) for line in (run_dir / "val_samples.jsonl").read_text().splitlines()]
        evaluated = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
        assert [s["response"] for s in evaluated] == [s["response"] for s in in_run if s["step"] == step]


def test_an_evaluation_never_replaces_an_earlier_ones_results(tmp_path):
    from megarl.offline.evaluate import result_files

    assert result_files(tmp_path / "new") == (tmp_path / "new" / "eval.json", tmp_path / "new" / "eval_samples.jsonl")
    (tmp_path / "eval.json").write_text("{}")
    assert result_files(tmp_path) == (tmp_path / "eval-2.json", tmp_path / "eval_samples-2.jsonl")
    (tmp_path / "eval_samples-2.jsonl").write_text("")
    assert result_files(tmp_path)[0] == tmp_path / "eval-3.json"


def test_run_records_its_validation_files_as_absolute_paths(tmp_path, monkeypatch):
    """A run's config.json names its validation files absolutely, so ``megarl eval`` of its checkpoint from
    another folder reads them (it prepared data/gsm8k in that folder before)."""
    from megarl.config import absolute_paths, load_config

    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(load_config(None, ["validation.files=[held/out.jsonl]"]))
    assert cfg.validation.files == [str(tmp_path / "held" / "out.jsonl")]


def test_summary_lists_validation_accuracy_by_step(run):
    from megarl.trainer.metrics import read_metrics, summary_text

    run_dir, _ = run
    history = read_metrics(run_dir / "metrics.jsonl")
    text = summary_text(history, run_dir=run_dir, checkpoint=None, hf_export=None, wall_s=1.0,
                        steps_this_session=12, validation="16 prompts of held_out.jsonl, greedy")
    val = {h["step"]: h["val/accuracy"] for h in history if "val/accuracy" in h}
    line = next(line for line in text.splitlines() if "val accuracy" in line)
    assert all(f"step {s}: {v:.3f}" in line for s, v in val.items()) and "held_out.jsonl" in line, text
    assert "finished at step 12" in text


def test_summary_and_report_count_one_step_and_show_each_sample_once(tmp_path):
    """Issue 24: "1 steps" in the summary and the report; a cut-off response shown under "Worst" and again
    under "Cut at max_new_tokens"."""
    from megarl.trainer.metrics import summary_text
    from megarl.trainer.report import pick_samples

    text = summary_text([{"step": 1, "reward/mean": 0.5}], run_dir=tmp_path, checkpoint=None, hf_export=None,
                        wall_s=1.0, steps_this_session=1)
    assert "(1 step in this session" in text, text
    samples = [{"prompt": f"p{i}", "response": f"r{i}", "score": float(i > 2), "step": 1,
                "finish_reason": "length" if i < 2 else "stop"} for i in range(5)]
    picked = pick_samples(samples, k=2)
    shown = [s["prompt"] for chosen in picked.values() for s in chosen]
    assert len(shown) == len(set(shown)), picked
    assert [s["prompt"] for s in picked["Worst"]] == ["p0", "p1"] and picked["Cut at max_new_tokens"] == []


def test_tensorboard_events_equal_the_jsonl(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megarl.trainer.metrics import read_metrics

    run_dir, _ = run
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    history = read_metrics(run_dir / "metrics.jsonl")
    for key in ("reward/mean", "val/accuracy", "actor/pg_loss", "time/generate"):
        logged = {h["step"]: h[key] for h in history if key in h}
        read = {e.step: e.value for e in events.Scalars(key)}
        assert read.keys() == logged.keys() and len(read) >= 3, key
        for step in read:
            assert read[step] == pytest.approx(logged[step], rel=1e-6, abs=1e-7), (key, step)  # float32 events


def test_report_writes_plots_and_a_page_linking_them(run):
    run_dir, _ = run  # the run wrote its report (trainer.report=true); megarl report --overwrite rewrites it
    page = run_dir / "report.md"
    page.unlink()
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "report", str(run_dir), "--overwrite"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    text = page.read_text()
    for name in ("reward", "time", "length", "kl_entropy"):
        png = run_dir / "report" / f"{name}.png"
        assert png.is_file() and png.stat().st_size > 10_000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"](report/{name}.png)" in text, name
    assert "| 12 |" in text and "## Samples" in text and "### Best" in text and "### Worst" in text
    assert "## Config" in text and "validation:" in text


def test_validation_prompts_never_enter_training(tmp_path):
    """Validation pointed at the training file: its prompts (a seeded sample) are removed from training."""
    from transformers import AutoTokenizer

    from megarl.config import ValidationConfig
    from megarl.data.dataset import PromptDataset
    from megarl.data.template import PromptTemplate
    from megarl.trainer.validation import Validation

    make_tiny_model(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    data = write_prompts(tmp_path / "prompts.jsonl", 64)
    template = PromptTemplate(use_chat_template=False)
    train = PromptDataset.from_file(data, tok, template=template)
    cfg = ValidationConfig(files=[str(data)], num_prompts=16, shuffle=True)
    val = Validation(cfg, PromptDataset.from_file(data, tok, template=template), tokenizer=tok, seed=3,
                     score=None, max_new_tokens=3)
    again = Validation(cfg, PromptDataset.from_file(data, tok, template=template), tokenizer=tok, seed=3,
                       score=None, max_new_tokens=3)
    assert val.prompts == again.prompts and val.prompts.index != list(range(16))  # a fixed, seeded sample
    before = list(train.raw_prompts)
    removed = val.hold_out(train)
    assert set(removed) >= set(val.prompts.index)  # (and any duplicates of them elsewhere in the file)
    assert not set(train.raw_prompts) & set(val.prompts.raw_prompt)
    assert len(train) == len(before) - len(removed) and set(train.raw_prompts) <= set(before)
    assert len(train.input_ids) == len(train.index) == len(train.ground_truths) == len(train)


def test_select_prompts_first_k_and_all(tmp_path):
    from transformers import AutoTokenizer

    from megarl.data.dataset import PromptDataset
    from megarl.data.template import PromptTemplate
    from megarl.trainer.validation import select_prompts

    make_tiny_model(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    ds = PromptDataset.from_file(write_prompts(tmp_path / "p.jsonl", 20), tok,
                                 template=PromptTemplate(use_chat_template=False))
    assert select_prompts(ds, 5).index == [0, 1, 2, 3, 4]
    assert select_prompts(ds, 0).index == select_prompts(ds, -1).index == list(range(20))
    assert select_prompts(ds, 50).index == list(range(20))
    assert select_prompts(ds, 5, shuffle=True, seed=1) != select_prompts(ds, 5, shuffle=True, seed=2)


def test_wandb_offline_run_files(tmp_path):
    pytest.importorskip("wandb")
    from megarl.trainer.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path / "run" / "metrics.jsonl", 2, 0, enabled=True, progress=False,
                           loggers=["jsonl", "wandb"], config={"a": 1})
    logger.log(1, {"reward/mean": 0.5})
    logger.log(2, {"reward/mean": 0.75})
    logger.close()
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((tmp_path / "run").rglob("*"))


def test_wandb_logger_without_wandb_is_a_config_error():
    import importlib.util

    from megarl.config import ConfigError, load_config

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    with pytest.raises(ConfigError, match=r"trainer\.loggers: wandb needs the 'wandb' package: pip install"):
        load_config(None, ["trainer.loggers=[console,jsonl,wandb]"])


@pytest.mark.parametrize("override,field", [
    ("validation.n=4", "validation.n"),  # greedy with n > 1
    ("validation.num_prompts=-2", "validation.num_prompts"),
    ("trainer.loggers=[console,mlflow]", "trainer.loggers"),
    ("trainer.loggers=[console]", "trainer.loggers"),  # jsonl is required
])
def test_bad_validation_or_logger_config_names_the_field(override, field):
    from megarl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.slow
def test_eval_default_model_is_deterministic(tmp_path):
    """`megarl eval default` (SmolLM2-135M GGUF) on the first 32 problems of the CPU default's test split
    (arithmetic), greedy, at most 16 new tokens, on the CPU, twice."""
    outs = []
    for k in range(2):
        out = tmp_path / f"eval{k}"
        r = subprocess.run([sys.executable, "-m", "megarl.cli", "eval", "default", "validation.num_prompts=32",
                            "rollout.max_batch_size=32", f"--out={out}"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(out)
    first, second = (json.loads((o / "eval.json").read_text()) for o in outs)
    samples = [[json.loads(line) for line in (o / "eval_samples.jsonl").read_text().splitlines()] for o in outs]
    assert first["metrics"]["val/num_prompts"] == 32 and len(samples[0]) == 32
    assert [s["response"] for s in samples[0]] == [s["response"] for s in samples[1]]
    assert {k: v for k, v in first["metrics"].items() if k != "val/seconds"} == \
        {k: v for k, v in second["metrics"].items() if k != "val/seconds"}
    assert any(s["response"].strip() for s in samples[0]) and samples[0][0]["index"] == 0
    assert all(s["length"] <= 16 for s in samples[0]) and 0 < first["metrics"]["val/accuracy"] < 1


def test_eval_default_folders_of_two_runs_checkpoints_differ():
    from megarl.cli.train import _eval_name

    assert _eval_name("runs/a/checkpoints/step_000004") == "a-step_000004"
    assert _eval_name("runs/b/checkpoints/step_000004/") == "b-step_000004"
    assert _eval_name("models/Qwen2.5-1.5B/") == "Qwen2.5-1.5B" and _eval_name("default") == "default"


def test_the_summary_names_only_files_the_run_wrote_and_its_own_figures(tmp_path):
    """``megarl sft``'s summary named a samples.jsonl that SFT never writes, and an RL throughput of "n/a
    tokens/s/GPU (prompt + response)"; an RL run's summary names its samples file where it exists, and an
    on-policy distillation's its reverse KL to the teacher by step."""
    from megarl.trainer.metrics import summary_text

    def text(history):
        return summary_text(history, run_dir=tmp_path, checkpoint=None, hf_export=None, wall_s=1.0,
                            steps_this_session=2)
    sft = text([{"step": 1, "sft/loss": 2.5, "sft/tokens_per_s": 10.0}, {"step": 2, "sft/loss": 2.0,
                                                                        "sft/tokens_per_s": 20.0}])
    assert "samples" not in sft and "prompt + response" not in sft, sft
    assert "throughput         15 tokens/s (sft/tokens_per_s) on average" in sft, sft
    dpo = text([{"step": 1, "dpo/loss": 0.7}])
    assert "samples" not in dpo and "throughput" not in dpo, dpo
    (tmp_path / "samples.jsonl").write_text("")
    rl = text([{"step": 1, "reward/mean": 0.5, "perf/tokens_per_s_per_gpu": 30.0}])
    assert f"(samples: {tmp_path / 'samples.jsonl'})" in rl and "30 tokens/s/GPU (prompt + response)" in rl, rl
    assert "teacher" not in rl
    opd = text([{"step": 1, "reward/mean": 0.1, "distill/reverse_kl": 0.25}, {"step": 2, "distill/reverse_kl": 0.125}])
    assert "  reverse KL to the teacher by step 0.25000 0.12500   (mean 0.188)" in opd, opd
