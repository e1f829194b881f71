"""Loading a config: schema defaults <- YAML file <- `key=value` overrides, strict, then validated; its YAML
text and its hash.

Merging is strict: an unknown key is a `ValueError` naming its dotted path and the nearest valid names; a wrong
type or an out-of-range value is a `ValueError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import os
import typing
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fp8train.training.config.base import check_settings_file
from fp8train.training.config.full import FullConfig
from fp8train.training.config.model_data import MOE_FIELDS
from fp8train.training.config.run import RESUME_WORDS


# ---------------------------------------------------------------------------------------------------------
# Loading: strict key check with suggestions, then OmegaConf merge, then construction (which validates).


def _field_types(schema: type) -> dict[str, Any]:
    # typing.get_type_hints resolves the string annotations of `from __future__ import annotations`.
    return typing.get_type_hints(schema)


def _leaf_paths(schema: type, prefix: str = "") -> list[str]:
    paths = []
    for name, tp in _field_types(schema).items():
        if dataclasses.is_dataclass(tp):
            paths += _leaf_paths(tp, f"{prefix}{name}.")
        else:
            paths.append(prefix + name)
    return paths


def _check_keys(given: Any, schema: type, prefix: str = "") -> None:
    """Raise ValueError for any key of `given` (a plain dict) that `schema` does not have."""
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(given, dict):
        raise ValueError(f"config {where} must be a mapping of keys, got {given!r}")
    types = _field_types(schema)
    for key, value in given.items():
        path = f"{prefix}{key}"
        if key not in types or key.startswith("_"):
            names = [n for n in types if not n.startswith("_")]
            near = difflib.get_close_matches(str(key), names, n=3, cutoff=0.5)
            if not near:  # e.g. a bare "lr" at the top level: look through every dotted path
                leaves = _leaf_paths(FullConfig)
                near = [p for p in leaves if difflib.get_close_matches(str(key), [p.split(".")[-1]], cutoff=0.8)]
            hint = f"did you mean {', '.join(repr(n) for n in near[:3])}? " if near else ""
            raise ValueError(f"unknown config key '{path}': {hint}valid keys in {where}: {', '.join(names)}")
        if dataclasses.is_dataclass(types[key]):
            _check_keys(value, types[key], path + ".")
        elif types[key] in (bool, Optional[bool]) and not (value is None or isinstance(value, bool)):
            raise ValueError(f"config {path}={value!r} is invalid: must be true or false")
        elif typing.get_origin(types[key]) is dict:  # a mapping setting (OmegaConf's own error is a bare TypeError)
            if not isinstance(value, dict):
                raise ValueError(f"config {path}={value!r} is invalid: must be a mapping {{key: value, ...}}")
        elif isinstance(value, dict):  # OmegaConf answers a mapping given to a list field with a bare TypeError
            raise ValueError(f"config {path}={value!r} is invalid: {path} is a single setting, not a section "
                             "(give a value, or a list in [brackets])")


def _bool_keys(schema: type = FullConfig, prefix: str = "") -> set[str]:
    """Dotted paths of the boolean settings."""
    keys = set()
    for name, tp in _field_types(schema).items():
        if dataclasses.is_dataclass(tp):
            keys |= _bool_keys(tp, f"{prefix}{name}.")
        elif tp in (bool, Optional[bool]):
            keys.add(prefix + name)
    return keys


def _check_bool_text(key: str, text: str) -> None:
    # YAML 1.1 (OmegaConf's parser) reads yes, on and y as true, and OmegaConf turns 1, -1 and 2 into true: a
    # typo must not flip a switch silently, so a boolean is written true or false and nothing else.
    words = RESUME_WORDS if key == "train.resume" else ("true", "false") if key in _bool_keys() else None
    if words is not None and text.strip().lower() not in (*words, "null", "~", ""):
        allowed = " or ".join(words) if len(words) == 2 else "one of " + ", ".join(words)
        raise ValueError(f"config {key}={text.strip()!r} is invalid: must be {allowed}")


def _check_yaml_bools(path: str) -> None:
    """The boolean settings of a YAML file, checked on the text as written (before YAML resolves it)."""
    import yaml

    with open(path) as f:
        root = yaml.compose(f)
    sections = root.value if isinstance(root, yaml.MappingNode) else []
    for key_node, body in sections:
        for item in body.value if isinstance(body, yaml.MappingNode) else []:
            if isinstance(item[1], yaml.ScalarNode):
                _check_bool_text(f"{key_node.value}.{item[0].value}", item[1].value)


def _read_yaml(path: str) -> dict:
    if not os.path.exists(path):
        raise ValueError(f"config file {path!r} does not exist")
    check_settings_file(path, "config file")
    try:
        loaded = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends; their messages span lines, the CLI prints one
        raise ValueError(f"config file {path!r} is not valid YAML: {' '.join(str(e).split())}") from None
    container = OmegaConf.to_container(loaded) if loaded is not None else {}
    if container is None or (container == {} and not _says_empty_mapping(path)):
        # a file with nothing in it is more often a truncated copy or the wrong file than a wish for every default
        # (which would then train into ./runs); `{}` says that wish
        raise ValueError(f"config file {path!r} is empty; write the settings in it, or `{{}}` to train every "
                         "default on purpose")
    if not isinstance(container, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of sections, got {type(container).__name__}")
    _check_yaml_bools(path)
    return container


def _says_empty_mapping(path: str) -> bool:
    """The file writes an empty mapping (`{}`), rather than holding nothing but blanks and comments."""
    with open(path, "rb") as f:
        return b"{" in f.read(1 << 16)


def _parse_overrides(overrides: Iterable[str]) -> dict:
    merged = OmegaConf.create({})
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ValueError(f"override {item!r} must look like section.key=value, e.g. train.lr=1e-3")
        _check_bool_text(*item.strip().split("=", 1))
        if item.strip().endswith("="):  # `data.path=` means the empty string (OmegaConf would read null)
            item = item.strip() + "''"
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item.strip()]))
        except Exception as e:  # OmegaConf's errors, and yaml's for a value like `[1,`
            raise ValueError(f"override {item!r} could not be parsed: {' '.join(str(e).split())}") from None
    return OmegaConf.to_container(merged)


def _omegaconf_error(e: OmegaConfBaseException) -> ValueError:
    key = getattr(e, "full_key", None) or getattr(e, "key", None) or "?"
    msg = getattr(e, "msg", None) or str(e)
    if "is not a ListConfig" in msg:  # OmegaConf's words for a single value given to a list key
        value = getattr(e, "value", None)
        return ValueError(f"config {key}={value!r}: expected a list, e.g. {key}=[{value}] (YAML: [a, b]; [] for "
                          "none)")
    return ValueError(f"config {key}: {msg.splitlines()[0]}")


@functools.cache
def _schema() -> DictConfig:
    """FullConfig's defaults as OmegaConf's structured config, built once per process (building it constructs
    every section, and with it the default preset's recipe, which no run uses)."""
    return OmegaConf.structured(FullConfig)


def load_config(path: Optional[str] = None, overrides: Iterable[str] = ()) -> FullConfig:
    """Schema defaults <- YAML file at `path` (None = no file) <- `key=value` overrides; validated FullConfig."""
    layers = [_read_yaml(path) if path is not None else {}, _parse_overrides(list(overrides))]
    try:  # a key error in the file names the file (a run folder's config.yaml may be someone else's)
        _check_keys(layers[0], FullConfig)
    except ValueError as err:
        raise ValueError(f"config file {path!r}: {err}") from None
    _check_keys(layers[1], FullConfig)
    try:
        merged = OmegaConf.merge(_schema(), *layers)  # merge copies its first argument: the schema stays as it is
        return OmegaConf.to_object(merged)  # builds the dataclasses, so every _check() runs here
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e) from None


