"""The real default model: SmolLM2-135M-Instruct from its GGUF file, through the same import path as any
Hugging Face checkpoint, into a Megatron actor that greedy-answers a question."""

from __future__ import annotations

import pytest
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


@pytest.mark.slow  # CI time (45 minutes): one of the 30 slowest of the default tier
def test_smollm2_gguf_megatron_actor_answers_capital_of_france():
    spec, answer = run_world(_greedy_answer, 1, "What is the capital of France?", 12)[0]
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert spec.tie_word_embeddings and spec.vocab_size == 49152
    assert "Paris" in answer, answer


@pytest.mark.slow  # CI time (45 minutes): one of the 30 slowest of the default tier
def test_a_gguf_files_config_and_tokenizer_are_read_once_then_from_the_cache(tmp_path, monkeypatch):
    """The first read of a GGUF file's config and tokenizer fills ``$MEGARL_CACHE``; later reads come from it
    and never open the file (here overwritten with zeros of the same size and modification time, which a real
    read would reject), with the same config and the same token ids, specials and chat template; a file
    modified since gets another cache folder."""
    import os
    import shutil

    from megarl.models.hf_io import default_model_path, gguf_cache_dir, load_tokenizer, read_hf_config

    monkeypatch.setenv("MEGARL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    shutil.copy(default_model_path(), path)
    config, tok = read_hf_config(path), load_tokenizer(path)
    assert config["num_hidden_layers"] == 30 and "quantization_config" not in config
    folder = gguf_cache_dir(path)
    assert (folder / "config" / "config.json").is_file() and (folder / "tokenizer" / "tokenizer_config.json").is_file()

    stat = path.stat()
    path.write_bytes(bytes(stat.st_size))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert gguf_cache_dir(path) == folder
    cached_config, cached_tok = read_hf_config(path), load_tokenizer(path)
    assert cached_config == config
    texts = ["Natalia sold clips to 48 of her friends in April. #### 72", "ça va? 12345 <|im_end|>", "\n\n  x"]
    for text in texts:
        assert cached_tok(text)["input_ids"] == tok(text)["input_ids"]
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    assert cached_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (cached_tok.eos_token_id, cached_tok.bos_token_id, cached_tok.pad_token_id, len(cached_tok)) == \
        (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, len(tok))

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert gguf_cache_dir(path) != folder  # a changed file is read again
