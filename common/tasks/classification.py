"""Image classification (skin lesions, blood cells, generated textures) with MONAI's ResNet-18."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from common.data.containers import DataError, LabelledImages
from common.metrics import classification_metrics
from common.models.resnet import build_resnet18_classifier, load_pretrained
from common.models.small_cnn import build_small_cnn

from .base import Task, images_to_tensor, index_batches, random_flips


class ClassificationTask(Task):
    name = "classification"

    @staticmethod
    def describe(data: LabelledImages) -> dict[str, Any]:
        return {"num-classes": len(data.class_names), "in-channels": int(data.images.shape[-1]),
                "class-names": ",".join(data.class_names)}

    @property
    def num_classes(self) -> int:
        return int(self.spec["num-classes"])

    def build_model(self) -> torch.nn.Module:
        in_channels = int(self.spec.get("in-channels", 3))
        if self.cfg.classifier == "small-cnn":
            return build_small_cnn(self.num_classes, in_channels)
        return build_resnet18_classifier(self.num_classes, in_channels, self.cfg.image_size, self.cfg.resnet_width)

    def initial_model(self) -> torch.nn.Module:
        """The built network with the job's pretrained encoder weights, if any (a ``fc`` head is not loaded:
        classes differ between data sets)."""
        model = self.build_model()
        if not self.cfg.encoder_weights:
            return model
        if self.cfg.classifier != "resnet18":
            raise ValueError(f"encoder-weights: pretrained weights are for the ResNet-18; classifier is "
                             f"{self.cfg.classifier!r}")
        try:
            load_pretrained(getattr(model, "encoder", model), self.cfg.encoder_weights)
        except (OSError, ValueError, RuntimeError) as error:
            raise ValueError(f"encoder-weights: {error}") from None
        return model

    def check_data(self, data: LabelledImages, where: str) -> None:
        if len(data) and int(data.labels.max()) >= self.num_classes:
            bad = int(np.flatnonzero(data.labels >= self.num_classes)[0])
            raise DataError(f"{where}: {data.names[bad]} has label {int(data.labels[bad])}, "
                            f"but the job has {self.num_classes} classes")

    def batches(self, data: LabelledImages, batch_size: int, device: torch.device, rng: np.random.Generator | None,
                train: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in index_batches(len(data), batch_size, rng if train else None, drop_last=train):
            x = images_to_tensor(data.images[index], device)
            if train and rng is not None:
                (x,) = random_flips(rng, x)
            yield x, torch.from_numpy(data.labels[index]).to(device)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    @torch.no_grad()
    def predict(self, model: torch.nn.Module, data: LabelledImages, device: torch.device) -> np.ndarray:
        model.to(device).eval()
        predictions = [model(x).argmax(dim=1).cpu().numpy()
                       for x, _ in self.batches(data, 256, device, None, train=False)]
        return np.concatenate(predictions) if predictions else np.zeros(0, dtype=np.int64)

    def validate(self, model: torch.nn.Module, data: LabelledImages,
                 device: torch.device = torch.device("cpu")) -> dict[str, float]:
        """A hospital's check of a received model: accuracy and loss, in torch alone (no scikit-learn
        import in every ClientApp process); the server's test evaluation gives F1 and MCC."""
        if len(data) == 0:
            return {}
        model.to(device).eval()
        correct, loss = 0, 0.0
        with torch.no_grad():
            for x, y in self.batches(data, 256, device, None, train=False):
                output = model(x)
                correct += int((output.argmax(dim=1) == y).sum())
                loss += float(F.cross_entropy(output, y, reduction="sum"))
        return {"accuracy": correct / len(data), "loss": loss / len(data)}

    def evaluate(self, model: torch.nn.Module, data: LabelledImages,
                 device: torch.device = torch.device("cpu")) -> dict[str, float]:
        if len(data) == 0:
            return {}
        metrics = classification_metrics(data.labels, self.predict(model, data, device))
        metrics["num-examples"] = float(len(data))
        return metrics
