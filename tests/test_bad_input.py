"""Bad configs and command lines end in one ``megarl: error:`` line that names the field or flag, before any
process or model starts and before anything is written.

Every case runs ``megarl.cli.main`` in this process with the world launchers (``run_world``, torchrun) and the
trainer replaced by functions that fail the test if called, and a working folder that must stay empty.
Model-dependent checks use the 2-layer, 4-head, 2-KV-head tiny Llama of :mod:`tests.rl_tasks` (context 64).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megarl.cli import main
from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = make_tiny_model(root / "model")
    data = write_prompts(root / "prompts.jsonl", 8)
    # a Qwen2 config with sliding-window attention on some layers (megarl runs none of them)
    windowed = root / "windowed"
    windowed.mkdir()
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=8,
               max_window_layers=1)
    (windowed / "config.json").write_text(json.dumps(cfg))
    longrope = root / "longrope"  # a Phi-3.5-style config: LongRoPE's short and long factors (megarl has no LongRoPE)
    longrope.mkdir()
    half = cfg["hidden_size"] // cfg["num_attention_heads"] // 2
    cfg = {k: v for k, v in cfg.items() if k not in ("use_sliding_window", "max_window_layers", "rope_parameters")}
    cfg.update(model_type="phi3", architectures=["Phi3ForCausalLM"], sliding_window=None,
               rope_scaling={"type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half},
               original_max_position_embeddings=64)
    (longrope / "config.json").write_text(json.dumps(cfg))
    notoken = root / "notoken"  # the weights and config alone, no tokenizer files
    notoken.mkdir()
    for name in ("config.json", "model.safetensors"):
        (notoken / name).write_bytes((model / name).read_bytes())
    for name, text in {**YAML_FILES, **DATA_FILES}.items():
        (root / name).write_text(text)
    for name, blob in BYTE_FILES.items():
        (root / name).write_bytes(blob)
    for name in TORN_JSON:  # a model folder with one JSON file cut short (the index: one the tiny model lacks)
        shutil.copytree(model, root / f"torn-{name}")
        (root / f"torn-{name}" / name).write_text(TORN_TEXT)
    (root / "torn-ckpt").mkdir()  # a checkpoint whose megarl.json is cut short
    (root / "torn-ckpt" / "megarl.json").write_text(TORN_TEXT)
    for name, keep in CUT_SAFETENSORS.items():  # a model folder whose model.safetensors is cut short
        shutil.copytree(model, root / name)
        with open(root / name / "model.safetensors", "r+b") as f:
            f.truncate(keep if keep > 0 else f.seek(0, 2) + keep)
    _write_gguf(root / "whole.gguf")
    blob = (root / "whole.gguf").read_bytes()
    (root / "cut.gguf").write_bytes(blob[:len(blob) - 100])
    (root / "header.gguf").write_bytes(blob[:40])
    (root / "text.gguf").write_text("not a gguf file\n")
    return model, data, windowed


def _write_gguf(path: Path) -> None:
    """A GGUF file of two float32 tensors (16x64, then 64x64: 16 KiB at its end), written by the gguf library."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((16, 64), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.ones((64, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _started(*_, **__):
    raise AssertionError("a process, world or model was started for a bad input")


@pytest.fixture
def run_cli(monkeypatch, tmp_path, capsys):
    """``main(argv)`` in an empty working folder with every launcher replaced; returns (status, stderr)."""
    import torch.distributed.run

    import megarl.launch.convert
    import megarl.parallel.launch
    import megarl.trainer.trainer

    monkeypatch.setattr(megarl.parallel.launch, "run_world", _started)
    monkeypatch.setattr(megarl.launch.convert, "run_world", _started)
    monkeypatch.setattr(torch.distributed.run, "main", _started)
    monkeypatch.setattr(megarl.trainer.trainer, "train", _started)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)

    def run(argv):
        status = main(argv)
        err = capsys.readouterr().err
        assert list(work.iterdir()) == [], "a bad input wrote files"
        return status, err
    return run


