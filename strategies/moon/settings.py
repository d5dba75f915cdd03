"""MOON's settings: the ``[moon]`` run-config table and ``MoonStrategy``'s own arguments."""

from __future__ import annotations

from pydantic import Field

from common.settings import Section


class MoonSettings(Section):
    mu: float = Field(1.0, ge=0.0, description="Weight of MOON's model-contrastive term.")
    temperature: float = Field(0.5, gt=0.0, description="Temperature of the cosine similarities.")
