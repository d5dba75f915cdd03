"""The base of every settings table: the run config's core keys (``common.config``), each method's own table
(``strategies/<method>/settings.py``) and a hospital's node config.

Kept apart from ``common.config`` so that a method's settings module can be imported by the config that lists it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A run or node configuration that cannot work; the message names the key at fault."""


def hyphenated(name: str) -> str:
    """A field's run-config spelling: ``fdl_weight`` -> ``fdl-weight``."""
    return name.replace("_", "-")


class Section(BaseModel):
    """Base for every config table: hyphenated keys, unknown keys refused, values checked on assignment."""

    model_config = ConfigDict(
        alias_generator=hyphenated, populate_by_name=True, extra="forbid", validate_assignment=True, strict=True,
        allow_inf_nan=False,  # a learning rate or timeout of inf/nan is a typo, not a setting
    )
