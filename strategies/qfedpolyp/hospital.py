"""QFedPolyp's hospital half: local quantisation-aware training (paper Algorithm 2) and the b-bit packed reply
(Algorithm 3), or its round's update at b bits (optionally sparse; 1 bit: signs) with error feedback; the global
model received whole, or (``downlink='delta'``) rebuilt from the model it holds and the server's delta."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from common.arrays import ArraysMismatch, NamedArrays, check_like, load_model_arrays, model_arrays
from common.methods.base import HospitalMethod, Payload
from common.quantization.codec import PayloadError, check_bit_width, decode_model, encode_model
from common.quantization.fake_quant import quantization_aware
from common.quantization.low_rank import decode_low_rank, encode_low_rank
from common.quantization.sparse import decode_sparse, encode_sparse

from .messages import (
    BIT_WIDTH_KEY,
    DOWNLINK_BASE_KEY,
    DOWNLINK_DIGEST_KEY,
    DOWNLINK_ROUND_KEY,
    HELD_PREFIX,
    HELD_ROUND,
    PACKED,
    STATISTICS,
    apply_delta,
    model_digest,
    pack_statistics,
    split_statistics,
    unpack_statistics,
)


def _round_number(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 0:
        raise PayloadError(f"round config key {key!r} is {value!r}, not a round number")
    return int(value)


def with_residual(arrays: NamedArrays, residual: dict[str, np.ndarray]) -> NamedArrays:
    """``arrays`` plus the error-feedback residual where it has an entry of the same shape (float64 sums cast back
    to each array's dtype); the BatchNorm statistics and anything else the residual lacks are left as they are."""
    return {name: (value.astype(np.float64) + residual[name]).astype(value.dtype)
            if name in residual and residual[name].shape == value.shape else value
            for name, value in arrays.items()}


class QFedPolypHospital(HospitalMethod):
    """Local quantisation-aware training (paper Algorithm 2) and the b-bit packed reply (Algorithm 3)."""

    def remembers(self) -> bool:
        """Whether this hospital keeps state between rounds: an error-feedback residual or the model it holds."""
        return self.cfg.qfedpolyp.error_feedback or self.cfg.qfedpolyp.downlink == "delta"

    def memory(self, rnd: int) -> dict[str, np.ndarray]:
        return (self.site.state.load(before_round=rnd) or {}) if self.remembers() else {}

    def received_model(self, payload: Payload, memory: dict[str, np.ndarray] | None = None) -> torch.nn.Module:
        """The global model from the round's packed payload (checked against this hospital's model)."""
        self.task.adopt_spec(payload.config)
        model = self.task.build_model()
        if memory is None:
            memory = self.memory(int(payload.config.get("server-round", 0) or 0))
        load_model_arrays(model, self.received_arrays(payload, model_arrays(model), memory))
        return model

    def received_arrays(self, payload: Payload, reference: NamedArrays, memory: dict[str, np.ndarray]) -> NamedArrays:
        """The model the downlink stands for. ``downlink='delta'``: the full held model (base 0), or the model this
        hospital holds (its state folder) plus the delta; either way its digest must be the server's record's."""
        settings = self.cfg.qfedpolyp
        if settings.downlink == "model":
            return decode_model(payload.arrays[PACKED], reference=reference,
                                expected_bits=settings.downlink_bit_width, expected_content="weights")
        weights_reference, statistics_reference = split_statistics(reference)
        base = _round_number(payload.config.get(DOWNLINK_BASE_KEY), DOWNLINK_BASE_KEY)
        _round_number(payload.config.get(DOWNLINK_ROUND_KEY), DOWNLINK_ROUND_KEY)
        statistics = unpack_statistics(payload.arrays, statistics_reference, settings.statistics_bit_width,
                                       "the downlink")
        if base == 0:
            weights = decode_model(payload.arrays[PACKED], reference=weights_reference, expected_bits=32,
                                   expected_content="weights")
        else:
            holds = int(memory[HELD_ROUND]) if HELD_ROUND in memory else None
            if holds != base:
                raise PayloadError(f"the downlink is a change of round {base}'s model, but this hospital holds "
                                   f"{'no model' if holds is None else f'round {holds}s'} (its state folder); the "
                                   "server sends it the full model next round")
            held = {k.removeprefix(HELD_PREFIX): v for k, v in memory.items() if k.startswith(HELD_PREFIX)}
            try:
                check_like(held, weights_reference, "the model this hospital holds", exact_dtype=True)
            except ArraysMismatch as error:
                raise PayloadError(str(error)) from None
            if settings.downlink_low_rank_bits:
                delta = decode_low_rank(payload.arrays[PACKED], weights_reference, settings.downlink_bit_width,
                                        settings.downlink_low_rank_bits, expected_content="delta")
            else:
                delta = decode_sparse(payload.arrays[PACKED], reference=weights_reference,
                                      expected_bits=settings.downlink_bit_width, expected_content="delta",
                                      expected_sparsity=settings.downlink_sparsity,
                                      expected_block=settings.sparse_block)
            weights = apply_delta({k: held[k] for k in weights_reference}, delta)
        arrays = {k: weights[k] if k in weights else statistics[k] for k in reference}
        if model_digest(arrays) != payload.config.get(DOWNLINK_DIGEST_KEY):
            raise PayloadError(f"the model rebuilt from the downlink (base round {base}) is not the one the server "
                               "recorded (digest differs)")
        return arrays

    def train(self, rnd: int, payload: Payload) -> Payload:
        sends = "weights" if self.cfg.qfedpolyp.quantise == "weights" else "update"
        bits = check_bit_width(payload.config.get(BIT_WIDTH_KEY), f"round config key {BIT_WIDTH_KEY!r}", sends)
        memory = self.memory(rnd)
        model = self.received_model(payload, memory)
        start = model_arrays(model)
        self.task.check_data(self.site.train, f"hospital {self.site.name}")
        received = self.task.evaluate(model, self.site.val, self.site.device)
        if self.cfg.qfedpolyp.train_from == "own":  # go on from the model its unsent residual makes
            load_model_arrays(model, with_residual(start, memory))
        # QAT trains the weights the paper sends at b bits; an update is quantised after full-precision training
        weights_sent = self.cfg.qfedpolyp.quantise == "weights"
        with quantization_aware(model, bits if self.cfg.qfedpolyp.qat and weights_sent else 32):
            stats = self.task.fit(model, self.site.train, self.site.device, self.site.round_seed(rnd))
        metrics = {"num-examples": len(self.site.train), "bit-width": bits, **stats}
        metrics.update({f"val-{k}": v for k, v in received.items() if k != "num-examples"})
        keep: dict[str, np.ndarray] = {}
        if weights_sent:
            arrays = {PACKED: encode_model(model_arrays(model), bits)}
        else:
            arrays, keep = self.encoded_update(rnd, start, model_arrays(model), bits, memory)
        if self.cfg.qfedpolyp.downlink == "delta":  # the model it received, which the next delta will change
            keep.update({HELD_PREFIX + k: v for k, v in split_statistics(start)[0].items()})
            keep[HELD_ROUND] = np.array(payload.config[DOWNLINK_ROUND_KEY], dtype=np.int64)
        if keep:
            self.site.state.save(rnd, keep)
        return Payload(arrays=arrays, metrics=metrics)

    def encoded_update(self, rnd: int, start: NamedArrays, trained: NamedArrays, bits: int,
                       memory: dict[str, np.ndarray]) -> tuple[dict[str, NamedArrays], NamedArrays]:
        """The round's update at ``bits`` bits (``sparsity < 1``: only that fraction of each tensor's entries;
        ``low-rank-bits``: low-rank factors) and
        the BatchNorm statistics as floats; with error feedback also the new residual. What quantisation and
        sparsification lost last time (``memory``, the state folder) is added first and what they lose now is
        returned to be kept, so a restarted SuperNode or a resumed run carries on with exactly the same residual."""
        settings = self.cfg.qfedpolyp
        weights, statistics = split_statistics(trained)
        change = {k: v.astype(np.float64) - start[k] for k, v in weights.items()}
        feedback = settings.error_feedback
        if feedback and settings.train_from == "received":  # with 'own' training started from it
            change = with_residual(change, memory)
        change = {k: v.astype(weights[k].dtype) for k, v in change.items()}
        if settings.low_rank_bits:
            encoded = encode_low_rank(change, bits, settings.low_rank_bits)
            sent = decode_low_rank(encoded, change, bits, settings.low_rank_bits) if feedback else {}
        elif settings.sparsity < 1.0:
            encoded = encode_sparse(change, bits, settings.sparsity, settings.sparsify,
                                    seed=self.site.round_seed(rnd), content="update", block=settings.sparse_block)
            sent = decode_sparse(encoded, reference=change) if feedback else {}
        else:
            encoded = encode_model(change, bits, content="update")
            sent = decode_model(encoded, reference=change) if feedback else {}
        residual = {k: (v.astype(np.float64) - sent[k]).astype(v.dtype) for k, v in change.items()} if feedback else {}
        return {PACKED: encoded, STATISTICS: pack_statistics(statistics, settings.statistics_bit_width)}, residual

    def evaluate(self, rnd: int, payload: Payload) -> dict[str, float]:
        return self.task.evaluate(self.received_model(payload, self.memory(rnd)), self.site.val, self.site.device)
