"""On-policy distillation: the per-token advantage of a real step equals ``-(log p_student - log p_teacher)``
computed in float64 by the transformers models of the student and of a teacher of another size on the step's
sampled tokens; a 2-step CPU run logs the reverse KL and both models' log-probs; teachers with another tokenizer
(and other bad settings) are refused before any process starts, naming the field and the reason."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megarl.algos.distill import distill_advantages
from megarl.config import ConfigError, load_config
from tests.distributed import run_world
from tests.rl_tasks import WORDS, make_tiny_model, task_overrides, train_on_rank, write_prompts

DISTILL = ["trainer.steps=2", "trainer.save_every=0", "data.prompts_per_step=2", "rollout.n=4",
           "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "algorithm.kl.coef=0",
           "rollout.temperature=0.9"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    student = make_tiny_model(root / "student", layers=2, seed=0)
    teacher = make_tiny_model(root / "teacher", layers=3, seed=1)  # another size, the same tokenizer
    data = write_prompts(root / "prompts.jsonl", 16)
    return root, student, teacher, data


def capture_rank(rank, world, overrides):
    """Train with ``overrides``, recording each step's batch tensors after its advantages."""
    import megarl.trainer.trainer as trainer_module

    batches, compute = [], trainer_module.compute_advantages

    def spy(batch, alg, kl_ctl):
        metrics = compute(batch, alg, kl_ctl)
        batches.append({k: batch[k].clone() for k in ("input_ids", "prompt_lens", "response_lens",
                                                         "response_mask", "advantages", "old_logprobs",
                                                         "teacher_logprobs", "dropped", "logprob_nonfinite")})
        return metrics

    trainer_module.compute_advantages = spy
    return train_on_rank(rank, world, overrides), batches


