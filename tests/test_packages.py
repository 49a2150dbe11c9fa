"""The packages of the repository: ``kernels/`` imports as ``megarl.kernels`` beside Hugging Face's ``kernels``
package, and the README's first section is a map that names every package (issue 48, "The house")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_megarl_kernels_and_hugging_faces_kernels_import_in_one_process():
    """Run from the repository's root (the root first on ``sys.path``, where the top-level ``kernels/`` package
    used to shadow Hugging Face's): ``megarl.kernels`` is the repository's folder, ``kernels`` is Hugging Face's
    package (a dev dependency), and transformers' own probe of it imports it."""
    code = """
import json
import megarl.kernels.attention, megarl.kernels.chunked_logprobs, megarl.kernels.grouped_experts
import kernels
import transformers.integrations.hub_kernels
from transformers.utils import is_kernels_available
print(json.dumps({"megarl": megarl.kernels.attention.__file__, "hf": kernels.__file__,
                  "get_kernel": hasattr(kernels, "get_kernel"), "transformers": is_kernels_available()}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(found["megarl"]).resolve() == REPO / "kernels" / "attention.py"
    # Hugging Face's (from site-packages, which may sit inside the repository's .venv), not the repository's folder
    assert REPO / "kernels" not in Path(found["hf"]).resolve().parents, found["hf"]
    assert "site-packages" in Path(found["hf"]).resolve().parts, found["hf"]
    assert found["get_kernel"] and found["transformers"], found


def test_the_wheel_installs_the_kernels_folder_as_megarl_kernels():
    """pyproject.toml maps ``megarl.kernels`` to ``kernels/`` and installs no top-level ``kernels``; the folder
    has no ``__init__.py`` of its own (one would shadow Hugging Face's package from the repository's root)."""
    import tomllib

    tools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tools["package-dir"] == {"megarl.kernels": "kernels"}
    assert tools["packages"]["find"]["include"] == ["megarl*"]
    assert not (REPO / "kernels" / "__init__.py").exists()
    assert (REPO / "megarl" / "kernels" / "__init__.py").is_file()


def test_the_readme_opens_with_a_map_that_names_every_package():
    """The README's first section is the map of the code: it names every package under ``megarl/`` (and the
    ``kernels/`` folder) and one RL step's path; the design document it links lives in the repository."""
    readme = (REPO / "README.md").read_text()
    sections = re.findall(r"^## (.+)$", readme, re.M)
    assert sections[0] == "Layout of the code", sections[:3]
    body = readme.split("## Layout of the code\n", 1)[1].split("\n## ", 1)[0]
    packages = sorted(p.parent.name for p in (REPO / "megarl").glob("*/__init__.py"))
    assert "kernels" in packages and "config" in packages
    missing = [name for name in packages if f"`megarl/{name}/`" not in body]
    assert missing == [], f"the README's map does not name {missing}"
    assert "`kernels/`" in body and "One RL step" in body
    assert "(docs/DESIGN.md)" in readme and (REPO / "docs" / "DESIGN.md").is_file()
