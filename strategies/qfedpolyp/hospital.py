"""QFedPolyp's hospital half: local quantisation-aware training (paper Algorithm 2) and the b-bit packed reply
(Algorithm 3), or its round's update at b bits with error feedback."""

from __future__ import annotations

import numpy as np
import torch

from common.arrays import NamedArrays, load_model_arrays, model_arrays
from common.methods.base import HospitalMethod, Payload
from common.quantization.codec import check_bit_width, decode_model, encode_model
from common.quantization.fake_quant import quantization_aware

from .messages import BIT_WIDTH_KEY, PACKED, STATISTICS, split_statistics


class QFedPolypHospital(HospitalMethod):
    """Local quantisation-aware training (paper Algorithm 2) and the b-bit packed reply (Algorithm 3)."""

    def received_model(self, payload: Payload) -> torch.nn.Module:
        """The global model from the round's packed payload (checked against this hospital's model)."""
        self.task.adopt_spec(payload.config)
        model = self.task.build_model()
        arrays = decode_model(payload.arrays[PACKED], reference=model_arrays(model),
                              expected_bits=self.cfg.qfedpolyp.downlink_bit_width, expected_content="weights")
        load_model_arrays(model, arrays)
        return model

    def train(self, rnd: int, payload: Payload) -> Payload:
        bits = check_bit_width(payload.config.get(BIT_WIDTH_KEY), f"round config key {BIT_WIDTH_KEY!r}")
        model = self.received_model(payload)
        start = model_arrays(model)
        self.task.check_data(self.site.train, f"hospital {self.site.name}")
        received = self.task.evaluate(model, self.site.val, self.site.device)
        # QAT trains the weights the paper sends at b bits; an update is quantised after full-precision training
        weights_sent = self.cfg.qfedpolyp.quantise == "weights"
        with quantization_aware(model, bits if self.cfg.qfedpolyp.qat and weights_sent else 32):
            stats = self.task.fit(model, self.site.train, self.site.device, self.site.round_seed(rnd))
        metrics = {"num-examples": len(self.site.train), "bit-width": bits, **stats}
        metrics.update({f"val-{k}": v for k, v in received.items() if k != "num-examples"})
        if weights_sent:
            return Payload(arrays={PACKED: encode_model(model_arrays(model), bits)}, metrics=metrics)
        return Payload(arrays=self.encoded_update(rnd, start, model_arrays(model), bits), metrics=metrics)

    def encoded_update(self, rnd: int, start: NamedArrays, trained: NamedArrays, bits: int) -> dict[str, NamedArrays]:
        """The round's update at ``bits`` bits and the BatchNorm statistics as floats. With error feedback, what
        quantisation lost last time is added first and what it loses now is kept in the state folder, so a
        restarted SuperNode or a resumed run carries on with exactly the same residual."""
        weights, statistics = split_statistics(trained)
        change = {k: v.astype(np.float64) - start[k] for k, v in weights.items()}
        feedback = self.cfg.qfedpolyp.error_feedback
        residual = (self.site.state.load(before_round=rnd) or {}) if feedback else {}
        for name, value in residual.items():
            if name in change and value.shape == change[name].shape:
                change[name] += value
        change = {k: v.astype(weights[k].dtype) for k, v in change.items()}
        encoded = encode_model(change, bits, content="update")
        if feedback:
            sent = decode_model(encoded, reference=change)
            self.site.state.save(rnd, {k: (v.astype(np.float64) - sent[k]).astype(v.dtype) for k, v in change.items()})
        return {PACKED: encoded, STATISTICS: statistics}

    def evaluate(self, rnd: int, payload: Payload) -> dict[str, float]:
        return self.task.evaluate(self.received_model(payload), self.site.val, self.site.device)
