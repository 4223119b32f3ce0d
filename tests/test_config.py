"""config.toml documents every setting, and bad settings are refused by name."""

import dataclasses
import tomllib
from pathlib import Path

import pytest

from chatd.config import (
    DEFAULT_POLICIES,
    DEFAULT_TIERS,
    SECTIONS,
    CategoryPolicy,
    Config,
    TierConfig,
)
from chatd.config_loader import build_config, config_from_options, load_config

CONFIG_TOML = Path(__file__).parent.parent / "config.toml"


def test_config_toml_lists_every_setting_with_its_default_and_a_comment():
    lines = CONFIG_TOML.read_text().splitlines()
    shipped = tomllib.loads(CONFIG_TOML.read_text())
    defaults = Config()
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            assert field.name in shipped[section], f"{section}.{field.name} is not in config.toml"
            shipped_value = shipped[section][field.name]
            if isinstance(shipped_value, list):  # TOML arrays are tuples in the frozen config
                shipped_value = tuple(shipped_value)
            assert shipped_value == getattr(getattr(defaults, section), field.name)
            at = next(i for i, line in enumerate(lines) if line.startswith(f"{field.name} ="))
            assert lines[at - 1].startswith("#"), f"{section}.{field.name} has no comment above it"
    assert load_config(CONFIG_TOML) == defaults


def test_config_toml_shows_the_shipped_policies_category_by_category():
    shipped = tomllib.loads(CONFIG_TOML.read_text())["policies"]
    assert set(shipped) == set(DEFAULT_POLICIES)
    for name, policy in shipped.items():
        assert set(policy) == {f.name for f in dataclasses.fields(CategoryPolicy)}, name
    assert load_config(CONFIG_TOML).policies == DEFAULT_POLICIES


@pytest.mark.parametrize("policies, message", [
    ({"hate": {"action": "ban"}}, 'policies."hate": action must be one of block, flag, redact'),
    ({"hate": {"failure": "maybe"}}, 'policies."hate": failure must be one of open, closed'),
    ({"hate": {"severity": 3}}, 'unknown setting policies."hate".severity'),
    ({"hate": {"tiers": "free"}}, 'policies."hate".tiers must be a list of strings'),
    ({"hate": "block"}, 'policies."hate" must be a table'),
])
def test_bad_policies_are_refused_naming_the_setting(policies, message):
    with pytest.raises(ValueError) as error:
        build_config({"policies": policies})
    assert message in str(error.value)


def test_a_policy_table_changes_only_what_it_lists():
    config = build_config({"policies": {"violence": {"action": "block"}, "sexual": {"tiers": ["free"]}}})
    assert config.policies["violence"] == CategoryPolicy("block", "open")
    assert config.policies["sexual"] == CategoryPolicy("block", "open", ("free",))
    assert config.policies["hate"] == DEFAULT_POLICIES["hate"]


def test_unknown_and_mistyped_settings_are_named():
    with pytest.raises(ValueError, match="cache.blocksize"):
        build_config({"cache": {"blocksize": 8}})
    with pytest.raises(ValueError, match="scheduler.max_num_seqs must be int"):
        build_config({"scheduler": {"max_num_seqs": "many"}})
    with pytest.raises(ValueError, match="cache.prefix_cache_scope must be one of tenant, global"):
        build_config({"cache": {"prefix_cache_scope": "everyone"}})
    with pytest.raises(ValueError, match="cache.shared_system_prompts must be a list of strings"):
        build_config({"cache": {"shared_system_prompts": "Be brief."}})
    with pytest.raises(ValueError, match="store.replica_timeout_seconds must be more than 0"):
        build_config({"store": {"replica_timeout_seconds": 0.0}})  # its heartbeat would never sleep
    with pytest.raises(ValueError, match="unknown engine option 'colour'"):
        config_from_options(colour="blue")


def test_setting_names_are_unique_across_sections():
    # Flat engine options (`LLM(path, block_size=8)`) find their section by name alone; [speculative]
    # is set as a whole (`speculative_config={...}`, vLLM's names), so its names may repeat others'.
    names = [f.name for section, cls in SECTIONS.items() if section != "speculative" for f in dataclasses.fields(cls)]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_options_land_in_their_sections():
    config = config_from_options(block_size=8, device="cpu", max_num_seqs=4)
    assert (config.cache.block_size, config.model.device, config.scheduler.max_num_seqs) == (8, "cpu", 4)


