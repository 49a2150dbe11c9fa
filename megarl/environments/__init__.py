"""Environments and tasks from other libraries, trained as they are: one module per library, each registering
itself in megarl's registries (data preparation, reward functions, environments) under the library's name, so a
config names the library's own identifiers.

- :mod:`.reasoning_gym`: reasoning-gym's procedural tasks as data (``data.prepare=reasoning_gym``) scored by each
  task's own ``score_answer`` (``reward.fn=reasoning_gym``).
- :mod:`.verifiers`: a verifiers environment (``vf.load_environment``) as a multi-turn environment: its dataset,
  system prompt, parser, rubric, ``env_response`` / ``is_completed`` loop and tools.
- :mod:`.textarena`: textarena games, the model playing one side against a fixed or scripted opponent.
- :mod:`.openenv`: a client of OpenEnv's HTTP environment servers (``/reset``, ``/step``).

The libraries are imported only when a config names them; a missing one is one error naming the package and
how to install it (:func:`import_package`).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def import_package(module: str, package: str, field: str, error: type[Exception]) -> ModuleType:
    """``import module``, or ``error`` saying which config ``field`` needs the PyPI ``package`` and how to
    install it (``./build.sh`` installs every one; ``package`` is pinned, ``"verifiers==0.4.0"``).

    Raises:
        error: the module does not import (its own message appended).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise error(f"{field}: needs the Python package {package.split('==')[0]!r}, which does not import here "
                    f"({e}); install it with `pip install {package}` (./build.sh installs it)") from None
