"""Checkpoints outside the test suite's comfort zone, through the command line as a user runs it:

- a model whose config.json names no EOS or pad id (``eos_token_id: null``) trains, taking the tokenizer's EOS
  and saying so;
- ``megarl convert`` run from one folder with relative paths, then ``megarl train`` and ``megarl export`` from
  other folders: every path a checkpoint or run records is absolute and resolves from anywhere, and the export
  carries the tokenizer;
- the export gives back the source's config.json as it was (``eos_token_id`` null, ``dtype`` kept).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.models.spec import PRESETS
from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts

ROOT = Path(__file__).resolve().parents[1]


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    r = subprocess.run([sys.executable, "-m", "megarl.cli", *args], cwd=cwd, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    a, b, c = (root / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    model = make_tiny_model(a / "mymodel")
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(eos_token_id=None, pad_token_id=None, dtype="float32")
    (model / "config.json").write_text(json.dumps(cfg, indent=2))
    generation = {"bos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.95}  # EOS: the tokenizer's
    (model / "generation_config.json").write_text(json.dumps(generation))
    write_prompts(b / "prompts.jsonl", 8)
    return a, b, c


@pytest.mark.slow  # CI time (45 minutes): one of the 30 slowest of the default tier
def test_convert_train_export_from_other_folders_with_no_eos_in_the_config(folders):
    """Paths resolve from any folder; the source's config and generation config come back unchanged."""
    a, b, c = folders
    source_config = json.loads((a / "mymodel/config.json").read_text())
    _cli(a, "convert", "mymodel", "ckpt")  # relative paths, as typed
    meta = json.loads((a / "ckpt/megarl.json").read_text())
    assert meta["tokenizer"] == str(a / "mymodel") and meta["source"] == str(a / "mymodel")

    # train from another folder on the converted checkpoint, with relative data and run paths
    overrides = task_overrides(Path("../a/ckpt"), Path("prompts.jsonl"), Path("runs"), "noeos")
    r = _cli(b, "train", *overrides, "trainer.steps=1", "data.prompts_per_step=2", "rollout.n=2",
             "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=2")
    assert "has no eos_token_id: responses end at the tokenizer's EOS '<eos>' (id 1)" in r.stderr
    run_dir = b / "runs/noeos"
    ckpt = next((run_dir / "checkpoints").glob("step_*"))
    recorded = json.loads((ckpt / "megarl.json").read_text())
    for cfg in (recorded["config"], json.loads((run_dir / "config.json").read_text())):
        assert cfg["model"]["path"] == str(a / "ckpt")
        assert cfg["data"]["train_files"] == [str(b / "prompts.jsonl")]
        assert cfg["run"]["output_dir"] == str(b / "runs")
    assert recorded["tokenizer"] == str(a / "mymodel")

    # export the trained checkpoint from a third folder: tokenizer included, the source's config unchanged
    _cli(c, "export", str(Path("..") / "b" / ckpt.relative_to(b)), "hf")
    assert (c / "hf/tokenizer.json").is_file()
    exported = json.loads((c / "hf/config.json").read_text())
    assert exported["eos_token_id"] is None and exported["dtype"] == "float32"
    assert exported == source_config
    # and the source's generation config (EOS ids, sampling defaults), through convert, train and export
    assert recorded["generation_config"] == meta["generation_config"]
    assert json.loads((c / "hf/generation_config.json").read_text()) == json.loads(
        (a / "mymodel/generation_config.json").read_text())


def test_eos_from_both_configs_or_the_tokenizer_or_an_error_naming_the_fix():
    from types import SimpleNamespace

    from megarl.config import ConfigError
    from megarl.trainer.builders import resolve_eos

    tok = SimpleNamespace(eos_token_id=7, eos_token="</s>")
    llama3 = PRESETS["smollm2-135m"].replace(eos_token_ids=(128001,))  # config.json: <|end_of_text|> only
    generation = {"eos_token_id": [128001, 128008, 128009]}  # generation_config.json adds <|eot_id|> (128009)
    assert resolve_eos(llama3, tok, "m", generation).eos_token_ids == (128001, 128008, 128009)
    assert resolve_eos(llama3, tok, "m", {"eos_token_id": 5}).eos_token_ids == (128001, 5)
    assert resolve_eos(llama3, tok, "m", {"temperature": 0.6}).eos_token_ids == (128001,)
    spec = PRESETS["smollm2-135m"].replace(eos_token_ids=(), pad_token_id=None)
    assert resolve_eos(spec, tok, "m", generation).eos_token_ids == (128001, 128008, 128009)
    assert resolve_eos(spec, tok, "m").eos_token_ids == (7,)
    with pytest.raises(ConfigError, match="model.path: neither the config of m .*set eos_token_id"):
        resolve_eos(spec, SimpleNamespace(eos_token_id=None, eos_token=None), "m")