def test_prices_are_per_model_and_cached_tokens_may_have_their_own(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[prices.demo]\ninput = 2\ncached_input = 0.5\noutput = 8\n\n[prices."Qwen/Qwen3-8B"]\ninput = 1.0\noutput = 3.0\n')
    config = load_config(path)
    assert config.price("demo").cost(1000, 400, 100) == pytest.approx((600 * 2 + 400 * 0.5 + 100 * 8) / 1e6)
    assert config.price("Qwen/Qwen3-8B").cost(1000, 400, 100) == pytest.approx((1000 * 1.0 + 100 * 3.0) / 1e6)
    assert config.price("unlisted").cost(1000, 400, 100) == 0.0
    with pytest.raises(ValueError, match="prices.demo.inptu"):
        build_config({"prices": {"demo": {"inptu": 1.0}}})
    with pytest.raises(ValueError, match="prices.demo.output must be a number"):
        build_config({"prices": {"demo": {"output": "cheap"}}})


def test_allowed_origins_are_origins_or_a_star():
    config = build_config({"server": {"allowed_origins": ["https://chat.example.com", "http://localhost:5173", "*"]}})
    assert config.server.allowed_origins == ("https://chat.example.com", "http://localhost:5173", "*")
    assert Config().server.allowed_origins == ()  # off by default
    for bad in ("https://chat.example.com/", "chat.example.com", "https://chat.example.com/app", "", "null"):
        with pytest.raises(ValueError, match="server.allowed_origins takes origins like"):
            build_config({"server": {"allowed_origins": [bad]}})
    with pytest.raises(ValueError, match="server.allowed_origins must be a list of strings"):
        build_config({"server": {"allowed_origins": "https://chat.example.com"}})


def test_config_toml_shows_the_shipped_tiers_field_by_field():
    shipped = tomllib.loads(CONFIG_TOML.read_text())["tiers"]
    assert shipped.pop("storage") == "" and shipped.pop("on_storage_error") == "open"  # [tiers]'s own settings
    assert set(shipped) == set(DEFAULT_TIERS)
    for name, tier in DEFAULT_TIERS.items():
        assert set(shipped[name]) == {f.name for f in dataclasses.fields(TierConfig)}, name
    assert load_config(CONFIG_TOML).tiers == DEFAULT_TIERS


def test_a_tier_table_changes_only_what_it_lists_and_a_new_tier_starts_unlimited():
    config = build_config({"tiers": {"free": {"requests_per_minute": 5}, "gold": {"priority": 5, "models": ["a"]}}})
    assert config.tiers["free"] == dataclasses.replace(DEFAULT_TIERS["free"], requests_per_minute=5)
    assert config.tiers["paid"] == DEFAULT_TIERS["paid"]
    assert config.tiers["gold"] == TierConfig(priority=5, models=("a",))
    assert config_from_options(config, block_size=8).tiers == config.tiers  # options keep the tiers


@pytest.mark.parametrize("tiers, message", [
    ({"free": {"rpm": 5}}, "unknown setting tiers.free.rpm"),
    ({"free": {"requests_per_minute": "lots"}}, "tiers.free.requests_per_minute must be int"),
    ({"free": {"requests_per_minute": -1}}, "tiers.free: requests_per_minute must be 0"),
    ({"free": {"weight": 0}}, "tiers.free: weight must be more than 0"),
    ({"free": {"limit_per": "ip"}}, "tiers.free: limit_per must be one of tenant, key"),
    ({"Gold!": {}}, "tier name 'Gold!'"),
    ({"free": 3}, "tiers.free must be a table"),
])
def test_bad_tiers_are_refused_naming_the_setting(tiers, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        build_config({"tiers": tiers})


def test_the_local_user_s_tier_must_be_defined():
    with pytest.raises(ValueError, match="auth.local_tier names tier 'gold', which is not defined"):
        build_config({"auth": {"local_tier": "gold"}})
    assert build_config({"auth": {"local_tier": "gold"}, "tiers": {"gold": {}}}).auth.local_tier == "gold"


def test_tiers_storage_and_on_storage_error_are_settings_of_tiers_beside_its_tables():
    config = build_config({"tiers": {"storage": "redis://127.0.0.1:6379/0", "on_storage_error": "closed",
                                     "free": {"requests_per_minute": 5}}})
    assert (config.tiers_storage, config.tiers_on_storage_error) == ("redis://127.0.0.1:6379/0", "closed")
    assert set(config.tiers) == set(DEFAULT_TIERS) and config.tiers["free"].requests_per_minute == 5
    assert (Config().tiers_storage, Config().tiers_on_storage_error) == ("", "open")  # each replica's own buckets
    assert config_from_options(config, block_size=8).tiers_storage == config.tiers_storage  # options keep them


@pytest.mark.parametrize("tiers, message", [
    ({"storage": {"requests_per_minute": 5}}, "a tier cannot be named 'storage': [tiers] storage is a setting"),
    ({"on_storage_error": {}}, "a tier cannot be named 'on_storage_error'"),
    ({"storage": "http://cache:6379"}, 'tiers.storage must be empty or "memory://"'),
    ({"storage": 6379}, "setting tiers.storage must be str"),
    ({"on_storage_error": "maybe"}, "tiers.on_storage_error must be one of open, closed, got 'maybe'"),
])
def test_bad_tiers_settings_are_refused_naming_the_setting(tiers, message):
    with pytest.raises(ValueError) as error:
        build_config({"tiers": tiers})
    assert message in str(error.value)
