"""The real default model: SmolLM2-135M-Instruct from its GGUF file, through the same import path as any
Hugging Face checkpoint, into a Megatron actor that greedy-answers a question."""

from __future__ import annotations

import torch

from tests.distributed import run_world


def _greedy_answer(rank, world, question, max_new_tokens):
    from megarl.models.checkpoint import load_weights, source_spec
    from megarl.models.hf_io import default_model_path, load_tokenizer
    from megarl.models.megatron import build_model
    from megarl.models.pipeline import run_microbatches
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    path = default_model_path()
    spec, dtype, _ = source_spec(path)
    tok = load_tokenizer(path)
    mesh = ParallelLayout()
    initialize_model_parallel(mesh)
    model = build_model(spec, mesh, params_dtype=dtype, init_weights=False).eval()
    load_weights(model, path)
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            x = torch.tensor([ids + out])
            res = run_microbatches(model, [{"input_ids": x}],
                                   lambda mb, o: (o.sum() * 0, {"next": o[0, -1, :spec.vocab_size].argmax()}),
                                   forward_only=True)
            nxt = int(res[0]["next"])
            if nxt in spec.eos_token_ids:
                break
            out.append(nxt)
    return spec, tok.decode(out)


def test_smollm2_gguf_megatron_actor_answers_capital_of_france():
    spec, answer = run_world(_greedy_answer, 1, "What is the capital of France?", 12)[0]
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert spec.tie_word_embeddings and spec.vocab_size == 49152
    assert "Paris" in answer, answer
