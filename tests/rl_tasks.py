"""A tiny model and synthetic tasks for trainer tests: answer every prompt with one target word; and, over two
turns, say back the secret word that the environment told (:class:`SecretWord`).

The model is a randomly initialised 2-layer Llama (or a mixture of experts: :func:`make_tiny_moe_model`) with
a 16-word vocabulary (a word-level tokenizer saved beside it, with a chat template: :data:`CHAT_TEMPLATE`), so a
random policy says the target first with probability ~1/16: enough signal for GRPO/PPO to learn the task within
a few steps on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ["<pad>", "<eos>", "<unk>", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "x", "y"]
TARGET = "x"
# The word-level tokenizer's chat template: every message's words then a space, an assistant turn closed by
# <eos> (what the model samples last), so the history renders append-only (decode joins words with spaces).
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% if m['content'] %}{{ m['content'] }} "
                 "{% endif %}<eos> {% else %}{{ m['content'] }} {% endif %}{% endfor %}")
SECRETS = ["h", "i"]  # SecretWord's secrets


def make_tiny_model(path: Path, *, layers: int = 2, seed: int = 0, tied: bool = True,
                    embedding_scale: float = 1.0) -> Path:
    """Write a random Llama (hidden 64, 4 heads, 2 KV heads) and its word-level tokenizer as an HF directory.

    ``embedding_scale`` multiplies the (tied) embeddings: at transformers' init (std 0.02) the logits of a frozen
    output layer stay within about +-1.3 whatever the hidden state (RMSNorm bounds it), too flat for a LoRA actor
    (whose embeddings and norms do not train) to make one word likely; 3 gives a base that LoRA can sharpen (tests/test_lora_trainer.py)."""
    from megarl.models.spec import ModelSpec

    spec = ModelSpec("llama", vocab_size=len(WORDS), hidden_size=64, num_layers=layers, num_attention_heads=4,
                     num_kv_heads=2, head_dim=16, ffn_hidden_size=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=tied, max_position_embeddings=64, bos_token_id=None,
                     eos_token_ids=(WORDS.index("<eos>"),), pad_token_id=WORDS.index("<pad>"))
    return save_random_model(path, spec, seed, embedding_scale)


def make_tiny_moe_model(path: Path, *, family: str = "qwen3_moe", layers: int = 2, seed: int = 0) -> Path:
    """Write a random mixture-of-experts model of ``family`` (hidden 64, 4 heads, 2 KV heads, 8 experts of width
    32, top-2; Qwen2-MoE with a shared expert of width 48) and the word-level tokenizer as an HF directory."""
    from megarl.models.spec import ModelSpec

    spec = ModelSpec(family, vocab_size=len(WORDS), hidden_size=64, num_layers=layers, num_attention_heads=4,
                     num_kv_heads=2, head_dim=16, ffn_hidden_size=128, rope_theta=10000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, max_position_embeddings=64, bos_token_id=None,
                     eos_token_ids=(WORDS.index("<eos>"),), pad_token_id=WORDS.index("<pad>"), num_experts=8,
                     moe_top_k=2, moe_ffn_hidden_size=32, moe_aux_loss_coef=0.001,
                     shared_expert_ffn_hidden_size=48 if family == "qwen2_moe" else 0)
    return save_random_model(path, spec, seed)


def save_random_model(path: Path, spec, seed: int, embedding_scale: float = 1.0) -> Path:
    """A random transformers model of ``spec`` in its checkpoint form (experts one tensor each, buffers that are
    checkpoint tensors such as DeepSeek-V3's ``e_score_correction_bias`` included), with the word-level
    tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from megarl.models.hf_io import save_hf_checkpoint
    from megarl.models.weights import transformers_canonical

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(spec.to_hf_config(), dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embedding_scale)
    saved = spec.hf_tensor_shapes()
    tensors = {**{n: b for n, b in model.named_buffers() if n in saved}, **dict(model.named_parameters())}
    save_hf_checkpoint(path, spec, transformers_canonical(spec, tensors))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(str(path))
    return path


def write_prompts(path: Path, n: int = 32, *, field: str = "question", seed: int = 1) -> Path:
    """``n`` prompts of 3 to 5 random letters, each with the target as its ground truth, as jsonl (another
    ``seed``: other prompts, e.g. held-out ones)."""
    g = torch.Generator().manual_seed(seed)
    letters = WORDS[3:14]
    with path.open("w") as f:
        for _ in range(n):
            k = int(torch.randint(3, 6, (1,), generator=g))
            words = [letters[int(i)] for i in torch.randint(0, len(letters), (k,), generator=g)]
            f.write(json.dumps({field: " ".join(words), "ground_truth": TARGET}) + "\n")
    return path


def update_batch(n: int, vocab: int, *, response_len: int = 5, old_logprob: float = -4.0, seed: int = 0):
    """A batch for one actor update without a rollout: ``n`` rows of the prompt ``[1, 2, 3]`` and a random
    response of ``response_len`` tokens in ``[4, vocab)``, old log-probs ``old_logprob`` and N(0, 1) advantages
    (one generator seeded ``seed`` draws the responses, then the advantages)."""
    from megarl.data.batch import build_batch

    g = torch.Generator().manual_seed(seed)
    responses = [torch.randint(4, vocab, (response_len,), generator=g).tolist() for _ in range(n)]
    batch = build_batch([[1, 2, 3]] * n, responses, [torch.zeros(response_len)] * n, list(range(n)), pad_token_id=0)
    batch["old_logprobs"] = torch.full(batch["response_mask"].shape, old_logprob)
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g)
    return batch


