"""Name -> function registries: a user adds an algorithm with a decorator instead of editing the trainer.

Each kind of algorithm (advantage estimator, policy loss, KL estimator, reward function) keeps one
:class:`Registry`; its module exposes ``register_<kind>`` (the decorator) and ``get_<kind>_fn`` (the lookup)::

    from megarl.algos.advantages import register_advantage

    @register_advantage("my_estimator")
    def my_estimator(rewards, response_mask, *, values=None, group_index=None, **params):
        ...

The config then names ``"my_estimator"``; the module that defines it must have been imported first.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions (or classes) of one kind, by name.

    Args:
        kind: what the entries are, for error messages (e.g. "advantage estimator").
        decorator: the decorator's name, for error messages (e.g. "register_advantage").
    """

    def __init__(self, kind: str, decorator: str):
        self.kind = kind
        self.decorator = decorator
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator that registers its function under ``name`` and returns it unchanged.

        Registering the same function again (a module reloaded) is allowed; another function under a taken
        name is not.

        Raises:
            ValueError: ``name`` is empty or already names a different function.
        """
        if not name:
            raise ValueError(f"a {self.kind} needs a non-empty name")

        def decorate(fn: F) -> F:
            old = self._entries.get(name)
            if old is not None and _qualified(old) != _qualified(fn):
                raise ValueError(f"{self.kind} {name!r} is already registered as {_qualified(old)}; "
                                 f"pick another name for {_qualified(fn)}")
            self._entries[name] = fn
            return fn

        return decorate

    def get(self, name: str) -> F:
        """The entry registered as ``name``.

        Raises:
            ValueError: unknown name; the message lists the known names and how to register a new one.
        """
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {self.names()}. Register your own with "
                             f"@{self.decorator}({name!r}) in a module imported before the trainer "
                             "starts") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


def _qualified(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"
