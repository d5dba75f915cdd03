"""FedProto's settings: the ``[fedproto]`` run-config table and ``FedProtoStrategy``'s own argument."""

from __future__ import annotations

from pydantic import Field

from common.settings import Section


class FedProtoSettings(Section):
    proto_weight: float = Field(1.0, ge=0.0,
                                description="lambda: weight of MSE(feature, global prototype of its class).")
