"""A Config built from plain values: config.toml, command-line overrides and keyword options.

Every value is checked against its section's defaults (ints taken as floats, lists as tuples) and
an unknown section or setting is refused by name, so a typo in config.toml is an error at start,
never a setting silently left at its default. The tree itself, and the checks of each section's
values, are config.py's.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

from chatd.config import (DEFAULT_ALIAS, DEFAULT_POLICIES, DEFAULT_TIERS, FAILURE_MODES, SECTIONS, SERVED_NAME, TIER_NAME,
                          AliasConfig, CacheConfig, CategoryPolicy, Config, EscalationRules, FleetModel, ModelConfig,
                          Price, RampConfig, SpeculativeConfig, TierConfig, keep_alive_seconds)

# Settings that take one string or a list of strings; a lone "" means none.
ONE_OR_MORE = {("server", "model_name")}

# The plain settings of [tiers] (its tables are tiers), each the Config field it sets.
TIERS_SETTINGS = {"storage": "tiers_storage", "on_storage_error": "tiers_on_storage_error"}
# What [tiers] storage may name: each replica's own memory, or a Redis server.
TIERS_STORAGE = ("memory://", "redis://", "rediss://", "unix://")


def build_config(values: dict[str, dict[str, Any]] | None = None) -> Config:
    """Build a Config from nested `{section: {key: value}}`, rejecting unknown keys by name."""
    values = dict(values or {})
    prices = _build_prices(values.pop("prices", {}))
    tiers, tiers_settings = _build_tiers(values.pop("tiers", {}))
    policies = _build_policies(values.pop("policies", {}))
    models, aliases = values.pop("models", []), values.pop("aliases", {})
    sections: dict[str, Any] = {}
    for name, section_values in values.items():
        if name not in SECTIONS:
            raise ValueError(f"unknown config section [{name}]; known: {', '.join(SECTIONS)}")
        cls = SECTIONS[name]
        sections[name] = cls(**_checked(name, cls, section_values))
    config = Config(**sections, prices=prices, tiers=tiers, policies=policies, **tiers_settings)
    if config.auth.local_tier not in tiers:
        raise ValueError(f"setting auth.local_tier names tier {config.auth.local_tier!r}, which is not defined; "
                         f"defined: {', '.join(tiers)}")
    if models or aliases:
        config = dataclasses.replace(config, models=_build_models(models, config), aliases=_build_aliases(aliases))
    check_names(config)
    return config


# A [[models]] entry's own settings; every other key is a [model] setting.
MODEL_ENTRY_KEYS = ("name", "keep_alive", "preload", "cache", "speculative")


def _build_models(entries: Any, config: Config) -> tuple[FleetModel, ...]:
    """[[models]]: each entry's [model] settings (and `cache`, `speculative` tables) over the
    server's sections, its names and keep_alive (the server's when it gives none)."""
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ValueError("models must be a list of tables: [[models]] with name = \"small\" and path = \"demo\"")
    if config.server.model_name:
        raise ValueError("server.model_name names the one model of [model]; with [[models]], each entry has its names")
    fleet = []
    for index, entry in enumerate(entries):
        where = f"models[{index}]"
        names = entry.get("name")
        names = (names,) if isinstance(names, str) else names
        if not names or not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where}.name must be a name clients send as `model` (or a list of them), got {names!r}")
        where = f"models.{names[0]}"
        model_values = {key: value for key, value in entry.items() if key not in MODEL_ENTRY_KEYS}
        tables = {}
        for key, section, cls in (("cache", config.cache, CacheConfig), ("speculative", config.speculative,
                                                                          SpeculativeConfig)):
            table = entry.get(key, {})
            if not isinstance(table, dict):
                raise ValueError(f"{where}.{key} must be a table of [{key}] settings, got {table!r}")
            tables[key] = _replaced(f"{where}.{key}", section, cls, table)
        preload = entry.get("preload", False)
        if not isinstance(preload, bool):
            raise ValueError(f"setting {where}.preload must be true or false, got {preload!r}")
        fleet.append(FleetModel(
            names=tuple(names), model=_replaced(where, config.model, ModelConfig, model_values), **tables,
            keep_alive=keep_alive_seconds(entry.get("keep_alive", config.server.keep_alive), f"{where}.keep_alive"),
            preload=preload))
    return tuple(fleet)


def _replaced(where: str, section: Any, cls: type, values: dict[str, Any]) -> Any:
    fields = _checked(where, cls, values)
    try:
        return dataclasses.replace(section, **fields)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _build_aliases(values: Any) -> dict[str, AliasConfig]:
    """[aliases.NAME]: targets = { model = weight, ... } (weights of 0 or more, one above 0), or
    small = "model", large = "model" and escalate_when = { rule = value, ... } (EscalationRules)."""
    if not isinstance(values, dict):
        raise ValueError("aliases must be tables: [aliases.chat] with targets = { small = 80, large = 20 }")
    aliases = {}
    for name, table in values.items():
        where = f"aliases.{name}"
        if not isinstance(table, dict):
            raise ValueError(f"{where} must be a table, got {table!r}")
        if "targets" in table:
            aliases[name] = _split_alias(where, table)
        elif set(table) >= {"small", "large"}:
            unknown = set(table) - {"small", "large", "escalate_when"}
            if unknown:
                raise ValueError(f"unknown setting {where}.{sorted(unknown)[0]}; known: small, large, escalate_when")
            if not all(isinstance(table[k], str) for k in ("small", "large")) or table["small"] == table["large"]:
                raise ValueError(f"{where}.small and .large must name two models")
            rules = table.get("escalate_when", {})
            if not isinstance(rules, dict) or not rules:
                raise ValueError(f"{where}.escalate_when must be a table of rules like {{ prompt_chars = 4000, tools = true }}")
            aliases[name] = AliasConfig(small=table["small"], large=table["large"],
                                        escalate_when=_replaced(f"{where}.escalate_when", EscalationRules(),
                                                                EscalationRules, rules))
        else:
            raise ValueError(f"{where} must have targets = {{ model = weight, ... }}, or small, large and escalate_when")
    return aliases


def _split_alias(where: str, table: dict) -> AliasConfig:
    if not set(table) <= {"targets", "ramp"} or not isinstance(table["targets"], dict) or not table["targets"]:
        raise ValueError(f"{where} must be a table of targets = {{ model = weight, ... }} (and a ramp), got {table!r}")
    targets = {}
    for model, weight in table["targets"].items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise ValueError(f"{where}.targets.{model} must be a weight of 0 or more, got {weight!r}")
        targets[model] = float(weight)
    if not sum(targets.values()) > 0:
        raise ValueError(f"{where}.targets: at least one weight must be more than 0")
    if "ramp" not in table:
        return AliasConfig(targets)
    if not isinstance(table["ramp"], dict):
        raise ValueError(f"{where}.ramp must be a table like {{ canary = \"v2\", steps = [1, 5, 25, 100] }}")
    ramp = _replaced(f"{where}.ramp", RampConfig(), RampConfig, table["ramp"])
    if len(targets) != 2 or ramp.canary not in targets:
        raise ValueError(f"{where}.ramp.canary must name one of exactly two targets (the other is the stable "
                         f"version), got {ramp.canary!r} of {sorted(targets)}")
    return AliasConfig(targets, ramp)


def check_names(config: Config) -> None:
    """Every served name is well formed and unique among models and aliases; aliases split over
    models; tiers name models and aliases that exist. ValueError naming the setting."""
    fleet = config.fleet()
    seen: dict[str, str] = {}
    for entry in fleet:
        for name in entry.names:
            where = f"models.{entry.names[0]}.name" if config.models else "server.model_name"
            if not SERVED_NAME.fullmatch(name) or name == DEFAULT_ALIAS:
                raise ValueError(f"setting {where}: {name!r} cannot be a model's name (1-128 letters, digits and "
                                 f"._:/@+-, not {DEFAULT_ALIAS!r})")
            if name in seen:
                raise ValueError(f"setting {where}: {name!r} names two models")
            seen[name] = entry.names[0]
    for alias, settings in config.aliases.items():
        if not SERVED_NAME.fullmatch(alias) or alias == DEFAULT_ALIAS or alias in seen:
            raise ValueError(f"aliases.{alias}: an alias needs a name of its own (not a model's, not {DEFAULT_ALIAS!r})")
        for target in settings.models:
            if target not in seen:
                raise ValueError(f"aliases.{alias} names {target!r}, which is no model's name; models: "
                                 f"{', '.join(seen)}")
        for tier in settings.escalate_when.tiers:
            if tier not in config.tiers:
                raise ValueError(f"aliases.{alias}.escalate_when.tiers names tier {tier!r}, which is not defined")
    if not all(entry.names for entry in fleet):  # the one model's name is its folder's, known when it loads
        return
    known = set(seen) | set(config.aliases)
    for tier_name, tier in config.tiers.items():
        for name in (*tier.models, *((tier.default_model,) if tier.default_model else ())):
            if name not in known:
                raise ValueError(f"setting tiers.{tier_name} names model {name!r}, which is not served; served: "
                                 f"{', '.join(sorted(known))}")
        if tier.default_model and tier.models and tier.default_model not in tier.models:
            raise ValueError(f"setting tiers.{tier_name}.default_model {tier.default_model!r} is not one of the "
                             f"tier's models ({', '.join(tier.models)})")


def _checked(where: str, cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """A table's settings for `cls`, typed as its defaults are (ints taken as floats, lists as
    tuples; `ONE_OR_MORE` settings take one string too); ValueError naming `where.key` otherwise."""
    known = [f.name for f in dataclasses.fields(cls)]  # in their order, for the message
    checked = {}
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"unknown setting {where}.{key}; known: {', '.join(known)}")
        expected = type(getattr(cls(), key))
        if (where, key) in ONE_OR_MORE and isinstance(value, str):
            value = (value,) if value else ()
        if (where, key) == ("server", "engine_process") and isinstance(value, bool):
            value = "on" if value else "off"  # (it was a boolean before "auto")
        if (where, key) == ("server", "keep_alive") and isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)  # seconds, as Ollama takes them
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif expected is tuple:
            numbers = isinstance(getattr(cls(), key)[:1] and getattr(cls(), key)[0], float)  # a list of numbers
            kind = (int, float) if numbers else str
            if not (isinstance(value, (list, tuple)) and all(isinstance(v, kind) and not isinstance(v, bool)
                                                             for v in value)):
                raise ValueError(f"setting {where}.{key} must be a list of {'numbers' if numbers else 'strings'}, "
                                 f"got {value!r}")
            value = tuple(float(v) for v in value) if numbers else tuple(value)
        elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ValueError(f"setting {where}.{key} must be {expected.__name__}, got {value!r}")
        checked[key] = value
    return checked


def speculative_settings(text: str) -> dict[str, Any]:
    """vLLM's --speculative-config JSON as the [speculative] settings it sets over the config file's:
    its keys are the section's. As vLLM, `model` alone means method "draft_model"; a method other than
    "draft_model" clears a draft model the file named. ValueError naming the unknown key or the
    setting whose value has the wrong type; the settings together are checked when the config is built."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at character {exc.pos}): {text!r}") from None
    if not isinstance(values, dict):
        raise ValueError(f"must be a JSON object like '{{\"method\": \"ngram\"}}', got {text!r}")
    known = [f.name for f in dataclasses.fields(SpeculativeConfig)]
    unknown = [key for key in values if key not in known]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; known: {', '.join(known)}")
    values = _checked("speculative", SpeculativeConfig, values)
    if values.get("model") and "method" not in values:
        values["method"] = "draft_model"
    if "method" in values and values["method"] != "draft_model":
        values.setdefault("model", "")
    return values