def says_target(prompts, responses, ground_truths):
    """1.0 when the response's first word is the ground truth, else 0.0 (the task's reward)."""
    return [float(r.split()[:1] == [t]) for r, t in zip(responses, ground_truths)]


def task_overrides(model_dir: Path, data_file: Path, run_dir: Path, name: str) -> list[str]:
    """Config overrides that point the trainer at the tiny model and the synthetic task (without validation,
    whose GSM8K default the task has no use for, and without the end-of-run report: tests turn them on)."""
    return [f"model.path={model_dir}", f"data.train_files=[{data_file}]", "data.prepare=null",
            "data.use_chat_template=false", "data.instruction=''", "data.max_prompt_length=16",
            "reward.fn=tests.rl_tasks:says_target", f"run.output_dir={run_dir}",
            f"run.name={name}", "rollout.max_new_tokens=3", "trainer.progress=false", "validation.enabled=false",
            "trainer.report=false"]


def train_on_rank(rank, world, overrides):
    """Train with the default config and ``overrides`` on this rank of a :func:`tests.distributed.run_world`
    world; returns the run's metrics by step on rank 0 (``metrics.jsonl``), the run's summary elsewhere."""
    from megarl.config import load_config
    from megarl.trainer.metrics import read_metrics
    from megarl.trainer.trainer import train

    cfg = load_config(None, overrides)
    summary = train(cfg)
    return read_metrics(cfg.run.run_dir / "metrics.jsonl") if rank == 0 else summary


def train_each_on_rank(rank, world, runs):
    """Train each of ``runs`` (lists of overrides of the default config) in turn on this rank of a
    :func:`tests.distributed.run_world` world, in this one process (one start-up for all); returns each run's
    ``(metrics by step (rank 0; None elsewhere), {name: this rank's actor weight after the run})``."""
    from megarl.config import load_config
    from megarl.trainer.builders import seed_all
    from megarl.trainer.loop import fit
    from megarl.trainer.metrics import read_metrics
    from megarl.trainer.trainer import Trainer

    out = []
    for overrides in runs:
        cfg = load_config(None, overrides)
        seed_all(cfg.run.seed)
        trainer = Trainer(cfg)
        fit(trainer)
        out.append((read_metrics(cfg.run.run_dir / "metrics.jsonl") if rank == 0 else None,
                    {n: t.clone() for n, t in trainer.actor.source_tensors().items()}))
    return out


# split pools on 2 ranks: the actor, reference and reward on rank 0, the rollout on rank 1
SPLIT_2 = ["placement.pools.train=[0]", "placement.pools.gen=[1]", "placement.actor=train", "placement.reference=train",
           "placement.reward=train", "placement.rollout=gen"]


