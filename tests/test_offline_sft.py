"""``megarl sft`` (issue 45): assistant-token masks from the chat template, the masked cross-entropy against the
transformers model at TP=2, PP=2 and with packing, no loss on prompt tokens, resume, and the checkpoint as a
``model.path`` for ``megarl train``.

The tiny word-level model of :mod:`tests.rl_tasks` (its chat template writes each message's words and a space, an
assistant turn closed by ``<eos>``), fp32, on CPU gloo worlds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megarl.data.template import DataError
from tests.distributed import run_world
from tests.rl_tasks import WORDS, make_tiny_model, task_overrides, train_on_rank, write_prompts

SYSTEM, TRAILING = "y", "k"


def _rows(n: int = 8, trailing: str = TRAILING) -> list[dict]:
    """Half conversations (system, user, assistant, user, assistant, user), half prompt/completion rows."""
    g = torch.Generator().manual_seed(3)
    letters = WORDS[3:14]
    rows = []
    for i in range(n):
        words = " ".join(letters[int(k)] for k in torch.randint(0, len(letters), (int(torch.randint(2, 5, (1,),
                                                                                                    generator=g)),),
                                                                  generator=g))
        if i % 2:
            rows.append({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": words},
                                      {"role": "assistant", "content": "x " + words.split()[0]},
                                      {"role": "user", "content": "j"}, {"role": "assistant", "content": "x"},
                                      {"role": "user", "content": trailing}]})
        else:
            rows.append({"prompt": words, "completion": "x " + words.split()[-1]})
    return rows


def _hand_mask(row: dict) -> tuple[list[int], list[int]]:
    """Token ids and assistant mask of a row, built by hand from the tiny template: every message's words, an
    assistant message's words and the ``<eos>`` that closes it marked."""
    msgs = row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                   {"role": "assistant", "content": row["completion"]}]
    ids, mask = [], []
    for m in msgs:
        words = m["content"].split() + (["<eos>"] if m["role"] == "assistant" else [])
        ids += [WORDS.index(w) for w in words]
        mask += [int(m["role"] == "assistant")] * len(words)
    return ids, mask


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model = make_tiny_model(root / "model")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    other = root / "chat_other_trailing.jsonl"  # the same rows but for the trailing user turns
    other.write_text("".join(json.dumps(r) + "\n" for r in _rows(trailing="a b c d")))
    return root, model, data, other


def _tokenizer(model: Path, template: str | None = None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    if template is not None:
        tok.chat_template = template
    return tok


def test_masks_come_from_the_template_and_mark_the_assistant_tokens_alone(task):
    """The incremental rendering and transformers' generation-marker mask give the hand-built mask: system, user and
    later user tokens 0, every assistant word and its ``<eos>`` 1."""
    from megarl.offline.data import Conversations

    _, model, _, _ = task
    rows = _rows()
    plain = Conversations(_tokenizer(model), None, "sft")
    marked_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
                       "{{ m['content'] }} <eos>{% endgeneration %} {% else %}{{ m['content'] }} {% endif %}"
                       "{% endfor %}")
    marked = Conversations(_tokenizer(model, marked_template), None, "sft")
    for row in rows:
        ids, mask = _hand_mask(row)
        for conv in (plain, marked):
            t = (conv.tokens(None, row["messages"], "row") if "messages" in row else
                 conv.tokens(row["prompt"], row["completion"], "row"))
            assert (t.ids, t.mask) == (ids, mask)
    assert any(0 in _hand_mask(r)[1][_hand_mask(r)[1].index(1):] for r in rows)  # later user turns: masked out


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_row(task):
    from megarl.offline.data import Conversations

    rewriting = ("{% for m in messages %}{% if loop.last %}{{ m['content'] }} {% else %}a {% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}b {% endif %}")
    conv = Conversations(_tokenizer(task[1], rewriting), None, "sft")
    with pytest.raises(DataError, match="row 7.*not render a conversation's beginning as a prefix"):
        conv.tokens(None, _rows()[1]["messages"], "row 7")


