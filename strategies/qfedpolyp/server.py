"""QFedPolyp (docs/qfedpolyp.md): FedAvg in which every hospital trains quantisation-aware at its own
bit-width and uploads its model as b-bit packed integer codes; the server rebuilds each model from its
codes, refuses any payload that does not match what it assigned, and averages with weights n_k / N.

A hospital's bit-width comes from its node config (``bit-width``, reported when it joins) or else from
``qfedpolyp.bit-widths`` in hospital-name order; the server tells each hospital its bit-width with the
round config. The global model goes down as plain floats, or quantised at ``qfedpolyp.downlink-bit-width``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.arrays import ArraysMismatch, NamedArrays, check_like, weighted_average
from common.methods.base import (
    HospitalInfo,
    HospitalUpdate,
    Payload,
    RejectedUpdate,
    ServerMethod,
    pack_json,
    unpack_json,
)
from common.quantization.codec import PayloadError, check_bit_width, decode_model, encode_model

from .messages import BIT_WIDTH_KEY, PACKED, STATISTICS, assign_bit_width, is_statistic, split_statistics


class QFedPolypServer(ServerMethod):
    name = "qfedpolyp"

    def __init__(self, cfg, task=None):
        super().__init__(cfg, task)
        self.roster: list[str] = []
        self.assigned: dict[str, int] = {}  # this round's uplink bit-width per hospital
        self._decoded: dict[str, NamedArrays] = {}  # accepted replies as whole models, rebuilt by check()
        self._downlink: tuple[int, NamedArrays, NamedArrays] | None = None  # round, encoded, what hospitals decode

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

    def encoded_global(self, rnd: int) -> tuple[NamedArrays, NamedArrays]:
        """This round's downlink (encoded once per round at ``downlink-bit-width``) and the model hospitals
        rebuild from it, bit for bit: what their updates are measured from."""
        if self._downlink is None or self._downlink[0] != rnd:
            encoded = encode_model(self.global_arrays, self.cfg.qfedpolyp.downlink_bit_width)
            self._downlink = (rnd, encoded, decode_model(encoded, reference=self.global_arrays))
        return self._downlink[1], self._downlink[2]

    def downlink(self, rnd: int, hospital: HospitalInfo) -> Payload:
        bits = assign_bit_width(hospital, self.roster, self.cfg.qfedpolyp.bit_width_list)
        self.assigned[hospital.name] = bits
        encoded, _ = self.encoded_global(rnd)
        return Payload(arrays={PACKED: encoded}, config={**self.round_config(rnd), BIT_WIDTH_KEY: bits})

    def check(self, update: HospitalUpdate) -> None:
        """Rebuild the reply from its codes; refuse it unless tag, content, lengths, names, shapes and values fit."""
        name = update.hospital.name
        if PACKED not in update.payload.arrays:
            raise RejectedUpdate(f"reply carries no '{PACKED}' arrays")
        try:
            if self.cfg.qfedpolyp.quantise == "weights":
                self._decoded[name] = decode_model(update.payload.arrays[PACKED], reference=self.global_arrays,
                                                   expected_bits=self.assigned.get(name), expected_content="weights")
            else:
                self._decoded[name] = self.rebuild_from_update(update)
        except (PayloadError, ArraysMismatch) as error:
            raise RejectedUpdate(f"packed model refused: {error}") from None

    def rebuild_from_update(self, update: HospitalUpdate) -> NamedArrays:
        """The hospital's model: what it received plus its decoded update, with its BatchNorm statistics."""
        received = self.received_by_hospitals()
        weights, statistics = split_statistics(received)
        change = decode_model(update.payload.arrays[PACKED], reference=weights,
                              expected_bits=self.assigned.get(update.hospital.name), expected_content="update")
        sent_statistics = update.payload.arrays.get(STATISTICS, {})
        check_like(sent_statistics, statistics, f"'{STATISTICS}' of {update.hospital.name}", exact_dtype=True)
        rebuilt = {k: (v.astype(np.float64) + change[k]).astype(v.dtype) for k, v in weights.items()}
        return {k: rebuilt[k] if k in rebuilt else sent_statistics[k] for k in received}

    def received_by_hospitals(self) -> NamedArrays:
        """The model this round's hospitals rebuilt from the downlink (the global model at 32 bits)."""
        return self._downlink[2] if self._downlink is not None else self.global_arrays

    def screened_arrays(self, update: HospitalUpdate) -> tuple[NamedArrays, NamedArrays]:
        """The model rebuilt from the codes (a forged quantisation step shows up here, not in the codes), against
        what the hospital received."""
        return self._decoded[update.hospital.name], self.received_by_hospitals()

    def aggregate(self, rnd: int, updates: list[HospitalUpdate]) -> dict[str, Any]:
        """FedAvg (paper eq. 9) of the rebuilt models, weighted by sample count. With updates, the weighted mean
        update is added to the server's own global model, so the downlink's quantisation error is not lost
        but sent again next round."""
        models = [self._decoded.pop(u.hospital.name) for u in updates]
        self._decoded.clear()
        average = weighted_average(models, [u.weight for u in updates])
        if self.cfg.qfedpolyp.quantise == "update":
            received = self.received_by_hospitals()
            average = {k: (self.global_arrays[k].astype(np.float64) + average[k] - received[k]).astype(v.dtype)
                       if not is_statistic(k) else average[k] for k, v in self.global_arrays.items()}
        self.global_arrays = average
        return {"bit-widths": {u.hospital.name: self.assigned[u.hospital.name] for u in updates}}


    def state_dict(self) -> NamedArrays:
        return {**super().state_dict(), "roster": pack_json(self.roster)}

    def load_state_dict(self, state: NamedArrays) -> None:
        super().load_state_dict(state)
        self.roster = unpack_json(state["roster"]) if "roster" in state else []
