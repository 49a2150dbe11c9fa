"""The config's error type and its checks: every error names the field and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot run; the message names the field and the fix."""


def require(cond: bool, field_name: str, msg: str) -> None:
    """Raise :class:`ConfigError` ``"FIELD: MSG"`` unless ``cond`` holds."""
    if not cond:
        raise ConfigError(f"{field_name}: {msg}")


class _SectionFieldError(ConfigError):
    """A bad field of a section that several places of the config hold (``ParallelConfig`` as
    ``actor.parallel``, ``critic.parallel`` and ``placement.reference_parallel``, ``OptimConfig``, ...), named
    relative to the section; :func:`load_config` names it in full (``critic.optim.lr``)."""

    def __init__(self, field_name: str, msg: str):
        super().__init__(f"{field_name}: {msg}")
        self.field_name, self.msg = field_name, msg


def _require_in_section(cond: bool, field_name: str, msg: str) -> None:
    """:func:`require` for a field of a shared section, ``field_name`` relative to the section."""
    if not cond:
        raise _SectionFieldError(field_name, msg)
