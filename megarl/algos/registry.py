"""Name -> algorithm registries: the config's allowed names and each algorithm's config parameters.

Each kind of algorithm (advantage estimator, policy loss, KL estimator; reward functions use the same class)
keeps one :class:`Registry`. An :class:`Entry` names the function, the config fields it takes and what it
needs, so the config validates names against the registry and the trainer calls whatever the config names
with its parameters, without a branch per algorithm::

    estimator = ADVANTAGES.bind(cfg.algorithm.name, cfg.algorithm)       # fn with gamma=..., lam=... set
    advantages, returns = estimator(token_rewards, mask, values=..., group_index=...)

This module imports neither torch nor anything of megarl, so it sits at the bottom of the import order (with
``config``) and :mod:`megarl.config` asks it for the allowed names: the built-in algorithms are declared below
by import path (``"module:function"``) and imported on first use. A user adds one with a decorator in a module
imported before the config is loaded::

    from megarl.algos.advantages import register_advantage

    @register_advantage("my_estimator", params={"gamma": "gamma"}, needs=("group_index",))
    def my_estimator(rewards, response_mask, *, values=None, group_index=None, gamma=1.0):
        ...
"""

from __future__ import annotations

import functools
import importlib
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Mapping, TypeVar

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class Entry:
    """One registered algorithm.

    Attributes:
        name: the registry name (what the config says).
        target: the function (or class), or ``"module:qualname"`` of a built-in, imported on first use.
        params: keyword argument -> config field it is set from, a dotted attribute path of the config object
            that :meth:`Registry.bind` is given (the trainer gives ``cfg.algorithm``: ``"gamma"``,
            ``"kl.estimator"``).
        needs: inputs the algorithm needs beyond the common ones. Advantage estimators: ``"values"`` (a
            critic), ``"group_index"`` (several responses per prompt).
        loss_gradient: KL estimators only: the divergence whose gradient the estimator's gradient estimates
            when it is used as a loss on samples of the policy, or None when it estimates no divergence's
            gradient (then it is refused as a loss; see :mod:`megarl.algos.kl`).
    """

    name: str
    target: Any
    params: Mapping[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()
    loss_gradient: str | None = None

    @property
    def fn(self) -> Any:
        """The function itself (a built-in's module is imported here)."""
        if not isinstance(self.target, str):
            return self.target
        module, _, attr = self.target.partition(":")
        return functools.reduce(getattr, attr.split("."), importlib.import_module(module))

    def config_params(self, cfg: Any) -> dict[str, Any]:
        """The keyword arguments read from ``cfg`` (see ``params``)."""
        return {kw: operator.attrgetter(path)(cfg) for kw, path in self.params.items()}


class Registry(Generic[F]):
    """Algorithms (or reward functions) of one kind, by name.

    Args:
        kind: what the entries are, for error messages (e.g. "advantage estimator").
        decorator: the decorator's name, for error messages (e.g. "register_advantage").
    """

    def __init__(self, kind: str, decorator: str):
        self.kind = kind
        self.decorator = decorator
        self._entries: dict[str, Entry] = {}

    def declare(self, name: str, target: str, *, aliases: tuple[str, ...] = (), **info) -> None:
        """Declare a built-in by import path ``"module:function"`` (imported on first use), under ``name``
        and each alias. ``info``: the other :class:`Entry` fields."""
        for key in (name, *aliases):
            self._add(Entry(name, target, **info), key)

    def register(self, name: str, **info) -> Callable[[F], F]:
        """Decorator that registers its function under ``name`` and returns it unchanged; ``info``: the other
        :class:`Entry` fields (``params``, ``needs``, ``loss_gradient``).

        Registering the same function again (a module reloaded) is allowed; another function under a taken
        name is not.

        Raises:
            ValueError: ``name`` is empty or already names a different function.
        """
        def decorate(fn: F) -> F:
            self._add(Entry(name, fn, **info), name)
            return fn

        return decorate

    def _add(self, entry: Entry, key: str) -> None:
        if not key:
            raise ValueError(f"a {self.kind} needs a non-empty name")
        old = self._entries.get(key)
        if old is not None and _qualified(old.target) != _qualified(entry.target):
            raise ValueError(f"{self.kind} {key!r} is already registered as {_qualified(old.target)}; "
                             f"pick another name for {_qualified(entry.target)}")
        self._entries[key] = entry

    def entry(self, name: str) -> Entry:
        """The :class:`Entry` registered as ``name``.

        Raises:
            ValueError: unknown name; the message lists the known names and how to register a new one.
        """
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {self.names()}. Register your own with "
                             f"@{self.decorator}({name!r}) in a module imported before the trainer "
                             "starts") from None

    def get(self, name: str) -> F:
        """The function registered as ``name`` (raises like :meth:`entry`)."""
        return self.entry(name).fn

    def bind(self, name: str, cfg: Any) -> F:
        """The function registered as ``name`` with its config parameters read from ``cfg`` (see
        :attr:`Entry.params`; raises like :meth:`entry`)."""
        entry = self.entry(name)
        return functools.partial(entry.fn, **entry.config_params(cfg))

    def find(self, spec: str, error: type[Exception] = ValueError) -> Any:
        """The function or class that ``spec`` names: a registered name, or a dotted path to user code,
        ``"package.module:attr"`` or ``"package.module.attr"`` (importable from ``sys.path``), not yet bound.

        Raises:
            error: unknown name, a module that fails to import, a missing attribute, or not callable (each
                message names ``spec`` and the fix).
        """
        if spec in self._entries:
            return self.get(spec)
        if ":" in spec:
            module_name, attr = spec.split(":", 1)
        elif "." in spec:
            module_name, attr = spec.rsplit(".", 1)
        else:
            raise error(f"unknown {self.kind} {spec!r}; built-in: {self.names()}; or give the path of your own, "
                        "'package.module:function'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise error(f"cannot import module {module_name!r} for {self.kind} {spec!r}: {type(e).__name__}: {e}. "
                        "Install the package or put its directory on PYTHONPATH") from e
        obj = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise error(f"{self.kind} {spec!r}: module {module_name!r} has no attribute {attr!r}")
            obj = getattr(obj, part)
        if not callable(obj):
            raise error(f"{self.kind} {spec!r} is a {type(obj).__name__}, not a function or class")
        return obj

    def names(self) -> list[str]:
        """The registered names (aliases included), sorted."""
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


