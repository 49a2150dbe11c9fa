"""``megarl dpo`` (issue 45): the sigmoid DPO loss and its gradient against float64 formulas, and a short run on a
tiny preference set whose margin rises (the tiny model of :mod:`tests.rl_tasks`, fp32, CPU)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megarl.algos.dpo import dpo_loss
from tests.distributed import run_world
from tests.rl_tasks import WORDS, make_tiny_model


def test_the_loss_and_its_gradient_equal_float64_formulas():
    """L = mean(log(1 + exp(-m))), m = beta * ((pc - rc) - (pr - rr)); dL/dpc = -beta * sigmoid(-m) / N and
    dL/dpr = +beta * sigmoid(-m) / N, written out element by element in Python floats; the reference log-probs get
    no gradient."""
    g = torch.Generator().manual_seed(0)
    n, beta = 6, 0.3
    pc, pr, rc, rr = (torch.randn(n, generator=g, dtype=torch.float64) * 5 - 20 for _ in range(4))
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        inputs = [t.to(dtype).clone().requires_grad_(True) for t in (pc, pr, rc, rr)]
        loss, metrics = dpo_loss(*inputs, beta)
        loss.backward()
        m = [beta * ((a - c) - (b - d)) for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist())]
        assert float(loss) == pytest.approx(sum(math.log1p(math.exp(-x)) for x in m) / n, rel=tol, abs=tol)
        sig = [1 / (1 + math.exp(x)) for x in m]
        assert inputs[0].grad.tolist() == pytest.approx([-beta * s / n for s in sig], rel=tol, abs=tol)
        assert inputs[1].grad.tolist() == pytest.approx([beta * s / n for s in sig], rel=tol, abs=tol)
        assert inputs[2].grad is None and inputs[3].grad is None
        assert float(metrics["margin"]) == pytest.approx(sum(m) / n, rel=tol, abs=tol)
        assert float(metrics["rewards_chosen"]) == pytest.approx(beta * float((pc - rc).mean()), rel=tol, abs=tol)
        assert float(metrics["rewards_rejected"]) == pytest.approx(beta * float((pr - rr).mean()), rel=tol, abs=tol)
        assert float(metrics["accuracy"]) == sum(x > 0 for x in m) / n


def test_bad_inputs_are_refused():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="one shape"):
        dpo_loss(x, torch.zeros(2), x, x, 0.1)
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(x, x, x, x, 0.0)


def dpo_on_rank(rank, world, overrides):
    from megarl.config import DPORunConfig, load_config
    from megarl.offline.dpo import DPOTrainer
    from megarl.offline.trainer import run
    from megarl.trainer.metrics import read_metrics

    cfg = load_config(None, overrides, schema=DPORunConfig)
    run(DPOTrainer, cfg)
    return read_metrics(cfg.run.run_dir / "metrics.jsonl") if rank == 0 else None


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    """The tiny model and 16 pairs: chosen the target word, rejected another letter, after 3 random letters."""
    root = tmp_path_factory.mktemp("dpo")
    model = make_tiny_model(root / "model")
    g = torch.Generator().manual_seed(0)
    letters = WORDS[3:14]
    rows = [{"prompt": " ".join(letters[int(i)] for i in torch.randint(0, 11, (3,), generator=g)),
             "chosen": "x", "rejected": letters[int(torch.randint(0, 11, (1,), generator=g))]} for _ in range(16)]
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, model, data, rows


def _dpo(prefs, name, *extra):
    root, model, data, _ = prefs
    return [f"model.path={model}", f"dpo.train_files=[{data}]", f"dpo.val_files=[{data}]", "dpo.max_length=64",
            "dpo.batch_size=8", "dpo.beta=0.5", "actor.optim.lr=1e-2", f"run.output_dir={root / 'runs'}",
            f"run.name={name}", "trainer.progress=false", "trainer.report=false", *extra]


def _reference_gradient_norm(model, rows, beta):
    """The DPO loss's gradient norm at the start (policy = reference) under the transformers model, float64
    loss of fp32 log-probs; each row's completion tokens (the tiny template: words, then ``<eos>``) by hand."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)

    def seq_logprob(prompt, completion):
        ids = [WORDS.index(w) for w in prompt.split()] + [WORDS.index(w) for w in completion.split() + ["<eos>"]]
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
        start = len(prompt.split())
        return sum(logp[t - 1, ids[t]] for t in range(start, len(ids))).double()

    chosen = torch.stack([seq_logprob(r["prompt"], r["chosen"]) for r in rows])
    rejected = torch.stack([seq_logprob(r["prompt"], r["rejected"]) for r in rows])
    loss, _ = dpo_loss(chosen, rejected, chosen.detach(), rejected.detach(), beta)
    loss.backward()
    return float(loss), math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in hf.parameters()))


def test_the_first_update_has_the_dpo_gradient_at_tp2(prefs):
    """Step 1 (one batch of 8 pairs, unshuffled) at TP=2: the loss is log 2 (policy = reference) and the gradient
    norm, from the two-pass update, equals that of the DPO loss differentiated through the transformers model
    (rows 0-7) within 1e-4 relative."""
    history = run_world(dpo_on_rank, 2, _dpo(prefs, "tp2", "dpo.steps=1", "dpo.shuffle=false",
                                             "actor.parallel.tp=2"))[0]
    loss, norm = _reference_gradient_norm(prefs[1], prefs[3][:8], 0.5)
    assert history[1]["dpo/loss"] == pytest.approx(loss, abs=1e-6)
    assert history[1]["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)


def test_a_short_run_raises_the_margin(prefs):
    """6 steps at DP=2 with packed micro-batches: the validation margin starts at 0 (the policy is the reference)
    and ends above it, the preference accuracy at 1, the loss below log 2."""
    history = run_world(dpo_on_rank, 2, _dpo(prefs, "dpo", "dpo.steps=6", "actor.max_tokens_per_micro_batch=24",
                                             "actor.sequence_packing=true"))[0]
    before, after = history[0], history[-1]
    assert before["val/margin"] == pytest.approx(0.0, abs=1e-6)
    assert before["val/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert history[1]["dpo/margin"] == pytest.approx(0.0, abs=1e-6)  # step 1's batch: the reference's weights
    assert after["val/margin"] > 0.5 and after["val/accuracy"] == 1.0 and after["val/loss"] < math.log(2) - 0.2
    assert (prefs[0] / "runs" / "dpo" / "dpo_reference.pt").is_file()


def test_the_progress_bar_of_a_dpo_run_shows_its_loss_preference_accuracy_and_lr(tmp_path, capsys):
    """The bar that ``fit`` opens for a DPO trainer (its ``section``) is named "DPO steps" and shows the step's loss,
    preference accuracy and learning rate, not a reward."""
    from megarl.offline.dpo import DPOTrainer
    from megarl.trainer.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path / "metrics.jsonl", 2, 0, enabled=True, loggers=["console", "jsonl"],
                           kind=DPOTrainer.section)
    logger.log(1, {"dpo/loss": 0.6931, "dpo/accuracy": 0.5, "actor/lr": 1e-6, "time/step": 0.1})
    logger.close()
    err = capsys.readouterr().err
    assert "DPO steps" in err and "reward" not in err, err
    assert "loss=0.6931" in err and "pref acc=0.50" in err and "lr=1.00e-06" in err, err