def _reference_loss(model: Path, rows: list[dict]) -> float:
    """The mean cross-entropy of the rows' assistant tokens under the transformers model (masks by hand)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for row in rows:
        ids, mask = _hand_mask(row)
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        for t in range(1, len(ids)):
            if mask[t]:
                nll -= float(logp[t - 1, ids[t]])
                count += 1
    return nll / count


def sft_each_on_rank(rank, world, runs):
    """Each of ``runs`` (``(command, overrides)``: ``sft`` or ``train``) in turn in this process; returns each
    run's metrics by step (rank 0; None elsewhere)."""
    from megarl.config import SFTRunConfig, load_config
    from megarl.offline.sft import SFTTrainer
    from megarl.offline.trainer import run
    from megarl.trainer.metrics import read_metrics

    out = []
    for command, overrides in runs:
        if command == "train":
            out.append(train_on_rank(rank, world, overrides))
            continue
        cfg = load_config(None, overrides, schema=SFTRunConfig)
        run(SFTTrainer, cfg)
        out.append(read_metrics(cfg.run.run_dir / "metrics.jsonl") if rank == 0 else None)
    return out


def _sft(task, name, *extra):
    root, model, data, _ = task
    return ("sft", [f"model.path={model}", f"sft.train_files=[{data}]", "sft.max_length=64", "sft.shuffle=false",
                    f"run.output_dir={root / 'runs'}", f"run.name={name}", "trainer.progress=false",
                    "trainer.report=false", "actor.optim.lr=1e-2", *extra])


PACKED = ["actor.max_tokens_per_micro_batch=40", "actor.sequence_packing=true"]


def test_the_masked_cross_entropy_equals_transformers_at_tp2_pp2_and_packed(task):
    """Step 1's loss (one batch of every row, before its update) equals the transformers model's mean
    cross-entropy of the hand-masked assistant tokens within 1e-5, at TP=2, PP=2 (micro-batches of 2) and DP=2
    with packed micro-batches; the rows' trailing user turns, in the response but masked, change neither the loss
    nor the gradient (their tokens get none)."""
    root, model, data, other = task
    want = _reference_loss(model, _rows())
    runs = [_sft(task, "tp2", "sft.batch_size=8", "sft.steps=1", "actor.parallel.tp=2"),
            _sft(task, "pp2", "sft.batch_size=8", "sft.steps=1", "actor.parallel.pp=2", "actor.micro_batch_size=2"),
            _sft(task, "dp2_packed", "sft.batch_size=8", "sft.steps=1", *PACKED)]
    got = run_world(sft_each_on_rank, 2, runs)[0]
    for history in got:
        assert history[0]["sft/loss"] == pytest.approx(want, abs=1e-5, rel=0)
    assert got[0][0]["sft/tokens"] == sum(sum(_hand_mask(r)[1]) for r in _rows())
    other_runs = [_sft(task, "tp1", "sft.batch_size=8", "sft.steps=1", *PACKED),
                  (_sft(task, "tp1_other", "sft.batch_size=8", "sft.steps=1", *PACKED)[0],
                   [*_sft(task, "tp1_other", "sft.batch_size=8", "sft.steps=1", *PACKED)[1],
                    f"sft.train_files=[{other}]"])]
    one, changed = run_world(sft_each_on_rank, 1, other_runs)[0]
    assert one[0]["sft/loss"] == pytest.approx(want, abs=1e-5, rel=0)
    assert (changed[0]["sft/loss"], changed[0]["actor/grad_norm"]) == (one[0]["sft/loss"], one[0]["actor/grad_norm"])


def test_resume_reproduces_the_uninterrupted_run_and_the_checkpoint_trains_with_megarl_train(task):
    """4 steps straight equal 2 steps then ``--resume`` to 4 (LR warm-up, Adam's moments, the data position over
    two epochs), metric for metric; the SFT checkpoint is a ``model.path`` for a 1-step ``megarl train``."""
    root, model, data, _ = task
    base = ["sft.batch_size=4", "sft.shuffle=true", "actor.optim.warmup_steps=3", "trainer.save_every=1"]
    prompts = write_prompts(root / "prompts.jsonl", 8)
    runs = [_sft(task, "straight", *base, "sft.steps=4"), _sft(task, "resumed", *base, "sft.steps=2"),
            _sft(task, "resumed", *base, "sft.steps=4", "trainer.resume=true"),
            ("train", [*task_overrides(root / "runs" / "straight" / "checkpoints" / "step_000004", prompts,
                                       root / "runs", "rl_from_sft"), "trainer.steps=1", "data.prompts_per_step=4",
                       "rollout.n=2", "actor.ppo_mini_batch_size=8"])]
    straight, first, resumed, rl = run_world(sft_each_on_rank, 1, runs)[0]
    assert [h["step"] for h in resumed] == [1, 2, 3, 4]
    assert straight[1]["sft/loss"] != straight[2]["sft/loss"]  # the steps differ: the check can fail
    for step in (2, 3):
        for key in ("sft/loss", "sft/tokens", "actor/grad_norm", "actor/lr", "data/epoch"):
            assert resumed[step][key] == pytest.approx(straight[step][key], rel=1e-6, abs=1e-7), (step, key)
    assert [h["step"] for h in rl] == [1] and "reward/mean" in rl[0]


