"""QFedPolyp (docs/qfedpolyp.md): FedAvg in which every hospital trains quantisation-aware at its own
bit-width and uploads its model as b-bit packed integer codes; the server rebuilds each model from its
codes, refuses any payload that does not match what it assigned, and averages with weights n_k / N.

A hospital's bit-width comes from its node config (``bit-width``, reported when it joins) or else from
``qfedpolyp.bit-widths`` in hospital-name order; the server tells each hospital its bit-width with the
round config. The global model goes down as plain floats, or quantised at ``qfedpolyp.downlink-bit-width``.
"""

from __future__ import annotations

from typing import Any

import torch

from common.arrays import NamedArrays, load_model_arrays, model_arrays, weighted_average
from common.config import ConfigError
from common.quantization.codec import PayloadError, check_bit_width, decode_model, encode_model
from common.quantization.fake_quant import quantization_aware

from .base import (
    HospitalInfo,
    HospitalMethod,
    HospitalUpdate,
    Payload,
    RejectedUpdate,
    ServerMethod,
    pack_json,
    unpack_json,
)

PACKED = "packed-model"  #: the array group holding an encoded model, both ways
BIT_WIDTH_KEY = "qfedpolyp.bit-width"  #: round-config key: the uplink bit-width assigned to this hospital


def assign_bit_width(hospital: HospitalInfo, roster: list[str], widths: list[int]) -> int:
    """The hospital's own declaration (node config ``bit-width``) if it made one, else its entry of
    ``widths`` by its rank among ``roster``'s names (a single entry applies to every hospital)."""
    declared = hospital.properties.get("bit-width")
    if declared:
        return check_bit_width(declared, f"node config of {hospital.name} key 'bit-width'")
    if len(widths) == 1:
        return widths[0]
    names = sorted(set(roster) | {hospital.name})
    rank = names.index(hospital.name)
    if rank >= len(widths):
        raise ConfigError(f"qfedpolyp.bit-widths: lists {len(widths)} bit-widths, but {hospital.name} is hospital "
                          f"number {rank + 1} in name order ({', '.join(names)}); give one bit-width per hospital, "
                          f"a single value for all, or set 'bit-width' in that hospital's node config")
    return widths[rank]


class QFedPolypServer(ServerMethod):
    name = "qfedpolyp"

    def __init__(self, cfg, task=None):
        super().__init__(cfg, task)
        self.roster: list[str] = []
        self.assigned: dict[str, int] = {}  # this round's uplink bit-width per hospital
        self._decoded: dict[str, NamedArrays] = {}  # accepted replies, rebuilt by check()
        self._downlink_cache: tuple[int, NamedArrays] | None = None

    def check_hospital(self, hospital: HospitalInfo) -> None:
        """A declared bit-width must be one the codec has (a hostile 33 would fail the downlink)."""
        declared = hospital.properties.get("bit-width")
        if declared:
            check_bit_width(declared, f"hospital {hospital.name}: declared bit-width")

    def hospitals_available(self, rnd: int, hospitals: list[HospitalInfo]) -> None:
        """Every hospital ever seen keeps its rank, so one that drops out does not shift the others' bit-widths.
        Every connected hospital's bit-width is settled here, before any message goes out (ConfigError when
        ``bit-widths`` lists too few)."""
        self.roster = sorted(set(self.roster) | {h.name for h in hospitals})
        for hospital in hospitals:
            assign_bit_width(hospital, self.roster, self.cfg.qfedpolyp.bit_width_list)

    def downlink(self, rnd: int, hospital: HospitalInfo) -> Payload:
        bits = assign_bit_width(hospital, self.roster, self.cfg.qfedpolyp.bit_width_list)
        self.assigned[hospital.name] = bits
        if self._downlink_cache is None or self._downlink_cache[0] != rnd:  # one encoding per round
            self._downlink_cache = (rnd, encode_model(self.global_arrays, self.cfg.qfedpolyp.downlink_bit_width))
        return Payload(arrays={PACKED: self._downlink_cache[1]}, config={**self.round_config(rnd), BIT_WIDTH_KEY: bits})

    def check(self, update: HospitalUpdate) -> None:
        """Rebuild the reply from its codes; refuse it unless tag, lengths, names, shapes and values fit."""
        name = update.hospital.name
        if update.num_examples <= 0:
            raise RejectedUpdate(f"num-examples={update.payload.metrics.get('num-examples')!r} is not positive")
        if PACKED not in update.payload.arrays:
            raise RejectedUpdate(f"reply carries no '{PACKED}' arrays")
        try:
            self._decoded[name] = decode_model(update.payload.arrays[PACKED], reference=self.global_arrays,
                                               expected_bits=self.assigned.get(name))
        except PayloadError as error:
            raise RejectedUpdate(f"packed model refused: {error}") from None

    def screened_arrays(self, update: HospitalUpdate) -> tuple[NamedArrays, NamedArrays]:
        """The model rebuilt from the codes (a forged quantisation step shows up here, not in the codes)."""
        return self._decoded[update.hospital.name], self.global_arrays

    def aggregate(self, rnd: int, updates: list[HospitalUpdate]) -> dict[str, Any]:
        """FedAvg (paper eq. 9) of the rebuilt models, weighted by sample count."""
        models = [self._decoded.pop(u.hospital.name) for u in updates]
        self._decoded.clear()
        self.global_arrays = weighted_average(models, [u.weight for u in updates])
        return {"bit-widths": {u.hospital.name: self.assigned[u.hospital.name] for u in updates}}


    def state_dict(self) -> NamedArrays:
        return {**super().state_dict(), "roster": pack_json(self.roster)}

    def load_state_dict(self, state: NamedArrays) -> None:
        super().load_state_dict(state)
        self.roster = unpack_json(state["roster"]) if "roster" in state else []


class QFedPolypHospital(HospitalMethod):
    """Local quantisation-aware training (paper Algorithm 2) and the b-bit packed reply (Algorithm 3)."""

    def received_model(self, payload: Payload) -> torch.nn.Module:
        """The global model from the round's packed payload (checked against this hospital's model)."""
        self.task.adopt_spec(payload.config)
        model = self.task.build_model()
        arrays = decode_model(payload.arrays[PACKED], reference=model_arrays(model),
                              expected_bits=self.cfg.qfedpolyp.downlink_bit_width)
        load_model_arrays(model, arrays)
        return model

    def train(self, rnd: int, payload: Payload) -> Payload:
        bits = check_bit_width(payload.config.get(BIT_WIDTH_KEY), f"round config key {BIT_WIDTH_KEY!r}")
        model = self.received_model(payload)
        self.task.check_data(self.site.train, f"hospital {self.site.name}")
        received = self.task.evaluate(model, self.site.val, self.site.device)
        with quantization_aware(model, bits if self.cfg.qfedpolyp.qat else 32):
            stats = self.task.fit(model, self.site.train, self.site.device, self.site.round_seed(rnd))
        metrics = {"num-examples": len(self.site.train), "bit-width": bits, **stats}
        metrics.update({f"val-{k}": v for k, v in received.items() if k != "num-examples"})
        return Payload(arrays={PACKED: encode_model(model_arrays(model), bits)}, metrics=metrics)

    def evaluate(self, rnd: int, payload: Payload) -> dict[str, float]:
        return self.task.evaluate(self.received_model(payload), self.site.val, self.site.device)