def hf_logprobs(model_dir, batch, temperature: float) -> torch.Tensor:
    """``[B, R]`` float64 log-probs of each response token under the transformers model (at ``temperature``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    out = torch.zeros(batch["response_mask"].shape, dtype=torch.float64)
    for i in range(len(batch["input_ids"])):
        p, r = int(batch["prompt_lens"][i]), int(batch["response_lens"][i])
        ids = batch["input_ids"][i, :p + r][None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double() / temperature
        logp = torch.log_softmax(logits, -1)[p - 1:p + r - 1]
        out[i, :r] = logp.gather(-1, ids[0, p:p + r, None])[:, 0]
    return out


def test_the_step_advantage_is_the_float64_reverse_kl_of_the_two_models_and_the_metrics_are_logged(models):
    root, student, teacher, data = models
    overrides = task_overrides(student, data, root / "runs", "opd") + DISTILL + [f"algorithm.distill.teacher={teacher}"]
    (history, batches), = run_world(capture_rank, 1, overrides)
    assert len(history) == 2 and len(batches) == 2
    for h in history:
        for key in ("distill/reverse_kl", "distill/student_logprob_mean", "distill/teacher_logprob_mean"):
            assert math.isfinite(h[key]), (key, h)
    first = batches[0]  # step 1: the student still has its initial weights
    mask = first["response_mask"].bool() & ~first["dropped"][:, None] & ~first["logprob_nonfinite"]
    student_lp, teacher_lp = hf_logprobs(student, first, 0.9), hf_logprobs(teacher, first, 0.9)
    expected = torch.where(mask, -(student_lp - teacher_lp), 0.0)
    torch.testing.assert_close(first["advantages"].double(), expected, atol=2e-5, rtol=0)
    torch.testing.assert_close(first["teacher_logprobs"].double()[mask], teacher_lp[mask], atol=2e-5, rtol=0)
    assert (student_lp - teacher_lp)[mask].abs().max() > 0.1  # two different models: a signal that can fail
    kl = (student_lp - teacher_lp)[mask].mean().item()
    assert history[0]["distill/reverse_kl"] == pytest.approx(kl, abs=2e-5)
    assert history[0]["distill/teacher_logprob_mean"] == pytest.approx(teacher_lp[mask].mean().item(), abs=2e-5)
    assert history[0]["distill/student_logprob_mean"] == pytest.approx(student_lp[mask].mean().item(), abs=2e-5)


def test_distill_advantages_match_a_float64_formula_with_a_task_reward_and_a_mask():
    g = torch.Generator().manual_seed(0)
    s, t = -3 * torch.rand(4, 6, generator=g), -3 * torch.rand(4, 6, generator=g)
    task = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    adv, metrics = distill_advantages(s, t, mask, task, coef=0.7, reward_coef=0.5)
    s64, t64, task64 = s.double(), t.double(), task.double()
    want = torch.where(mask, -0.7 * (s64 - t64), 0.0) + 0.5 * task64
    torch.testing.assert_close(adv.double(), want, atol=1e-6, rtol=0)
    assert metrics["distill/reverse_kl"] == pytest.approx((s64 - t64)[mask].mean().item(), abs=1e-6)
    alone, _ = distill_advantages(s, t, mask, task, coef=1.0, reward_coef=0.0)
    torch.testing.assert_close(alone.double(), torch.where(mask, t64 - s64, 0.0), atol=1e-6, rtol=0)


def _other_tokenizer(path, swap=("a", "b")):
    """Rewrite the tokenizer of a tiny model with two words' ids swapped."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(WORDS)
    i, j = words.index(swap[0]), words.index(swap[1])
    words[i], words[j] = words[j], words[i]
    tok = Tokenizer(models.WordLevel({w: k for k, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(str(path))


@pytest.fixture(scope="module")
def other_teacher(models):
    root = models[0]
    teacher = make_tiny_model(root / "other", layers=3, seed=2)
    _other_tokenizer(teacher)
    return teacher


@pytest.mark.parametrize("extra,starts", [
    (["algorithm.distill.teacher=OTHER"], "megarl: error: algorithm.distill.teacher: "),
    (["algorithm.distill.teacher=NOWHERE"], "megarl: error: algorithm.distill.teacher: "),
    (["algorithm.distill.teacher=TEACHER", "algorithm.kl.coef=0.01"], "megarl: error: algorithm.kl.coef: must be 0"),
    (["algorithm.distill.teacher=TEACHER", "algorithm.distill.coef=0"], "megarl: error: algorithm.distill.coef:"),
    (["algorithm.distill.teacher=TEACHER", "algorithm.dynamic_sampling.enabled=true"],
     "megarl: error: algorithm.dynamic_sampling.enabled:"),
])
def test_bad_teachers_are_one_error_line_before_any_process(models, other_teacher, extra, starts, monkeypatch,
                                                             capsys, tmp_path):
    import megarl.parallel.launch
    import megarl.trainer.trainer
    from megarl.cli import main

    def started(*a, **k):
        raise AssertionError("a process started")

    monkeypatch.setattr(megarl.parallel.launch, "run_world", started)
    monkeypatch.setattr(megarl.trainer.trainer, "train", started)
    monkeypatch.chdir(tmp_path)
    root, student, teacher, data = models
    paths = {"OTHER": str(other_teacher), "NOWHERE": str(root / "nowhere"), "TEACHER": str(teacher)}
    extra = [e.split("=")[0] + "=" + paths.get(e.split("=")[1], e.split("=")[1]) for e in extra]
    status = main(["train", *task_overrides(student, data, root / "runs", "bad"), *DISTILL, *extra])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(starts), lines[0]
    if extra[0].endswith(str(other_teacher)):
        assert "another tokenizer" in lines[0] and "token 'a' is id 3 for the student but id 4" in lines[0], lines[0]


def test_the_tokenizer_check_names_the_first_difference(models, other_teacher):
    from megarl.models.hf_io import load_tokenizer
    from megarl.workers.teacher import check_teacher, tokenizer_difference

    root, student, teacher, data = models
    tok = load_tokenizer(str(student))
    assert tokenizer_difference(tok, load_tokenizer(str(teacher))) is None
    cfg = load_config(None, task_overrides(student, data, root / "runs", "t") + DISTILL
                      + [f"algorithm.distill.teacher={teacher}"])
    assert check_teacher(cfg, tok).num_layers == 3
    cfg.algorithm.distill.teacher = str(other_teacher)
    with pytest.raises(ConfigError, match="another tokenizer than the student"):
        check_teacher(cfg, tok)
    assert json.loads((student / "config.json").read_text())["num_hidden_layers"] == 2


def test_the_memory_estimate_counts_the_teacher_at_its_own_size(models):
    from megarl.launch.memory import estimate_memory, stage_params
    from megarl.models.checkpoint import source_spec

    root, student, teacher, data = models
    base = task_overrides(student, data, root / "runs", "m") + DISTILL
    spec = source_spec(str(student))[0]
    est = estimate_memory(load_config(None, base + [f"algorithm.distill.teacher={teacher}"]), spec, 1, gpu=False)
    teacher_params = stage_params(source_spec(str(teacher))[0], 1, 1)
    assert teacher_params > stage_params(spec, 1, 1)  # 3 layers against 2
    assert est.reference == teacher_params * 4  # fp32
    assert estimate_memory(load_config(None, base), spec, 1, gpu=False).reference == 0
