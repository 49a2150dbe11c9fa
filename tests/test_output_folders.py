"""``megarl convert`` and ``megarl export`` write a new or empty folder, replace their own earlier output, and
refuse a folder holding anything else unless ``--overwrite``, which replaces only their own files: megarl never
deletes a file it did not write.

The conversion and export worlds are replaced by functions that write what the ranks write (a folder replaced
whole, as :func:`megarl.models.checkpoint.save_checkpoint` and :func:`megarl.models.hf_io.save_hf_checkpoint`
do), so these tests check the folder handling alone, in seconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import megarl.launch.convert as lc
from megarl.cli import main


def _fake_world(fn, world_size, *args):
    """What the ranks of ``convert_rank`` / ``export_rank`` leave: their output folder, replaced whole."""
    out = Path(args[1])
    shutil.rmtree(out, ignore_errors=True)
    (out / "model").mkdir(parents=True) if fn is lc.convert_rank else out.mkdir(parents=True)
    if fn is lc.convert_rank:
        (out / "megarl.json").write_text(json.dumps({"format": "megarl"}))
        (out / "model" / "shard").write_text("weights")
    else:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text(name)
    return [str(out)]


@pytest.fixture
def cli(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(lc, "run_world", _fake_world)
    monkeypatch.setattr(lc, "check_conversion", lambda *a: None)
    monkeypatch.chdir(tmp_path)

    def run(*argv):
        status = main(list(argv))
        return status, capsys.readouterr().err
    return run


def test_convert_refuses_a_folder_of_other_files_and_overwrite_keeps_them(cli, tmp_path):
    assert cli("convert", "src", "ckpt")[0] == 0
    assert cli("convert", "src", "ckpt")[0] == 0                      # its own earlier output: replaced
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    status, err = cli("convert", "src", "ckpt")
    assert status == 2 and "holds files that megarl convert did not write (notes.txt)" in err and "--overwrite" in err
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "mine"
    assert cli("convert", "src", "ckpt", "--overwrite")[0] == 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["megarl.json", "model", "notes.txt"]
    assert not list(tmp_path.glob(".ckpt*"))                          # no staging folder left


def test_export_refuses_a_full_folder_and_replaces_only_its_own_files(cli, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "megarl.json").write_text("{}")
    user = tmp_path / "hf"
    user.mkdir()
    for k in range(30):
        (user / f"file{k}.txt").write_text(str(k))
    status, err = cli("export", str(ckpt), "hf")
    assert status == 2 and "megarl export did not write (file0.txt, file1.txt" in err and "and 25 more" in err, err
    assert len(list(user.iterdir())) == 30
    assert cli("export", str(ckpt), "hf", "--overwrite")[0] == 0
    names = sorted(p.name for p in user.iterdir())
    assert len(names) == 34 and {"config.json", "model.safetensors", "megarl_export.json"} <= set(names)
    assert json.loads((user / "megarl_export.json").read_text())["files"] == \
        ["config.json", "model.safetensors", "tokenizer.json"]
    # a folder holding only an earlier export is replaced without --overwrite
    assert cli("export", str(ckpt), "fresh")[0] == 0 and cli("export", str(ckpt), "fresh")[0] == 0
    (tmp_path / "fresh" / "README.md").write_text("mine")
    assert cli("export", str(ckpt), "fresh")[0] == 2
    assert cli("export", str(ckpt), "not_a_folder")[0] == 0
    (tmp_path / "afile").write_text("x")
    status, err = cli("export", str(ckpt), "afile")
    assert status == 2 and "is a file; name a folder" in err
