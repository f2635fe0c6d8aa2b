"""YAML files and dotted ``key=value`` overrides into the typed ``Config``, and back to YAML.

A YAML file may list others under a top-level ``include:`` (paths relative to it); later files,
then the command-line overrides, win. Values are type-checked against the dataclasses' hints,
an unknown key named with the nearest valid ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from clip_train.config.schema import Config, ConfigError, LossConfig, LossKind, ModelConfig
from clip_train.files import replace_text

# Keys earlier releases had, so every run config they saved holds them: a saved config drops them
# silently, a config someone writes fails at start-up saying why the key went.
RETIRED_KEYS = {
    "loss.kernel": "the PyTorch tiles are the only loss path (the Triton kernels measured 1.6-1.85x "
    "slower on an H100)",
}


def load_config(
    path: str | os.PathLike | None = None, overrides: typing.Iterable[str] = (), *, saved: bool = False
) -> Config:
    """Load a YAML file (or the defaults when ``path`` is None) and apply ``key=value`` overrides.
    ``saved``: the file is one a run wrote (a run's config.yaml, a checkpoint's model.yaml), whose
    retired keys are dropped; the overrides are still the user's.

    Type-checked only: ``Config.validate`` cross-checks at start-up, once the world size is known."""
    raw: dict[str, Any] = _read_yaml_with_includes(Path(path)) if path is not None else {}
    if saved:
        _pop_retired(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"override {item!r} is not of the form key=value (e.g. batch.global_size=65536)"
            )
        _set_dotted(raw, key.strip(), _override_value(key.strip(), text))
    if retired := _pop_retired(raw):
        raise ConfigError(f"{retired} was removed: {RETIRED_KEYS[retired]}; delete the key")
    config = _build(Config, raw, prefix="")
    _fill_logit_init(config.model, config.loss.kind)
    return config


def _fill_logit_init(model: ModelConfig, loss: LossKind) -> None:
    """The logit scale and bias left at None take ``loss``'s own initial values, so the saved config
    (and each checkpoint's model.yaml) records what the model was built with, and a model YAML read
    alone (a teacher's architecture) builds as the same file does in a run."""
    sigmoid = loss == "sigmoid"
    if model.init_logit_scale is None:
        model.init_logit_scale = math.log(10.0) if sigmoid else math.log(1 / 0.07)
    if sigmoid and model.init_logit_bias is None:
        model.init_logit_bias = -10.0


class _YamlLoader(yaml.SafeLoader):
    """YAML as configs are written: ``1e-4`` is a float also where no type says so (in
    ``model.text.hf_config``, ``model.image.timm_kwargs``); PyYAML's YAML 1.1 wants ``1.0e-4``. And
    ``010`` is ten, as YAML 1.2 reads it, not YAML 1.1's octal eight (``train.seed=010``). A key
    written twice in one mapping is an error, where PyYAML kept the last: a second ``optim:``
    section dropped the first one's settings without a word."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(self.construct_scalar(node)).replace("_", "")
        if re.fullmatch(r"[-+]?0[0-7]+", text):
            return int(text, 10)
        return super().construct_yaml_int(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key_node.value!r} is set twice in one mapping", key_node.start_mark
                )
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_constructor("tag:yaml.org,2002:int", _YamlLoader.construct_yaml_int)


class _YamlDumper(yaml.SafeDumper):
    """YAML that ``_YamlLoader`` reads back as written: a text that it would read as a number (a
    run named ``3e-4``) is quoted."""


for _yaml_class in (_YamlLoader, _YamlDumper):
    _yaml_class.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )


def _read_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader: no Python objects


def _override_value(key: str, text: str) -> Any:
    """An override's value: a text key's (a path, a name, a separator such as ``,``, ``|`` or a tab)
    or a text mapping's entry (``eval.zeroshot_sets.v2``) as typed, spaces included, since YAML
    would cut it at ``#``, read ``012`` as a number or fail on ``,``; any other read as YAML, around
    which spaces mean nothing."""
    if key in _text_keys() or key.rpartition(".")[0] in _text_keys(dict[str, str]):
        return text
    text = text.strip()
    return _yaml_value(f"override {key}", text) if text else text


def _yaml_value(what: str, text: str) -> Any:
    """``text`` read as YAML, a value it cannot read being a one-line error naming ``what``."""
    try:
        return _read_yaml(text)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"{what}={text}: cannot read the value as YAML ({problem})") from None


@functools.cache
def _text_keys(hint: Any = str) -> frozenset[str]:
    """The keys of type ``hint``: text, or (``dict[str, str]``) mappings of names to text."""
    return frozenset(name for name, _, key_hint, _ in _leaves(Config) if key_hint == hint)


def config_yaml(config: Config) -> str:
    """The resolved config as YAML, every key included, in declaration order."""
    return _dump_yaml(dataclasses.asdict(config))


def model_config_yaml(model: ModelConfig) -> str:
    """The ``model:`` section alone, as ``load_model_config`` reads it (a checkpoint's model.yaml)."""
    return _dump_yaml({"model": dataclasses.asdict(model)})


def _dump_yaml(data: dict[str, Any]) -> str:
    return yaml.dump(data, Dumper=_YamlDumper, sort_keys=False)


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config so a run directory records exactly what ran."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, config_yaml(config))


class ConfigKey(typing.NamedTuple):
    name: str  # dotted, e.g. batch.global_size
    hint: Any  # the type annotation
    default: Any
    meaning: str  # the inline comment on the field


def config_keys(cls: type = Config) -> list[ConfigKey]:
    """Every leaf key, in declaration order (what ``clip-train config --keys`` and the README list)."""
    return [
        ConfigKey(
            name,
            hint,
            f.default_factory() if f.default is dataclasses.MISSING else f.default,
            _field_comments(owner).get(f.name, ""),
        )
        for name, f, hint, owner in _leaves(cls)
    ]


def _leaves(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, dataclasses.Field, Any, type]]:
    """Each leaf field under ``cls``: its dotted name, the field, its type hint and the dataclass that
    declares it. Loading a config needs no more, and reading the comments (the classes' source)
    took 0.2-0.4 s of every run's start-up."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, hints[f.name], cls


@functools.cache
def _field_comments(cls: type) -> dict[str, str]:
    """Inline ``# comment`` of each field of ``cls`` and of the dataclasses it inherits from."""
    comments: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        for line in inspect.getsource(klass).splitlines():
            if found := re.match(r"^\s+(\w+):[^#]*#\s*(.+)$", line):
                comments[found.group(1)] = found.group(2)
    return comments


def _pop_retired(raw: dict[str, Any]) -> str | None:
    """Remove every retired key from ``raw``; the first one it held, if any."""
    found = None
    for key in RETIRED_KEYS:
        *parents, leaf = key.split(".")
        node: Any = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            del node[leaf]
            found = found or key
    return found


def _read_yaml_with_includes(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: include cycle through {' -> '.join(map(str, seen))}")
    try:
        data = _read_yaml(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not UTF-8 text") from None
    except OSError as err:  # a directory, no read permission, an I/O error
        raise ConfigError(f"config file {path}: cannot read it: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    includes = data.pop("include", None) or []
    includes = [includes] if isinstance(includes, str) else includes
    if not isinstance(includes, list) or not all(isinstance(inc, str) for inc in includes):
        raise ConfigError(f"{path}: include={includes!r} must be a file name or a list of them")
    merged: dict[str, Any] = {}
    for inc in includes:
        _deep_merge(merged, _read_yaml_with_includes(path.parent / inc, (*seen, path)))
    _deep_merge(merged, data)
    return merged


def _deep_merge(into: dict[str, Any], new: dict[str, Any], prefix: str = "") -> None:
    """``new`` over ``into``, section by section; a mapping that is a key's value
    (``model.image.timm_kwargs: {}``) replaces the earlier one whole, as an override does."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict) and prefix + key in _section_names():
            _deep_merge(into[key], value, f"{prefix}{key}.")
        else:
            into[key] = value


@functools.cache
def _section_names(cls: type = Config, prefix: str = "") -> frozenset[str]:
    """The dotted names of the config's sections (``model``, ``model.image``, ``log.wandb``)."""
    hints = typing.get_type_hints(cls)
    names: set[str] = set()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            names |= {prefix + f.name, *_section_names(hints[f.name], f"{prefix}{f.name}.")}
    return frozenset(names)


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """One override into ``raw``: a mapping given for a section (``model.image={timm: ...}``) merges
    into it key by key, as an include's does, where it reset the section's other keys without a
    word; one given for a key whose value is a mapping (``timm_kwargs``) replaces it."""
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part} is a value, not a section")
    _deep_merge(node, {leaf: value}, "".join(f"{part}." for part in parents))


def load_model_config(path: str | os.PathLike, key: str) -> ModelConfig:
    """The ``model:`` section of a YAML file (``configs/model/*.yaml``), its logit scale and bias
    resolved as ``load_config`` resolves those of a run with the default loss; ``key`` names the
    setting that pointed at it, in errors."""
    if not Path(path).is_file():
        raise ConfigError(f"{key}={str(path)!r}: no such file")
    raw = _read_yaml_with_includes(Path(path))
    if not isinstance(raw.get("model"), dict):
        raise ConfigError(f"{key}={str(path)!r} has no model: section")
    try:
        model = _build(ModelConfig, raw["model"], "model.")
    except ConfigError as err:
        raise ConfigError(f"{key}={str(path)!r}: {err}") from None
    _fill_logit_init(model, LossConfig.kind)
    return model


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in raw if key not in names]
    if unknown:  # name the first one, with the nearest sections or leaf keys
        valid = {prefix + name for name in names} | {prefix + name for name, *_ in _leaves(cls)}
        near = difflib.get_close_matches(prefix + str(unknown[0]), valid, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(near)}?" if near else f"valid keys under {where}: {', '.join(names)}"
        raise ConfigError(f"unknown config key {prefix}{unknown[0]}: {hint}")
    return cls(**{name: _coerce(hints[name], raw[name], prefix + name) for name in names if name in raw})


def _coerce(hint: Any, value: Any, key: str) -> Any:
    """Convert ``value`` to the annotated type or raise a ConfigError naming ``key``."""
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r}: must be one of {', '.join(map(str, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in args:
            try:
                return _coerce(arm, value, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r}: expected {hint}")
    if origin is list:
        if isinstance(value, str):
            value = _yaml_value(key, value)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list, e.g. {key}=[1,2]")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping")
        return dict(value)
    return _coerce_scalar(hint, value, key)


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def _coerce_scalar(hint: type, value: Any, key: str) -> Any:
    if hint not in (bool, int, float, str, type(None)):
        raise ConfigError(f"{key}: unsupported config type {hint!r}")
    bad = ConfigError(f"{key}={value!r}: expected {hint.__name__}")
    if hint is type(None):  # null, or None as docs/config.md shows such a default
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            return None
        raise bad
    if hint is bool:
        if isinstance(value, (str, int)) and str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        raise bad
    if hint is str and not isinstance(value, str):  # YAML read 0755 as 755 and 1:30 as 90: not text
        raise ConfigError(f"{key}={value!r}: expected text; quote it in the YAML file")
    # bool is an int subclass but never a number; a whole float (1e3) is an int, 1.5 is not
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad
    if hint is int and isinstance(value, float) and not value.is_integer():
        raise bad
    if hint is int and isinstance(value, str):
        value = value.replace("_", "")  # 65_536
    try:
        return hint(value)  # float() also reads "1e-3", which PyYAML (wanting a dot) leaves a string
    except (ValueError, OverflowError):  # OverflowError: an int beyond a float's range
        raise bad from None