def _qualified(target: Any) -> str:
    if isinstance(target, str):
        return target.replace(":", ".")
    return f"{target.__module__}.{target.__qualname__}"


# ------------------------------------------------------------------------------------------------ built-ins
_ADV = "megarl.algos.advantages:"
ADVANTAGES: Registry = Registry("advantage estimator", "register_advantage")
ADVANTAGES.declare("gae", _ADV + "gae_advantage", aliases=("ppo",), needs=("values",),
                   params={"gamma": "gamma", "lam": "lam", "whiten": "whiten_advantages"})
ADVANTAGES.declare("grpo", _ADV + "grpo_advantage", needs=("group_index",),
                   params={"norm_by_std": "norm_adv_by_std", "eps": "norm_adv_eps"})
ADVANTAGES.declare("rloo", _ADV + "rloo_advantage", needs=("group_index",))
ADVANTAGES.declare("reinforce_plus_plus", _ADV + "reinforce_plus_plus_advantage", params={"gamma": "gamma"})
ADVANTAGES.declare("reinforce_plus_plus_baseline", _ADV + "reinforce_plus_plus_baseline_advantage",
                   needs=("group_index",))

POLICY_LOSSES: Registry = Registry("policy loss", "register_policy_loss")
POLICY_LOSSES.declare("ppo", "megarl.algos.losses:ppo_clip_loss", params={
    "clip_ratio_low": "clip_ratio_low", "clip_ratio_high": "clip_ratio_high", "clip_ratio_c": "clip_ratio_c"})
POLICY_LOSSES.declare("gspo", "megarl.algos.losses:gspo_loss", params={
    "clip_ratio_low": "clip_ratio_low", "clip_ratio_high": "clip_ratio_high"})
POLICY_LOSSES.declare("cispo", "megarl.algos.losses:cispo_loss", params={
    "clip_ratio_low": "clip_ratio_low", "clip_ratio_high": "clip_ratio_high"})

# what each estimator's gradient estimates as a loss: derived and sourced in megarl.algos.kl's docstring
KL_ESTIMATORS: Registry = Registry("KL estimator", "register_kl")
KL_ESTIMATORS.declare("k1", "megarl.algos.kl:kl_k1", loss_gradient=None)
KL_ESTIMATORS.declare("k2", "megarl.algos.kl:kl_k2", loss_gradient="KL(pi || pi_ref)")
KL_ESTIMATORS.declare("k3", "megarl.algos.kl:kl_k3", loss_gradient="KL(pi_ref || pi)")
KL_ESTIMATORS.declare("k3+", "megarl.algos.kl:kl_k3_plus", loss_gradient="KL(pi || pi_ref)")

# rollout correction (megarl.algos.rollout_correction): levels, modes, and presets name -> (level, mode, cap,
# lower), with the caps of verl's presets (TIS C = 2) and IcePop's band [0.5, 5]
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
ROLLOUT_CORRECTION_MODES = ("truncate", "mask")
ROLLOUT_CORRECTION_PRESETS: dict[str, tuple[str, str, float, float]] = {
    "token_tis": ("token", "truncate", 2.0, 0.0),
    "seq_tis": ("sequence", "truncate", 2.0, 0.0),
    "token_mis": ("token", "mask", 2.0, 0.5),
    "seq_mis": ("sequence", "mask", 2.0, 0.5),
    "icepop": ("token", "mask", 5.0, 0.5),
}

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # see megarl.algos.aggregation.agg_loss