def _build_prices(values: dict[str, Any]) -> dict[str, Price]:
    known = [f.name for f in dataclasses.fields(Price)]
    prices = {}
    for model, price in values.items():
        if not isinstance(price, dict):
            raise ValueError(f"prices.{model} must be a table like {{ input = 0.2, output = 0.8 }}, got {price!r}")
        for key, value in price.items():
            if key not in known:
                raise ValueError(f"unknown setting prices.{model}.{key}; known: {', '.join(known)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"setting prices.{model}.{key} must be a number, got {value!r}")
        prices[model] = Price(**{k: float(v) for k, v in price.items()})
    return prices


def _build_tiers(values: dict[str, Any]) -> tuple[dict[str, TierConfig], dict[str, str]]:
    """DEFAULT_TIERS with each [tiers.NAME] table over its tier (a new name starts from no limits),
    and the [tiers] settings (TIERS_SETTINGS) as the Config fields they set."""
    tables, settings = {}, {}
    for name, value in values.items():
        if name in TIERS_SETTINGS:
            if isinstance(value, dict):
                raise ValueError(f"a tier cannot be named {name!r}: [tiers] {name} is a setting (where the tiers' "
                                 f"buckets are kept, and what happens when they cannot be reached); name it otherwise")
            if not isinstance(value, str):
                raise ValueError(f"setting tiers.{name} must be str, got {value!r}")
            settings[TIERS_SETTINGS[name]] = value
        elif not TIER_NAME.fullmatch(name):
            raise ValueError(f"tier name {name!r} must be 1-32 lower-case letters, digits, '-' or '_'")
        else:
            tables[name] = value
    storage = settings.get("tiers_storage", "")
    if storage and not storage.startswith(TIERS_STORAGE):
        raise ValueError(f"setting tiers.storage must be empty or \"memory://\" (each replica's own buckets) or a Redis "
                         f"URL like \"redis://127.0.0.1:6379/0\" (shared by every replica), got {storage!r}")
    on_error = settings.get("tiers_on_storage_error", "open")
    if on_error not in FAILURE_MODES:
        raise ValueError(f"setting tiers.on_storage_error must be one of {', '.join(FAILURE_MODES)}, got {on_error!r}")
    tiers = _overlay(tables, DEFAULT_TIERS, TierConfig, lambda name: f"tiers.{name}", "{ requests_per_minute = 60 }")
    return tiers, settings


def _build_policies(values: dict[str, Any]) -> dict[str, CategoryPolicy]:
    """DEFAULT_POLICIES with each [policies."CATEGORY"] table over its category's policy (whether a
    category name is one the safety pipeline knows is checked when it starts: config knows no list)."""
    return _overlay(values, DEFAULT_POLICIES, CategoryPolicy, lambda name: f'policies."{name}"', '{ action = "block" }')


def _overlay(values: dict[str, Any], defaults: dict[str, Any], cls: type, where, example: str) -> dict[str, Any]:
    """`defaults` with each named table's settings over its entry (a new name starts from `cls()`);
    ValueError naming `where(name)` and the setting."""
    entries = dict(defaults)
    for name, table in values.items():
        if not isinstance(table, dict):
            raise ValueError(f"{where(name)} must be a table like {example}, got {table!r}")
        fields = _checked(where(name), cls, table)
        try:
            entries[name] = dataclasses.replace(entries.get(name, cls()), **fields)
        except ValueError as exc:
            raise ValueError(f"setting {where(name)}: {exc}") from None
    return entries


def load_config(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """Read config.toml (when given) and apply overrides (e.g. from command-line flags)."""
    values: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except FileNotFoundError:
            raise ValueError(f"config file {str(path)!r} does not exist") from None
        except (IsADirectoryError, PermissionError) as exc:
            raise ValueError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    for section, section_values in (overrides or {}).items():
        if section == "models":  # `chatd serve --model NAME=PATH ...`: these models, not the file's
            values["models"] = section_values
        else:
            values.setdefault(section, {}).update(section_values)
    return build_config(values)


def config_from_options(base: Config | None = None, **options: Any) -> Config:
    """Apply flat keyword options (`block_size=8`, `device="cpu"`) to the section that owns each;
    `speculative_config={"method": "ngram", ...}` sets [speculative] (its keys as vLLM's LLM takes them)."""
    base = base or Config()
    values: dict[str, Any] = {name: dataclasses.asdict(getattr(base, name)) for name in SECTIONS}
    values["prices"] = {model: dataclasses.asdict(price) for model, price in base.prices.items()}
    values["tiers"] = {name: dataclasses.asdict(tier) for name, tier in base.tiers.items()}
    values["tiers"].update({key: getattr(base, field) for key, field in TIERS_SETTINGS.items()})
    values["policies"] = {name: dataclasses.asdict(policy) for name, policy in base.policies.items()}
    owners = {f.name: name for name, cls in SECTIONS.items() if name != "speculative" for f in dataclasses.fields(cls)}
    speculative = options.pop("speculative_config", None) or {}
    unknown = set(speculative) - set(values["speculative"])
    if unknown:
        raise ValueError(f"unknown speculative_config key {sorted(unknown)[0]!r}; known: {', '.join(values['speculative'])}")
    values["speculative"].update(speculative)
    for key, value in options.items():
        if key not in owners:
            raise ValueError(f"unknown engine option {key!r}; known: {', '.join(sorted(owners))}")
        values[owners[key]][key] = value
    config = build_config(values)
    return dataclasses.replace(config, models=base.models, aliases=base.aliases) if base.models else config
