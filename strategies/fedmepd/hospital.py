"""FedMEPD's hospital half: compose its model from the received encoders and shared decoder filters with the
personal filters, LACCA and auxiliary decoder it kept, score it, train it, upload the shared parts."""

from __future__ import annotations

import numpy as np
import torch

from common.arrays import check_like, load_model_arrays, model_arrays
from common.methods.base import Payload

from .decoder import DECODER, MASK_KEY, decoder_part
from .filter_personalisation import filter_layers, layer_sizes, unpack_mask
from .harness import BrainHospital, encoder_prefixes


class FedMEPDHospital(BrainHospital):
    """A hospital's step: compose its model, score it, train it, keep its local parts, upload the shared ones."""

    lacca = True

    @property
    def uses_lacca(self) -> bool:
        return self.lacca and self.cfg.fedmepd.lacca

    def compose(self, rnd: int, payload: Payload) -> tuple[torch.nn.Module, dict[str, np.ndarray]]:
        """Received encoders and shared decoder filters, with the personal filters, LACCA and auxiliary
        decoder this hospital kept; LACCA gets the received anchors. Returns the model and the mask."""
        self.task.adopt_spec(payload.config)
        model, kept = self.own_model(rnd, lacca=self.uses_lacca)
        arrays = model_arrays(model)
        received = payload.arrays["model"]
        check_like(received, {k: v for k, v in arrays.items()
                              if k.startswith(encoder_prefixes(self.modalities) + (DECODER,))},
                   f"model received by {self.site.name}")
        if MASK_KEY not in payload.config:
            raise ValueError(f"round config for {self.site.name} carries no {MASK_KEY!r}")
        layers = filter_layers(decoder_part(arrays))
        personal = unpack_mask(bytes(payload.config[MASK_KEY]), layer_sizes(decoder_part(arrays)))
        arrays.update(received)
        if kept is not None:  # personal filters keep this hospital's own values
            for layer, names in layers.items():
                for name in names:
                    shape = (-1,) + (1,) * (arrays[name].ndim - 1)
                    arrays[name] = np.where(personal[layer].reshape(shape), kept[name], received[name])
        load_model_arrays(model, arrays)
        anchors = payload.arrays.get("anchors")
        if anchors:
            model.set_anchors([torch.from_numpy(anchors[f"scale{s}"]) for s in range(len(model.widths))])
        return model, personal

    def train(self, rnd: int, payload: Payload) -> Payload:
        model, personal = self.compose(rnd, payload)
        metrics: dict[str, float] = {"num-examples": float(len(self.site.train)), **self.validation(model)}
        metrics.update(self.local_training(rnd, model))
        trained = model_arrays(model)
        self.site.state.save(rnd, trained)
        received = payload.arrays["model"]
        upload = {k: trained[k] for k in received}
        for layer, names in filter_layers(decoder_part(upload)).items():  # personal filters never leave the hospital
            for name in names:
                shape = (-1,) + (1,) * (upload[name].ndim - 1)
                upload[name] = np.where(personal[layer].reshape(shape), received[name], upload[name])
        metrics["personal-filters"] = float(sum(m.sum() for m in personal.values()))
        return Payload(arrays={"model": upload}, metrics=metrics)

    def evaluate(self, rnd: int, payload: Payload) -> dict[str, float]:
        model, _ = self.compose(rnd, payload)
        return self.task.evaluate(model, self.site.val, self.site.device)

    def cross_site(self, rnd: int, payload: Payload) -> dict[str, dict[str, float]]:
        """Its own model (personal filters, LACCA) and the global one alone: the received encoders and decoder."""
        self.task.adopt_spec(payload.config)
        torch.manual_seed(self.site.round_seed(0))
        shared = self.task.build_model(self.modalities)
        arrays = self.initial_arrays(shared)
        arrays.update(payload.arrays["model"])
        load_model_arrays(shared, arrays)
        return {"global": self.task.evaluate(shared, self.site.val, self.site.device),
                "own": self.evaluate(rnd, payload)}