def _tiny_train(tiny, *extra):
    model, data, _ = tiny
    return ["train", *task_overrides(model, data, "runs", "bad"), *extra]


YAML_FILES = {"syntax.yaml": "actor: [1, 2\n", "list.yaml": "- 1\n- 2\n", "section.yaml": "actor:\n  parallel: 3\n",
              "scalar_list.yaml": "data:\n  train_files: data/gsm8k/train.parquet\n"}

# data whose content fails (TINY prompts are plain text: data.use_chat_template=false, no instruction)
DATA_FILES = {"null_prompt.jsonl": '{"question": "a b", "ground_truth": "x"}\n{"question": null}\n',
              "no_answer.jsonl": '{"question": "a b", "ground_truth": "x"}\n{"question": "c d"}\n',
              "no_tokens.jsonl": '{"question": [{"role": "user", "content": ""}], "ground_truth": "x"}\n'}

# files that are not what their name says: not UTF-8 (a Latin-1 e-acute, a 0xff), a text file named .parquet
BYTE_FILES = {"latin1.yaml": b"trainer:\n  steps: 3\n# caf\xe9\n",
              "latin1.jsonl": b'{"question": "a b", "ground_truth": "x"}\n{"question": "c \xff d", "ground_truth": "x"}\n',
              "train.parquet": b"question,ground_truth\na b,x\n"}
TORN_JSON = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json")
TORN_TEXT = '{\n  "vocab_size": 16,\n  "hidden_size": '  # cut short: a value expected at line 3, column 18
CUT_SAFETENSORS = {"cut-st": -1000, "header-st": 100}  # bytes kept (negative: from the end)
CUT_ST = ("DATA:cut-st/model.safetensors: not a readable safetensors file: truncated: expected ", " bytes (its "
          "header places tensors up to there), found ")
HEADER_ST = ("DATA:header-st/model.safetensors: not a readable safetensors file: its header is unreadable (100 "
             "bytes, the header length says ")

