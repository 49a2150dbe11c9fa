"""Loading a config: the defaults, then a YAML file, then ``key=value`` overrides, typed and validated (errors
named by their full dotted field); making its paths absolute; the config as plain data."""

from __future__ import annotations

import dataclasses
import io
import os
import re
from pathlib import Path
from typing import Any

from megarl.config.errors import ConfigError, _SectionFieldError
from megarl.config.run import Config

def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                schema: type[Config] = Config) -> Config:
    """Defaults, then the YAML file, then ``key=value`` overrides; typed and validated. ``schema``: the config's
    class (a :class:`Config` with sections of its own: :mod:`megarl.config.offline`).

    Raises:
        ConfigError: an unknown key, a wrong type or an invalid value, naming the field.
        FileNotFoundError: the YAML file does not exist.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured(schema)
    try:
        layers = [base]
        if path is not None:
            if not Path(path).is_file():
                if Path(path).suffix not in (".yaml", ".yml") and re.fullmatch(r"[A-Za-z_]\w*(\.\w+)+", str(path)):
                    raise ConfigError(f"{path}: an override needs a value, e.g. {path}=...; the config file, if "
                                      "any, comes first: megarl COMMAND CONFIG.yaml key=value ...")
                raise FileNotFoundError(f"config file {path} does not exist (see parallel_configs/)")
            layers.append(_load_yaml(path))
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if any(Path(o).suffix in (".yaml", ".yml") for o in bad):
                raise ConfigError(f"the config file must come first: megarl COMMAND CONFIG.yaml key=value ..., "
                                  f"got {bad} after overrides")
            if bad:
                raise ConfigError(f"overrides must be key=value, got {bad}")
            layers.append(_load_overrides(overrides))
        for layer in layers[1:]:
            _check_sections(base, layer)
        merged = OmegaConf.merge(*layers)
        try:
            return OmegaConf.to_object(merged)
        except _SectionFieldError:
            _name_section_error(merged)
            raise
    except OmegaConfBaseException as e:
        key, msg = getattr(e, "full_key", None), str(e).splitlines()[0]
        if key and re.match(r"Key (True|False) \(bool\) is incompatible", msg):  # choices: {yes: 1, no: 0}
            key, msg = key.rpartition(".")[0], (f"{msg}: YAML reads a bare yes/no/on/off as a boolean; quote the "
                                                "keys, e.g. key='{\"yes\": 1, \"no\": 0}'")
        raise ConfigError(f"{key or 'config'}: {msg}") from None


def _name_section_error(node, prefix: str = "") -> None:
    """Find the section of ``node`` (a merged config) whose ``__post_init__`` raises a
    :class:`_SectionFieldError`, innermost first, and raise it as a :class:`ConfigError` naming the field's
    full dotted path (``critic.optim.lr``)."""
    from omegaconf import DictConfig, OmegaConf

    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            _name_section_error(child, f"{prefix}{key}.")
    try:
        OmegaConf.to_object(node)
    except _SectionFieldError as e:
        raise ConfigError(f"{prefix}{e.field_name}: {e.msg}") from None


def _load_yaml(path: str | os.PathLike):
    """A YAML config file as an OmegaConf mapping.

    Raises:
        ConfigError: naming the file: not YAML, or not a mapping of sections.
        FileFormatError: not UTF-8, naming the line and byte offset.
    """
    import yaml
    from omegaconf import DictConfig, OmegaConf

    from megarl.textfiles import read_text

    text = read_text(path)  # bytes that are not UTF-8: the line and offset named
    try:
        layer = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"{path}: a config file maps sections (run, model, actor, ...) to their fields; this one "
                          f"holds a {type(layer).__name__.removesuffix('Config').lower()}")
    return layer


def _load_overrides(overrides: list[str]):
    """``key=value`` overrides as one OmegaConf mapping; each value is read as YAML (``a.b=[1, 2]``).

    Raises:
        ConfigError: naming the override whose value is not valid YAML.
    """
    import yaml
    from omegaconf import OmegaConf

    layers = []
    for item in overrides:
        try:
            layers.append(OmegaConf.from_dotlist([item]))
        except yaml.YAMLError as e:
            key, value = item.split("=", 1)
            raise ConfigError(f"{key}: the value {value!r} is not valid YAML ({' '.join(str(e).split())}); "
                              "quote it for a string, e.g. key='\"text, with commas\"'") from None
    return OmegaConf.merge(*layers)


def _check_sections(base, layer, prefix: str = "") -> None:
    """Refuse a plain value where the config has a section (``actor.parallel: 3``) or a list
    (``data.train_files: a.parquet``), naming the key (OmegaConf's own merge errors name no key or no fix).

    Raises:
        ConfigError: naming the dotted key and the section's fields.
    """
    from omegaconf import OmegaConf

    for key, value in layer.items_ex(resolve=False):
        if key in base and OmegaConf.is_list(base[key]) and value is not None and not OmegaConf.is_list(value):
            raise ConfigError(f"{prefix}{key}: must be a list, e.g. [{value}]")
        if key not in base or not OmegaConf.is_dict(base[key]):
            continue  # unknown keys and wrong values are named by OmegaConf's merge
        fields = list(base[key].keys())
        if not OmegaConf.is_dict(value):
            raise ConfigError(f"{prefix}{key}: is a section (fields {fields}), not a value; set a field, e.g. "
                              f"{prefix}{key}.{fields[0] if fields else 'name'}=...")
        _check_sections(base[key], value, f"{prefix}{key}.")


def absolute_paths(cfg: Config) -> Config:
    """A copy of ``cfg`` whose paths are absolute (``model.path``, ``model.tokenizer``, ``data.train_files``,
    ``data.gsm8k_source``, ``validation.files``, ``run.output_dir``), so that what a run records (its config.json, its checkpoints)
    means the same from any working folder. Names that are not paths (``default``, ``preset:NAME``, ``auto``,
    ``hub``) are kept."""
    def absolute(p: str | None) -> str | None:
        if p is None or p in ("default", "auto", "hub") or p.startswith("preset:"):
            return p
        return str(Path(p).expanduser().resolve())

    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, output_dir=absolute(cfg.run.output_dir)),
        model=dataclasses.replace(cfg.model, path=absolute(cfg.model.path), tokenizer=absolute(cfg.model.tokenizer)),
        data=dataclasses.replace(cfg.data, train_files=[absolute(f) for f in cfg.data.train_files],
                                 gsm8k_source=absolute(cfg.data.gsm8k_source)),
        validation=dataclasses.replace(cfg.validation, files=[absolute(f) for f in cfg.validation.files]))


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data (for metrics, checkpoints and the summary)."""
    return dataclasses.asdict(cfg)
