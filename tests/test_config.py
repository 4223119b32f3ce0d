"""config.toml documents every setting, and bad settings are refused by name."""

import dataclasses
import tomllib
from pathlib import Path

import pytest

from chatd.config import SECTIONS, Config, build_config, config_from_options, load_config

CONFIG_TOML = Path(__file__).parent.parent / "config.toml"


def test_config_toml_lists_every_setting_with_its_default_and_a_comment():
    lines = CONFIG_TOML.read_text().splitlines()
    shipped = tomllib.loads(CONFIG_TOML.read_text())
    defaults = Config()
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            assert field.name in shipped[section], f"{section}.{field.name} is not in config.toml"
            assert shipped[section][field.name] == getattr(getattr(defaults, section), field.name)
            at = next(i for i, line in enumerate(lines) if line.startswith(f"{field.name} ="))
            assert lines[at - 1].startswith("#"), f"{section}.{field.name} has no comment above it"
    assert load_config(CONFIG_TOML) == defaults


def test_unknown_and_mistyped_settings_are_named():
    with pytest.raises(ValueError, match="cache.blocksize"):
        build_config({"cache": {"blocksize": 8}})
    with pytest.raises(ValueError, match="scheduler.max_num_seqs must be int"):
        build_config({"scheduler": {"max_num_seqs": "many"}})
    with pytest.raises(ValueError, match="unknown engine option 'colour'"):
        config_from_options(colour="blue")


def test_options_land_in_their_sections():
    config = config_from_options(block_size=8, device="cpu", max_num_seqs=4)
    assert (config.cache.block_size, config.model.device, config.scheduler.max_num_seqs) == (8, "cpu", 4)