@pytest.mark.parametrize("command,rows,extra,match", [
    ("sft", [{"prompt": "a b", "completion": "x"}, {"prompt": "c d"}], [],
     r"row 1: no field 'completion' .*sft.completion_key"),
    ("sft", [{"messages": [{"role": "user", "content": "a"}]}], [], "row 0: a conversation needs an assistant"),
    ("sft", [{"prompt": "a b", "completion": "x"}], ["sft.batch_size=4"], "sft.batch_size: 4 is more than the 1"),
    ("sft", [{"prompt": "a b", "completion": "x"}], ["sft.max_length=65"], "sft.max_length: 65 tokens exceed"),
    ("sft", [{"prompt": "a b", "completion": "x"}], ["sft.beta=1"], "sft.beta: Key 'beta' not in"),
    ("dpo", [{"prompt": "a b", "chosen": "x"}], [], r"row 0: no field 'rejected' .*dpo.rejected_key"),
])
def test_bad_input_is_one_error_line_before_any_process(task, tmp_path, monkeypatch, capsys, command, rows, extra,
                                                        match):
    """Bad data and settings end in one ``megarl: error:`` line naming the file and row or the field, with no
    world started and nothing written; a good config passes ``--check``."""
    import megarl.offline.trainer
    from megarl.cli import main

    def started(*_, **__):
        raise AssertionError("a run was started for a bad input")

    monkeypatch.setattr(megarl.offline.trainer, "run", started)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [command, f"model.path={task[1]}", f"{command}.train_files=[{data}]", f"{command}.batch_size=1",
            f"{command}.max_length=64", f"run.output_dir={tmp_path / 'runs'}", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("megarl: error:")
    assert __import__("re").search(match, err), err
    assert not (tmp_path / "runs").exists()
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "a b", "completion": "x", "chosen": "x", "rejected": "a"}) + "\n")
    assert main([*args[:2], f"{command}.train_files=[{good}]", *args[3:-len(extra) or None], "--check"]) == 0
    assert "check passed" in capsys.readouterr().out


def test_the_loss_is_the_same_at_cp2_and_with_lora_adapters(task):
    """Step 1's loss equals the transformers reference at CP=2 (each sequence split over two ranks) and for a LoRA
    actor at DP=2 (its adapters start at B = 0, so its model is the base), within 1e-5."""
    want = _reference_loss(task[1], _rows())
    runs = [_sft(task, "cp2", "sft.batch_size=8", "sft.steps=1", "actor.parallel.cp=2"),
            _sft(task, "lora", "sft.batch_size=8", "sft.steps=1", "actor.lora.rank=4")]
    for history in run_world(sft_each_on_rank, 2, runs)[0]:
        assert history[0]["sft/loss"] == pytest.approx(want, abs=1e-5, rel=0)
        assert history[0]["actor/grad_norm"] > 0


def test_a_datasets_name_is_guarded(monkeypatch):
    """A ``datasets`` name without the package, or one that cannot be loaded (offline), is one DataError naming
    the field and the fix; no network is touched here (the package is faked)."""
    import sys
    import types

    from megarl.offline.data import read_source

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"sft.train_files: the dataset 'org/chat' needs the 'datasets' package"):
        read_source([], "org/chat", "train", "sft.train_files")

    def offline(name, split):
        raise ConnectionError("Couldn't reach 'org/chat' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(DataError, match=r"cannot load the dataset 'org/chat' \(split 'train'\): Couldn't reach"):
        read_source([], "org/chat", "train", "sft.train_files")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(
        load_dataset=lambda name, split: [{"prompt": "a", "completion": "x"}]))
    assert read_source([], "org/chat", "train", "sft.train_files") == [
        ("org/chat[train] row 0", {"prompt": "a", "completion": "x"})]


