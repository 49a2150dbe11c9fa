"""On-policy distillation's teacher (``algorithm.distill.teacher``, :mod:`megarl.algos.distill`): checked before
any process starts, and built in the reference's slot (its pool and layout, ``placement.reference`` and
``placement.reference_parallel``), a frozen Megatron policy that scores the student's sampled tokens as the
reference would.

The teacher scores the student's token ids, so both must share one tokenizer: the same vocabulary (every token
at the same id) and the same special tokens; a teacher with another tokenizer is refused with the first
difference found (:func:`tokenizer_difference`). The teacher may be of another size (its own layers, widths
and heads, within the reference layout's TP and PP).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megarl.config import Config, ConfigError
from megarl.models.checkpoint import source_spec
from megarl.models.hf_io import load_tokenizer
from megarl.models.megatron import check_layout
from megarl.models.spec import ModelSpec, SpecError
from megarl.parallel.mesh import ParallelLayout
from megarl.textfiles import FileFormatError

FIELD = "algorithm.distill.teacher"
SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenizer_difference(student: Any, teacher: Any) -> str | None:
    """The first difference between two tokenizers that changes what a token id means, in words, or None.

    Compared: the vocabulary with its added tokens (``get_vocab()``: size, then the first token whose id differs,
    in the student's id order) and the special tokens (BOS, EOS, PAD, UNK).
    """
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if len(sv) != len(tv):
        return f"its vocabulary has {len(tv)} tokens, the student's {len(sv)}"
    for token, i in sorted(sv.items(), key=lambda kv: kv[1]):
        if tv.get(token) != i:
            return (f"token {token!r} is id {i} for the student but "
                    f"{'absent' if token not in tv else f'id {tv[token]}'} for the teacher")
    for name in SPECIAL:
        s, t = getattr(student, name, None), getattr(teacher, name, None)
        if s != t:
            return f"its {name} is {t!r}, the student's {s!r}"
    return None


def check_teacher(cfg: Config, student_tokenizer: Any) -> ModelSpec | None:
    """Check the teacher of ``cfg`` (None without one) against the student's tokenizer and the reference's
    layout; returns its spec.

    Raises:
        ConfigError: naming ``algorithm.distill.teacher``: a path that does not exist, a damaged weight file or
            an unknown architecture, a model without a tokenizer, another tokenizer than the student's (the reason), a
            model that the reference's TP / PP do not divide, or a context shorter than
            ``data.max_prompt_length + rollout.max_new_tokens``.
    """
    teacher = cfg.algorithm.distill.teacher
    if teacher is None:
        return None
    try:
        spec, _, tokenizer_path = source_spec(teacher)  # every weight file's frame checked (check_weight_files)
    except (FileNotFoundError, SpecError, FileFormatError) as e:
        raise ConfigError(f"{FIELD}: {e}") from None
    if tokenizer_path is None:
        raise ConfigError(f"{FIELD}: {teacher} has no tokenizer to compare with the student's (a preset); give "
                          "a model directory or checkpoint with its tokenizer")
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise ConfigError(f"{FIELD}: {teacher}'s tokenizer does not load: {e}") from None
    why = tokenizer_difference(student_tokenizer, tokenizer)
    if why is not None:
        raise ConfigError(f"{FIELD}: {teacher} has another tokenizer than the student ({why}); the teacher scores "
                          "the student's token ids, so both need one tokenizer: pick a teacher of the student's "
                          "family, or distill from a teacher's samples by SFT instead")
    p = cfg.placement.reference_parallel or cfg.actor.parallel
    for name, layout in (("tp", ParallelLayout(tp=p.tp)), ("pp", ParallelLayout(pp=p.pp)),
                         ("cp", ParallelLayout(cp=p.cp)), ("vpp", ParallelLayout(pp=p.pp, vpp=p.vpp))):
        try:
            check_layout(spec, layout)
        except SpecError as e:
            where = "placement.reference_parallel" if cfg.placement.reference_parallel else "actor.parallel"
            raise ConfigError(f"{FIELD}: the teacher runs in the reference's layout ({where}.{name}): {e}") from None
    need = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if spec.max_position_embeddings < need:
        raise ConfigError(f"{FIELD}: the teacher's context of {spec.max_position_embeddings} tokens is shorter than "
                          f"data.max_prompt_length + rollout.max_new_tokens = {need}")
    return spec


def build_teacher(cfg: Config, spec: ModelSpec, pool, dtype: torch.dtype):
    """The teacher as a frozen :class:`~megarl.workers.actor.PolicyWorker` on the reference's pool (this rank
    in it), at the rollout temperature (the student's log-probs' too), without the actor's LoRA adapters."""
    from megarl.workers.actor import PolicyWorker

    rc = dataclasses.replace(cfg.actor, lora=dataclasses.replace(cfg.actor.lora, rank=0))
    return PolicyWorker(spec, pool.mesh, "actor", cfg.algorithm.distill.teacher, dtype, rc, trainable=False,
                        temperature=cfg.rollout.temperature, pool=pool, seed=cfg.run.seed)