# (argv, what the one error line must name); "TINY" marks a train command on the tiny model, "YAML:" a file
CASES = [
    # config values (dataclass validation and OmegaConf types)
    (["train", "algorithm.name=ppo2"], "algorithm.name"),
    (["train", "actor.optim.lr=fast"], "actor.optim.lr"),
    (["train", "actor.optimizer.lr=1"], "actor.optimizer"),
    (["train", "rollout.top_p=1.5"], "rollout.top_p"),
    (["train", "rollout.temperature=0"], "rollout.temperature"),
    (["train", "rollout.gpu_memory_utilization=1.5"], "rollout.gpu_memory_utilization"),
    (["train", "model.dtype=fp8"], "model.dtype"),
    (["train", "algorithm.kl.estimator=k4"], "algorithm.kl.estimator"),
    (["train", "algorithm.kl.estimator=k1"], "algorithm.kl.estimator: 'k1' in the loss"),
    (["train", "rollout.top_p=0.8"], "rollout.top_p: 0.8 < 1"),
    (["train", "rollout.top_k=50"], "rollout.top_k: 50 truncates"),
    (["train", "algorithm.policy_loss=no_such_loss"], "algorithm.policy_loss"),  # gspo is one now
    (["train", "trainer.steps=0"], "trainer.steps"),
    (["train", "trainer.keep_checkpoints=0"], "trainer.keep_checkpoints: 0 must be >= 1"),
    (["train", "reshard.bucket_mb=0.00001"], "reshard.bucket_mb"),
    (["train", "reshard.direct_min_kb=0"], "reshard.direct_min_kb: must be > 0 KiB, or null"),
    (["train", "data.train_files=[]"], "data.train_files"),
    (["train", "no_such_config.yaml"], "no_such_config.yaml does not exist"),
    (["train", "YAML:syntax.yaml"], "syntax.yaml: not valid YAML"),
    (["train", "YAML:list.yaml"], "list.yaml: a config file maps sections"),
    (["train", "YAML:section.yaml"], "actor.parallel: is a section"),
    (["train", "YAML:scalar_list.yaml"], "data.train_files: must be a list, e.g. [data/gsm8k/train.parquet]"),
    (["train", "data.train_files=foo.parquet"], "data.train_files: must be a list, e.g. [foo.parquet]"),
    (["train", "trainer.steps"], "trainer.steps: an override needs a value, e.g. trainer.steps=..."),
    (["train", "trainer.steps=1", "parallel_configs/cpu_smollm2_ppo.yaml"], "the config file must come first"),
    (["train", "algorithm.kl=2"], "algorithm.kl: is a section"),
    (["train", "actor.optim.lr=[1,"], "actor.optim.lr: the value '[1,' is not valid YAML"),
    # what the world size determines
    (["train", "actor.ppo_mini_batch_size=6"], "actor.ppo_mini_batch_size"),
    (["train", "algorithm.name=grpo", "rollout.n=1", "actor.ppo_mini_batch_size=4"], "rollout.n"),
    (["train", "algorithm.name=ppo", "critic.parallel.pp=2"], "critic.parallel"),
    (["train", "placement.pools.three=[0,1,2]", "placement.actor=three", "actor.parallel.tp=2"],
     "actor.parallel: actor layout tp=2 x pp=1 does not divide its pool: pool 'three' (placement.actor) has 3"),
    # what the model's config determines (checked in the launching process, before torchrun)
    (["TINY", "actor.parallel.pp=4"], "actor.parallel.pp: pp=4 does not divide num_layers=2"),
    (["TINY", "actor.parallel.tp=3", "actor.ppo_mini_batch_size=12", "actor.micro_batch_size=4",
      "data.prompts_per_step=3"], "actor.parallel.tp: tp=3 does not divide num_attention_heads=4"),
    (["TINY", "rollout.engine=vllm", "rollout.tp=3", "actor.parallel.dp=3", "data.prompts_per_step=3",
      "actor.ppo_mini_batch_size=12", "actor.micro_batch_size=4"], "rollout.tp: vLLM tp=3"),
    (["TINY", "rollout.max_model_len=128"], "rollout.max_model_len: 128 exceeds"),
    (["TINY", "actor.kernels.attention=flash"], "actor.kernels.attention: must be one of ('sdpa', 'local')"),
    # a field of a section that several roles hold, by its full path
    (["TINY", "actor.optim.lr=-1"], "actor.optim.lr: must be > 0"),
    (["TINY", "critic.optim.lr=-1"], "critic.optim.lr: must be > 0"),
    (["TINY", "critic.micro_batch_size=0"], "critic.micro_batch_size: must be >= 1"),
    (["TINY", "placement.reference_parallel.tp=0"], "placement.reference_parallel.tp: must be >= 1"),
    (["TINY", "rollout.max_new_tokens=60"], "rollout.max_new_tokens"),
    (["train", "model.path=no/such/model"], "model.path: model path"),
    (["train", "model.path=runs/no-such-sft/checkpoints/step_000008"],
     "model.path: model path 'runs/no-such-sft/checkpoints/step_000008' does not exist (expected a Hugging Face "
     "directory with config.json and *.safetensors, a .gguf file, or a megarl checkpoint); it is a checkpoint of the "
     "run runs/no-such-sft, which has not written it: run that first, or give model.path=..."),
    # the data, the reward function and this machine
    (["TINY", "data.train_files=[no/such.jsonl]"], "data.train_files: ['"),
    (["TINY", "validation.enabled=true"], "validation.files: ['data/arithmetic/test.parquet'] do not exist"),
    (["eval", "no/such/model"], "no/such/model"),
    (["eval", "TINYMODEL", "validation.files=[no/such.jsonl]", "data.prepare=null"],
     "validation.files: ['no/such.jsonl'] do not exist; create them or set data.prepare to one of"),
    (["report", "no/such/run"], "no/such/run/metrics.jsonl is missing"),
    (["TINY", "reward.fn=no_such_reward"], "reward.fn: unknown reward function 'no_such_reward'"),
    (["TINY", "reward.fn=tests.rl_tasks:no_such_fn"], "reward.fn: reward function 'tests.rl_tasks:no_such_fn'"),
    (["TINY", "reward.fn=gsm8k", "reward.kwargs.bogus=1"], "reward.kwargs: reward function 'gsm8k' does not accept"),
    (["TINY", "reward.fn=gsm8k", "reward.kwargs.format_score=high"],
     "reward.kwargs: format_score='high' is a str, but reward 'gsm8k' takes a float there"),
    (["TINY", "reward.fn=http", "reward.kwargs.urll=http://rm:8000/pooling"],
     "reward.kwargs: reward function 'http' does not accept parameters ['urll']"),
    (["TINY", "reward.fn=gsm8k"], "reward.fn: 'gsm8k' failed on the first rows of data.train_files (RewardError: "
                                  "GSM8K ground truth 'x' has no number"),
    # what the ranks refused seconds later, refused by the launching process and by --check too (issue 33, item 10)
    (["TINY", "data.prompts_per_step=16"],
     "data.prompts_per_step: data.train_files DATA:prompts.jsonl holds 8 training prompts that fit "
     "data.max_prompt_length=16, fewer than one step's batch of 16"),
    (["TINY", "data.prompts_per_step=16", "--check"], "data.prompts_per_step: data.train_files"),
    (["TINY", "data.prompts_per_step=6", "validation.enabled=true", "validation.files=[DATA:prompts.jsonl]",
      "validation.num_prompts=4", "actor.ppo_mini_batch_size=48", "--check"],
     "holds 4 training prompts (4 of its 8 are validation prompts, held out)"),
    (["TINY", "validation.enabled=true", "validation.files=[DATA:prompts.jsonl]", "validation.num_prompts=8",
      "--check"], "holds 0 training prompts (8 of its 8 are validation prompts, held out) that fit "
                  "data.max_prompt_length=16, fewer than one step's batch of 4; give validation.files of other "
                  "prompts, or validation.enabled=false"),
    (["TINY", "actor.parallel.ep=2", "--check"], "actor.parallel.ep: 2 does not divide the actor's tp=1 x dp=1"),
    # the data's content (read in the launching process, before any rank), and paths that data.prepare never writes
    (["TINY", "data.train_files=[DATA:null_prompt.jsonl]"],
     "data.train_files: DATA:null_prompt.jsonl: row 1's field 'question' (data.prompt_key) is null"),
    (["TINY", "data.train_files=[DATA:no_answer.jsonl]"],
     "data.train_files: DATA:no_answer.jsonl: row 1 has no field 'ground_truth' (its fields: ['question']); set "
     "data.answer_key"),
    (["TINY", "data.train_files=[DATA:no_tokens.jsonl]"], "row 0's prompt in field 'question' is no tokens"),
    (["TINY", "data.prepare=gsm8k", "data.train_files=[data/gms8k/train.parquet]"],
     "data.train_files: ['data/gms8k/train.parquet'] do not exist; check the path (data.prepare=gsm8k writes only"),
    (["TINY", "data.prepare=gsm8k", "data.train_files=[mine/train.jsonl]"], "['mine/train.jsonl'] do not exist; check"),
    (["TINY", "data.prepare=gsm8k", "validation.enabled=true", "validation.files=[data/gsm8k/tset.parquet]"],
     "validation.files: ['data/gsm8k/tset.parquet'] do not exist; check the path"),
    pytest.param(["TINY", "rollout.engine=vllm"], "rollout.engine: vllm generates on a GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    (["WINDOWED"], "model.path: sliding-window attention"),
    (["TINY", "model.path=DATA:longrope"], "model.path: rope_scaling.rope_type='longrope': Phi-3's LongRoPE"),
    (["TINY", "model.path=NOTOKEN"], "model.tokenizer: no usable tokenizer in "),
    (["eval", "NOTOKEN"], "no usable tokenizer in "),
    # files that are not UTF-8, not JSON, not parquet or not GGUF: the file, the place in it and the fix
    (["train", "YAML:latin1.yaml"], "latin1.yaml: line 3 (byte offset 25) holds byte 0xe9, which is not UTF-8 text; "
                                    "save the file as UTF-8"),
    (["TINY", "data.train_files=[DATA:latin1.jsonl]"],
     "data.train_files: DATA:latin1.jsonl: line 2 (byte offset 57) holds byte 0xff, which is not UTF-8 text"),
    (["TINY", "data.train_files=[DATA:train.parquet]"], "data.train_files: DATA:train.parquet: not a parquet file"),
    *[(["TINY", f"model.path=DATA:torn-{name}"],
       f"DATA:torn-{name}/{name}: not valid JSON at line 3, column 18 (Expecting value); the file is damaged or cut "
       "short: download or copy the model again") for name in TORN_JSON],
    (["eval", "DATA:torn-ckpt"], "DATA:torn-ckpt/megarl.json: not valid JSON at line 3, column 18 (Expecting value); "
                                 "the checkpoint is damaged"),
    # a safetensors file cut short (issue 48: safetensors' own error, with a traceback naming no file)
    (["TINY", "model.path=DATA:cut-st"], CUT_ST[0]),
    (["TINY", "model.path=DATA:cut-st", "--check"], CUT_ST[1]),
    (["eval", "DATA:cut-st"], CUT_ST[0]),
    (["eval", "DATA:cut-st", "--check"], CUT_ST[0]),
    (["convert", "DATA:cut-st", "out"], CUT_ST[0]),
    (["TINY", "model.path=DATA:header-st"], HEADER_ST),
    (["convert", "DATA:header-st", "out"], HEADER_ST),
    # the same in the other model folders a run reads (issue 48: a reward model's was transformers' traceback on
    # every rank, retried by --max-restarts; the teacher's named no field)
    (["TINY", "reward.fn=reward_model", "reward.kwargs.model=DATA:cut-st"], "reward.kwargs.model: " + CUT_ST[0]),
    (["TINY", "reward.fn=reward_model", "reward.kwargs.model=DATA:header-st", "--check"],
     "reward.kwargs.model: " + HEADER_ST),
    (["eval", "TINYMODEL", "reward.fn=reward_model", "reward.kwargs.model=DATA:cut-st", "data.prepare=null",
      "validation.files=[DATA:prompts.jsonl]", "data.use_chat_template=false", "data.instruction=''"],
     "reward.kwargs.model: " + CUT_ST[0]),
    (["TINY", "algorithm.distill.teacher=DATA:cut-st", "algorithm.kl.coef=0"],
     "algorithm.distill.teacher: " + CUT_ST[0]),
    (["TINY", "model.path=DATA:text.gguf"], "DATA:text.gguf: not a GGUF file: it starts with b'not ', not the magic "
                                            "bytes b'GGUF'"),
    (["TINY", "model.path=DATA:cut.gguf"], "DATA:cut.gguf: 20604 bytes, but its tensor table places tensor "
                                           "'blk.0.attn_q.weight' up to byte 20704; the file is cut short"),
    (["TINY", "model.path=DATA:header.gguf"], "DATA:header.gguf: its GGUF header (metadata and tensor table) cannot "
                                              "be read in its 40 bytes"),
    # command-line flags
    (["bench", "reshard", "--dst-tp", "2"], "--dst-tp"),
    (["bench", "reshard", "--src-tp", "2"], "--src-tp"),
    (["bench", "reshard", "--src-pp", "4"], "--src-pp"),
    (["bench", "reshard", "--bucket-mb", "0"], "--bucket-mb"),
    (["bench", "reshard", "--bucket-mb", "0.01"], "--bucket-mb must be >= 0.0625"),
    (["bench", "reshard", "--nproc", "4"], "--nproc: 4 ranks"),
    (["bench", "reshard", "--nproc", "0"], "--nproc"),
    (["bench", "reshard", "--model", "gpt5"], "--model: unknown model preset 'gpt5'"),
    (["bench", "reshard", "--dst", "hf", "--hf-ranks", "5"], "--hf-ranks"),
    (["bench", "reshard", "--iters", "0"], "--iters"),
    (["bench", "reshard", "--layers", "-1"], "--layers"),
    (["convert", "TINYMODEL", "out", "--tp", "3"], "--tp 3: tp=3 does not divide num_attention_heads=4"),
    (["convert", "TINYMODEL", "out", "--pp", "3"], "--pp 3: pp=3 does not divide num_layers=2"),
    (["convert", "TINYMODEL", "out", "--dtype", "fp8"], "--dtype"),
    (["convert", "no/such/model", "out"], "no/such/model"),
    (["export", "no/such/ckpt", "out"], "no/such/ckpt does not exist (expected a megarl checkpoint"),
    (["data", "gsm8k", "--out", "x"], "--src"),
    (["trian"], "invalid choice: 'trian'"),
]


def _id(case) -> str:
    argv = case.values[0] if hasattr(case, "values") else case[0]
    return " ".join(argv)[:60]


@pytest.mark.parametrize("argv,names", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_is_one_error_line_naming_the_field(tiny, run_cli, argv, names):
    if argv[0] == "TINY":
        argv = _tiny_train(tiny, *argv[1:])
    elif argv[0] == "WINDOWED":
        argv = _tiny_train(tiny, f"model.path={tiny[2]}")
    argv = [str(tiny[0]) if a == "TINYMODEL" else a.replace("NOTOKEN", str(tiny[0].parent / "notoken")) for a in argv]
    argv = [str(tiny[0].parent / a[5:]) if a.startswith("YAML:") else a.replace("DATA:", f"{tiny[0].parent}/")
            for a in argv]
    names = names.replace("DATA:", f"{tiny[0].parent}/")
    status, err = run_cli(argv)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith("megarl: error:") and names in lines[0], lines[0]


def test_bucket_mb_takes_fractions():
    from megarl.cli import build_parser

    from megarl.config import load_config

    args = build_parser().parse_args(["bench", "reshard", "--bucket-mb", "0.5"])
    assert args.bucket_mb == 0.5
    assert load_config(None, ["reshard.bucket_mb=0.5"]).reshard.bucket_mb == 0.5


def test_bench_reshard_defaults_fit_their_world_and_model():
    from megarl.bench.reshard import check_layout_args
    from megarl.cli import build_parser

    args = build_parser().parse_args(["bench", "reshard"])
    check_layout_args(args, args.nproc)  # raises on a default that cannot run (it was TP=2 on 9 heads)


def test_check_reads_the_run_folder_as_a_run_would(tiny, run_cli, tmp_path, capsys):
    """``megarl train --check`` refuses a new run over an earlier run's checkpoints (as the run does, seconds
    later); a ``--resume`` with no checkpoint yet is a warning (a script's earlier command may write it)."""
    out = tmp_path / "out"
    status, err = run_cli(_tiny_train(tiny, f"run.output_dir={out}", "--check", "--resume"))
    assert status == 0 and "warning: trainer.resume: the run folder" in err and "holds no checkpoint yet" in err
    step = out / "bad" / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    (step / "megarl.json").write_text('{"format": "megarl", "step": 1}')
    status, err = run_cli(_tiny_train(tiny, f"run.output_dir={out}", "--check"))
    assert status == 2 and "run.name: the run folder" in err and "holds checkpoints of an earlier run" in err, err


def test_every_megatron_mesh_is_checked_against_the_model():
    """The reference's own layout too (placement.reference_parallel), which the world checks cannot reach
    while the trainer runs every role on the whole world."""
    from megarl.config import ConfigError, load_config
    from megarl.models.spec import PRESETS
    from megarl.trainer.preflight import validate_for_model

    cfg = load_config(None, ["placement.reference_parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"placement.reference_parallel.tp: tp=2 does not divide .*=9"):
        validate_for_model(cfg, PRESETS["smollm2-135m"])
    validate_for_model(load_config(None, ["placement.reference_parallel.tp=3"]), PRESETS["smollm2-135m"])


def test_a_job_started_by_torchrun_ends_a_config_error_in_one_line_per_rank(tmp_path):
    """Under a torchrun the user started (or srun) every rank reads the config: each ends with the same one
    error line and status 2, no traceback."""
    import os
    import subprocess
    import sys

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", "--standalone", "-m", "megarl.cli", "train",
                           "trainer.steps=0"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("megarl: error:")]
    assert set(errors) == {"megarl: error: trainer.steps: must be >= 1"}, proc.stderr[-2000:]
    assert "exitcode  : 2" in proc.stderr  # torchrun's summary of the failed ranks
    package = Path(__file__).resolve().parents[1] / "megarl"
    assert f'File "{package}/' not in proc.stderr  # no traceback through megarl's code (torchrun's may name
    # the venv, .../megarl/.venv/..., in a clone named megarl)


def test_eval_names_no_validation_switch_and_export_names_a_run_folders_checkpoint(run_cli, tmp_path):
    """``validation.enabled`` means nothing to ``megarl eval``; a run folder given to export names its
    checkpoints newest first (``step_000010``, then ``step_000002``; never the partial ``step_000011.tmp``), here
    each damaged (a ``megarl.json`` alone)."""
    status, err = run_cli(["eval", "default", "validation.files=[no/such.jsonl]", "data.prepare=null"])
    assert status == 2 and "validation.enabled" not in err, err
    run = tmp_path / "run"
    for name in ("step_000002", "step_000010", "step_000011.tmp"):
        (run / "checkpoints" / name).mkdir(parents=True)
        (run / "checkpoints" / name / "megarl.json").write_text("{}")
    status, err = run_cli(["export", str(run), "out"])
    assert status == 2 and err.strip().endswith(
        f"{run} is a run folder, not a model, and holds no sound checkpoint (step_000010 is damaged: "
        "model/metadata.json is missing; step_000002 is damaged: model/metadata.json is missing): give a model (a "
        "Hugging Face directory, a .gguf file or a megarl checkpoint)"), err


def test_a_damaged_generation_config_is_named_with_its_line_and_column(tiny, tmp_path):
    """A cut-short ``generation_config.json`` (read by the ranks, for the EOS ids): the file, the place and the
    fix, not the parser's ``Expecting value: line 3 column 18 (char 40)`` alone."""
    from megarl.models.hf_io import read_generation_config
    from megarl.textfiles import FileFormatError

    model = shutil.copytree(tiny[0], tmp_path / "model")
    (model / "generation_config.json").write_text(TORN_TEXT)
    with pytest.raises(FileFormatError) as e:
        read_generation_config(model)
    assert str(e.value) == (f"{model}/generation_config.json: not valid JSON at line 3, column 18 (Expecting value); "
                            "the file is damaged or cut short: download or copy the model again")


def test_a_damaged_model_file_is_not_retried(tiny):
    """Issue 48: ``megarl train --max-restarts 2`` of a model whose ``model.safetensors`` is cut short ends in the
    one line naming the file, status 2, and is not run again (safetensors' error was a crash, retried twice)."""
    import subprocess
    import sys

    model, data, _ = tiny
    cut = model.parent / "cut-st"
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "train",
                        *task_overrides(cut, data, model.parent / "runs", "cut"), "--max-restarts", "2"],
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "restart" not in r.stderr, r.stderr[-3000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("megarl: error:")]
    assert len(errors) == 1 and f"{cut}/model.safetensors: not a readable safetensors file: truncated" in errors[0], \
        r.stderr[-3000:]
