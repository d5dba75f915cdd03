"""QFedPolyp (docs/qfedpolyp.md): FedAvg in which every hospital trains quantisation-aware at its own
bit-width and uploads its model as b-bit packed integer codes; the server rebuilds each model from its
codes, refuses any payload that does not match what it assigned, and averages with weights n_k / N.

A hospital's bit-width comes from its node config (``bit-width``, reported when it joins) or else from
``qfedpolyp.bit-widths`` in hospital-name order; the server tells each hospital its bit-width with the
round config. The global model goes down as plain floats, or quantised at ``qfedpolyp.downlink-bit-width``;
or (``qfedpolyp.downlink='delta'``) as the change of the model the hospitals hold, which the server records
bit for bit (``held``): what a delta does not carry stays in ``global - held`` and goes down later, and a
hospital not known to hold the model a delta applies to gets the full held model instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.arrays import ArraysMismatch, NamedArrays, weighted_average
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
from common.quantization.low_rank import decode_low_rank, encode_low_rank
from common.quantization.sparse import decode_sparse, encode_sparse

from .messages import (
    BIT_WIDTH_KEY,
    DOWNLINK_BASE_KEY,
    DOWNLINK_DIGEST_KEY,
    DOWNLINK_ROUND_KEY,
    PACKED,
    STATISTICS,
    apply_delta,
    assign_bit_width,
    is_statistic,
    model_digest,
    pack_statistics,
    split_statistics,
    unpack_statistics,
)


class QFedPolypServer(ServerMethod):
    name = "qfedpolyp"

    def __init__(self, cfg, task=None):
        super().__init__(cfg, task)
        self.roster: list[str] = []
        self.assigned: dict[str, int] = {}  # this round's uplink bit-width per hospital
        self._decoded: dict[str, NamedArrays] = {}  # the reply being screened as a whole model, rebuilt by check()
        self._downlink: tuple[int, NamedArrays, NamedArrays] | None = None  # round, encoded, what hospitals decode
        # downlink='delta': the model the hospitals hold, as they rebuild it, and the round whose downlink made it
        self.held: NamedArrays = {}
        self.held_round = 0
        self.holders: dict[str, int] = {}  # hospital -> round of the held model its reply showed it rebuilt
        self._delta: tuple[int, int, NamedArrays] | None = None  # round, the round it applies to, encoded delta
        self._full: NamedArrays | None = None  # the held model's weights at 32 bits, for hospitals without a base
        self._statistics: NamedArrays = {}  # the held model's BatchNorm statistics, encoded as they travel
        self._digest = ""
        self._sent: dict[str, int] = {}  # this round: the base each hospital's downlink applied to (0: full model)
        # sparse and low-rank updates: bytes of header, rows of ranges, bytes of data
        self._uplink_arrays: dict[str, list[int]] = {}

    def check_hospital(self, hospital: HospitalInfo) -> None:
        """A declared bit-width must be one the codec has for what hospitals send (a hostile 33 would fail the
        downlink; 1 bit cannot carry weights)."""
        declared = hospital.properties.get("bit-width")
        if declared:
            sends = "weights" if self.cfg.qfedpolyp.quantise == "weights" else "update"
            check_bit_width(declared, f"hospital {hospital.name}: declared bit-width", content=sends)

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
        config = {**self.round_config(rnd), BIT_WIDTH_KEY: bits}
        if self.cfg.qfedpolyp.downlink == "delta":
            arrays, extra = self.delta_downlink(rnd, hospital.name)
            return Payload(arrays=arrays, config={**config, **extra})
        encoded, _ = self.encoded_global(rnd)
        return Payload(arrays={PACKED: encoded}, config=config)

    # --- downlink='delta' -------------------------------------------------------------------------
    def advance_held(self, rnd: int) -> None:
        """Once per round: the model hospitals will hold after round ``rnd``'s downlink. The first time it is the
        global model itself; after that the held model plus the delta ``global - held`` as it travels (at
        ``downlink-bit-width``, ``downlink-sparsity``), decoded from its bytes exactly as a hospital decodes it.
        What the delta leaves out stays in ``global - held``: the server's error feedback."""
        if rnd == self.held_round:
            return
        if rnd < self.held_round:
            raise RuntimeError(f"downlink of round {rnd} asked for after round {self.held_round}'s was built")
        settings = self.cfg.qfedpolyp
        weights, statistics = split_statistics(self.global_arrays)
        if not self.held:
            held_weights, self._delta = {k: v.copy() for k, v in weights.items()}, None
        else:
            base, _ = split_statistics(self.held)
            change = {k: (v.astype(np.float64) - base[k]).astype(v.dtype) for k, v in weights.items()}
            if settings.downlink_low_rank_bits:
                bits, budget = settings.downlink_bit_width, settings.downlink_low_rank_bits
                encoded = encode_low_rank(change, bits, budget, content="delta")
                delta = decode_low_rank(encoded, base, bits, budget, expected_content="delta")
            else:
                encoded = encode_sparse(change, settings.downlink_bit_width, settings.downlink_sparsity,
                                        settings.sparsify, seed=(self.cfg.seed, rnd), content="delta",
                                        block=settings.sparse_block)
                delta = decode_sparse(encoded, reference=base)
            held_weights = apply_delta(base, delta)
            self._delta = (rnd, self.held_round, encoded)
        # the statistics as they travel (at statistics-bit-width), decoded as hospitals decode them
        self._statistics = pack_statistics(statistics, settings.statistics_bit_width)
        statistics = decode_model(self._statistics, reference=statistics)
        self.held = {k: held_weights[k] if k in held_weights else statistics[k] for k in self.global_arrays}
        self.held_round, self._full, self._sent = rnd, None, {}
        self._digest = model_digest(self.held)

    def delta_downlink(self, rnd: int, name: str) -> tuple[dict[str, NamedArrays], dict[str, int | str]]:
        """What ``name`` receives in round ``rnd``: the round's delta if its last reply showed it holds the model the
        delta applies to, else the full held model at 32 bits; the BatchNorm statistics either way."""
        self.advance_held(rnd)
        weights, _ = split_statistics(self.held)
        if self._delta is not None and self._delta[0] == rnd and self.holders.get(name) == self._delta[1]:
            packed, base = self._delta[2], self._delta[1]
        else:
            if self._full is None:
                self._full = encode_model(weights, 32)
            packed, base = self._full, 0
        self._sent[name] = base
        return ({PACKED: packed, STATISTICS: self._statistics},
                {DOWNLINK_BASE_KEY: base, DOWNLINK_ROUND_KEY: self.held_round, DOWNLINK_DIGEST_KEY: self._digest})

    def check(self, update: HospitalUpdate) -> None:
        """Rebuild the reply from its codes; refuse it unless tag, content, lengths, names, shapes and values fit."""
        name = update.hospital.name
        if self.cfg.qfedpolyp.downlink == "delta" and self.held_round:
            self.holders[name] = self.held_round  # it answered this round: it rebuilt (and saved) the held model
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
        packed, bits = update.payload.arrays[PACKED], self.assigned.get(update.hospital.name)
        sparsity, budget = self.cfg.qfedpolyp.sparsity, self.cfg.qfedpolyp.low_rank_bits
        if sparsity < 1.0 or budget:
            if budget:
                change = decode_low_rank(packed, weights, check_bit_width(bits, content="update"), budget)
            else:
                change = decode_sparse(packed, reference=weights, expected_bits=bits, expected_content="update",
                                       expected_sparsity=sparsity, expected_block=self.cfg.qfedpolyp.sparse_block)
            self._uplink_arrays[update.hospital.name] = [int(packed["header"].size), int(packed["ranges"].shape[0]),
                                                         int(packed["data"].size)]
        else:
            change = decode_model(packed, reference=weights, expected_bits=bits, expected_content="update")
        sent_statistics = unpack_statistics(update.payload.arrays, statistics, self.cfg.qfedpolyp.statistics_bit_width,
                                            f"the reply of {update.hospital.name}")
        rebuilt = {k: (v.astype(np.float64) + change[k]).astype(v.dtype) for k, v in weights.items()}
        return {k: rebuilt[k] if k in rebuilt else sent_statistics[k] for k in received}

    def received_by_hospitals(self) -> NamedArrays:
        """The model this round's hospitals rebuilt from the downlink (the global model at 32 bits)."""
        if self.cfg.qfedpolyp.downlink == "delta" and self.held:
            return self.held
        return self._downlink[2] if self._downlink is not None else self.global_arrays

    def screened_arrays(self, update: HospitalUpdate) -> tuple[NamedArrays, NamedArrays]:
        """The model rebuilt from the codes (a forged quantisation step shows up here, not in the codes), against
        what the hospital received."""
        return self._decoded[update.hospital.name], self.received_by_hospitals()

    def reply_arrays(self, update: HospitalUpdate) -> dict[str, NamedArrays]:
        """The model rebuilt from the reply's codes, as ``model``: what is aggregated (the codes are released with
        the reply, so the server rebuilds one reply at a time and keeps no hospital's model in memory)."""
        decoded = self._decoded.pop(update.hospital.name, None)
        return {"model": decoded} if decoded is not None else {}

    def aggregate(self, rnd: int, updates: list[HospitalUpdate]) -> dict[str, Any]:
        """FedAvg (paper eq. 9) of the rebuilt models, weighted by sample count. With updates, the weighted mean
        update (times ``server-learning-rate``) is added to the server's own global model, so the downlink's
        quantisation error is not lost but sent again next round."""
        models = [u.payload.arrays["model"] for u in updates]
        self._decoded.clear()
        average = weighted_average(models, [u.weight for u in updates])
        if self.cfg.qfedpolyp.quantise == "update":
            received, rate = self.received_by_hospitals(), self.cfg.qfedpolyp.server_learning_rate

            def moved(k: str) -> np.ndarray:
                base = self.global_arrays[k].astype(np.float64)
                if rate == 1.0:  # FedAvg's sum, bit for bit as the earlier rows were measured
                    return base + average[k] - received[k]
                return base + rate * (average[k].astype(np.float64) - received[k])

            average = {k: moved(k).astype(v.dtype) if not is_statistic(k) else average[k]
                       for k, v in self.global_arrays.items()}
        self.global_arrays = average
        record: dict[str, Any] = {"bit-widths": {u.hospital.name: self.assigned[u.hospital.name] for u in updates}}
        if self._uplink_arrays:  # each sparse or low-rank update's arrays' sizes (the benchmark rebuilds its messages)
            record["uplink-arrays"] = {u.hospital.name: self._uplink_arrays[u.hospital.name] for u in updates
                                       if u.hospital.name in self._uplink_arrays}
            self._uplink_arrays = {}
        if self.cfg.qfedpolyp.downlink == "delta":
            record["downlink-base"] = dict(self._sent)  # per hospital: the round its delta applied to, 0: full model
            if self._delta is not None and self._delta[0] == self.held_round:
                encoded = self._delta[2]
                record["downlink-arrays"] = [int(encoded["header"].size), int(encoded["ranges"].shape[0]),
                                             int(encoded["data"].size)]
        return record

    def state_dict(self) -> NamedArrays:
        """The global model and the roster; with ``downlink='delta'`` also the held model and its round, so a resumed
        server builds the next delta from exactly the model hospitals hold. Which hospital holds it is not kept: a
        resumed server cannot know what hospitals kept through the interruption, so its first round sends each one
        the full held model (the models are the same as without the interruption; only those bytes differ)."""
        state = {**super().state_dict(), "roster": pack_json(self.roster)}
        if self.held:
            state.update({f"held/{k}": v for k, v in self.held.items()})
            state.update({f"held-statistics/{k}": v for k, v in self._statistics.items()})  # as sent, bit for bit
            state["held-round"] = np.array(self.held_round, dtype=np.int64)
        return state

    def load_state_dict(self, state: NamedArrays) -> None:
        super().load_state_dict(state)
        self.roster = unpack_json(state["roster"]) if "roster" in state else []
        self.held = {k.removeprefix("held/"): v for k, v in state.items() if k.startswith("held/")}
        self.held_round = int(state["held-round"]) if self.held and "held-round" in state else 0
        self._statistics = {k.removeprefix("held-statistics/"): v for k, v in state.items()
                            if k.startswith("held-statistics/")}
        self.holders, self._delta, self._full, self._sent = {}, None, None, {}
        self._digest = model_digest(self.held) if self.held else ""