def train_until_requeued(rank, world, overrides):
    """:func:`train_on_rank` with SIGUSR1 watched as a job's rank watches it; ``"requeued"`` when the run saved
    and ended on it."""
    from megarl.parallel.restart import RequeueRequested, watch_requeue_signal

    watch_requeue_signal()
    try:
        return train_on_rank(rank, world, overrides)
    except RequeueRequested:
        return "requeued"


def digit_share(prompts, responses, ground_truths):
    """The share of a response's characters that are digits: a dense reward that differs between samples
    (for layout-comparison runs of real models, whose short GSM8K answers all score 0)."""
    return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def half_tied(prompts, responses, ground_truths):
    """A reward that ties about half of the groups (dynamic sampling tests): 0.5 for every response to a prompt
    whose first letter is in a-e; otherwise 1.0 when the response's first word is in a-g, else 0.0 (a random
    policy says one of those with probability 7/16, so such a group's rewards nearly always differ)."""
    return [0.5 if p.split()[0] in "abcde" else float(r.split()[:1] != [] and r.split()[0] in "abcdefg")
            for p, r in zip(prompts, responses)]


class SecretWord:
    """A two-turn environment whose reward needs the observation: after the first turn (whatever it says) it
    tells a secret word drawn for the episode from :data:`SECRETS`; the second turn scores 1 when its first
    word is the secret, else 0. A policy that ignores the observation scores 1/2 at best."""

    def reset(self, row, prompt):
        return prompt

    def step(self, turn):
        from megarl.agents.env import StepResult

        if turn.turn == 0:
            self.secret = self.rng.choice(SECRETS)
            return StepResult([{"role": "user", "content": self.secret}])
        return StepResult(reward=float(turn.text.split()[:1] == [self.secret]), done=True)


def multi_turn_overrides(model_dir: Path, data_file: Path, run_dir: Path, name: str) -> list[str]:
    """:func:`task_overrides` for the :class:`SecretWord` task: two turns of one token each."""
    return task_overrides(model_dir, data_file, run_dir, name) + [
        "rollout.multi_turn.enabled=true", "rollout.multi_turn.env=tests.rl_tasks:SecretWord",
        "rollout.multi_turn.max_turns=2", "rollout.max_new_tokens=1"]


async def secret_agent(row, client, prompt):
    """:class:`SecretWord` written as an agent function on an OpenAI-style client (``rollout.multi_turn.agent``):
    one call on the prompt, the secret told as a user message after the reply, a second call; reward 1 when the
    second reply's first word is the secret."""
    first = await client.chat.completions.create(model="tiny", messages=prompt)
    secret = SECRETS[int(first.id[-2:], 16) % len(SECRETS)]  # a draw per episode (the reply's id is random)
    messages = prompt + [first.choices[0].message, {"role": "user", "content": secret}]
    second = await client.chat.completions.create(model="tiny", messages=messages)
    return float((second.choices[0].message.content or "").split()[:1] == [secret])


def agent_overrides(model_dir: Path, data_file: Path, run_dir: Path, name: str) -> list[str]:
    """:func:`task_overrides` for :func:`secret_agent`: two calls of one token each."""
    return task_overrides(model_dir, data_file, run_dir, name) + [
        "rollout.multi_turn.enabled=true", "rollout.multi_turn.agent=tests.rl_tasks:secret_agent",
        "rollout.multi_turn.max_turns=2", "rollout.max_new_tokens=1"]


class WordCallParser:
    """A tool-call parser for the word-level model (trainer tests of failing tools): the word ``x`` calls the
    tool ``explode``, ``y`` calls ``hang``, ``j`` calls a tool that does not exist, ``k`` is a malformed call."""

    name = "words"
    template_tools = False

    def parse(self, text, tools):
        from megarl.agents.tools import ToolCall

        names = {"x": "explode", "y": "hang", "j": "no_such_tool"}
        words = text.split()
        return [ToolCall(names[w], {}, w) for w in words if w in names], [w for w in words if w == "k"]

    def format_call(self, call):
        return {"explode": "x", "hang": "y"}.get(call.name, "j")

    def system_text(self, tools):
        return ""


def explode() -> str:
    """A tool that always raises."""
    raise RuntimeError("boom")


def hang() -> str:
    """A tool that never answers in time (its daemon thread sleeps on)."""
    import time

    time.sleep(3600)
    return "late"