def test_a_missing_file_is_named_with_its_field(tmp_path):
    """A data file that does not exist is one DataError naming the field (``sft.val_files``) and the path,
    not the prompt reader's GSM8K hint."""
    from megarl.offline.data import read_source

    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "a", "completion": "x"}) + "\n")
    missing = str(tmp_path / "chat_val.jsonl")
    with pytest.raises(DataError, match=r"^sft.val_files: \[.*chat_val.jsonl'\] do not exist; check the paths") as e:
        read_source([str(good), missing], None, "train", "sft.val_files")
    assert "GSM8K" not in str(e.value)
    assert read_source([str(good)], None, "train", "sft.train_files") == [(f"{good} row 0", {"prompt": "a",
                                                                                          "completion": "x"})]


def test_the_format_tasks_demonstrations_are_the_rl_runs_prompts_answered_in_the_scored_format():
    """SFT then RL (perf/RESULTS.md, issue 45): each demonstration of ``perf/sft_format_demos.py`` is the user
    message that ``parallel_configs/cpu_smollm2_rl_after_sft.yaml`` renders for the same training row, and its
    completion scores 1 under that config's reward, which gives the bare number the base model writes 0."""
    import importlib.util

    from megarl.config import load_config
    from megarl.data.arithmetic import arithmetic_rows
    from megarl.data.template import PromptTemplate
    from megarl.rewards.registry import load_reward_fn

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("sft_format_demos", root / "perf" / "sft_format_demos.py")
    demos_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demos_module)
    cfg = load_config(root / "parallel_configs" / "cpu_smollm2_rl_after_sft.yaml")
    template = PromptTemplate(system_prompt=cfg.data.system_prompt, instruction=cfg.data.instruction)
    demos = demos_module.demonstrations(4, 2)
    rows = arithmetic_rows()["train"][:6]
    assert [len(demos["train"]), len(demos["val"])] == [4, 2]
    reward = load_reward_fn(cfg.reward.fn, cfg.reward.kwargs)
    for demo, row in zip(demos["train"] + demos["val"], rows):
        assert template.messages(row["question"]) == [{"role": "user", "content": demo["prompt"]}]
        truth = row["ground_truth"]
        assert list(reward([demo["prompt"]] * 3, [demo["completion"], truth, f"#### {int(truth) + 1}"],
                           [truth] * 3)) == pytest.approx([1.0, 0.0, 0.1])


def _progress_on_rank(rank, world, overrides):
    """An SFT run with its progress bar on, stderr captured: (the bar's text, the metrics by step)."""
    import contextlib
    import io

    from megarl.config import SFTRunConfig, load_config
    from megarl.offline.sft import SFTTrainer
    from megarl.offline.trainer import run
    from megarl.trainer.metrics import read_metrics

    cfg = load_config(None, overrides, schema=SFTRunConfig)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        run(SFTTrainer, cfg)
    return err.getvalue(), read_metrics(cfg.run.run_dir / "metrics.jsonl")


def test_the_progress_bar_shows_sfts_loss_tokens_per_second_and_lr(task):
    """The bar of ``megarl sft`` is named "SFT steps" and shows the last step's loss, tokens/s and learning rate
    (it said "RL steps" with reward 0.000); ``sft/tokens_per_s`` is the step's tokens over its seconds."""
    _, overrides = _sft(task, "progress", "sft.batch_size=4", "sft.steps=2")
    text, metrics = run_world(_progress_on_rank, 1, [o for o in overrides if o != "trainer.progress=false"])[0]
    last = metrics[-1]
    assert "SFT steps" in text and "RL steps" not in text and "reward" not in text, text
    assert f"loss={last['sft/loss']:.4f}" in text and f"lr={last['actor/lr']:.2e}" in text, text
    assert f"tok/s={last['sft/tokens_per_s']:.0f}" in text, text
    for m in metrics:
        assert m["sft/tokens_per_s"] == pytest.approx(m["sft/tokens"] / m["time/step"], rel=1e-3)