def apply_overrides(cfg: FullConfig, overrides: Iterable[str]) -> FullConfig:
    """`cfg` with `key=value` overrides merged in memory, checked as `load_config` checks them (strict keys, typed,
    range-checked): the same config as writing `cfg` to YAML and loading it with the overrides, without the file."""
    layer = _parse_overrides(list(overrides))
    _check_keys(layer, FullConfig)
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), layer))
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e) from None


def _to_dictconfig(cfg: FullConfig | DictConfig) -> DictConfig:
    return cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)


def config_to_yaml(cfg: FullConfig | DictConfig) -> str:
    """The resolved config as YAML; `load_config` of this text gives back an equal config."""
    return OmegaConf.to_yaml(_to_dictconfig(cfg))


# Keys that do not change what is trained or measured: a run dir made under another name, resumed, with other
# logging or checkpoint cadence, or judged with another margin still holds the same experiment.
HASH_EXCLUDE = ("run", "train.resume", "log", "checkpoint", "validate")


# Keys added to the schema after runs were made with it, and the value that means "as before": at that value they
# are left out of the hash, so a run made before the key existed still resumes, forks and exports (as the MoE
# fields are for a dense model, model.n_experts = 0).
HASHED_WHEN_SET = {"train.tp_size": 1, "train.sequence_parallel": True, "policy.linear_subclasses": []}
# Keys renamed after runs were made, hashed under the name they had then: a renamed key changes no run's hash.
HASHED_AS = {"policy.overrides_file": "plan"}


def config_hash(cfg: FullConfig | DictConfig, exclude: Iterable[str] = HASH_EXCLUDE,
                data_fingerprint: dict | None = None) -> str:
    """sha256 of the resolved config without the `exclude` dotted keys (whole sections or single fields), and of
    `data_fingerprint` (data.TextData.fingerprint: what the tokens are) when given: a run's hash changes when the
    file at data.path is rewritten, not only when data.path does."""
    # a FullConfig holds plain values (to_object converted every container): asdict gives the same mapping as
    # OmegaConf's to_container in a hundredth of the time, which a plan of thousands of runs needs
    container = (dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg)
                 else OmegaConf.to_container(_to_dictconfig(cfg), resolve=True))
    if data_fingerprint is not None:
        container["data_fingerprint"] = data_fingerprint
    model = container.get("model", {})
    if isinstance(model, dict) and not model.get("n_experts"):  # dense: the hash dense runs always had
        for key in ("n_experts", *MOE_FIELDS):
            model.pop(key, None)
    for dotted, old_name in HASHED_AS.items():
        section, _, key = dotted.partition(".")
        node = container.get(section)
        if isinstance(node, dict) and key in node:
            node[old_name] = node.pop(key)
    for dotted, default in HASHED_WHEN_SET.items():  # at its default, a key added later leaves the hash as it was
        section, _, key = dotted.partition(".")
        node = container.get(section)
        if isinstance(node, dict) and key in node and node[key] == default:
            node.pop(key)
    for dotted in exclude:
        *parents, last = dotted.split(".")
        node = container
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(last, None)
    return hashlib.sha256(json.dumps(container, sort_keys=True).encode()).hexdigest()
