"""Image classification (skin lesions, blood cells, generated textures) with MONAI's ResNet-18 or any network of
the consortium's own (``model='package.module:factory'``)."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from common.data.containers import DataError, LabelledImages
from common.data.torch_data import TorchData
from common.devices import autocast
from common.metrics import classification_metrics
from common.models.networks import build_network
from common.models.representations import headless
from common.models.resnet import build_resnet18_encoder, encoder_feature_dim, load_pretrained
from common.models.small_cnn import build_small_cnn

from .base import Task, images_to_tensor, index_batches, random_flips


class ClassificationTask(Task):
    name = "classification"

    @staticmethod
    def describe(data) -> dict[str, Any]:
        channels = data.in_channels if hasattr(data, "in_channels") else int(data.images.shape[-1])
        return {"num-classes": len(data.class_names), "in-channels": channels,
                "class-names": ",".join(data.class_names)}

    @property
    def num_classes(self) -> int:
        return int(self.spec["num-classes"])

    @classmethod
    def spec_without_test_set(cls, cfg) -> dict[str, Any]:
        if not cfg.num_classes:
            raise ValueError(f"dataset {cfg.dataset!r} gives the server no test set, so num-classes must say how many "
                             "classes the model has")
        return {"num-classes": cfg.num_classes, "in-channels": cfg.input_dims[0] if cfg.input_dims else 3,
                "class-names": ",".join(str(c) for c in range(cfg.num_classes))}

    def network_arguments(self) -> dict[str, Any]:
        """What the task offers a network's factory (it takes those its signature names)."""
        offered = {"num_classes": self.num_classes, "out_channels": self.num_classes, "spatial_dims": 2,
                   "in_channels": int(self.spec.get("in-channels", 3)), "image_size": self.cfg.image_size}
        if self.network_name == "resnet18":
            offered["width"] = self.cfg.resnet_width
        return offered

    def build_classifier(self) -> torch.nn.Module:
        """The job's network as a classifier (image -> class scores)."""
        return self.dp_compatible(build_network(self.network_name, self.network_arguments(),
                                                self.network_model_args()))

    def dp_compatible(self, network: torch.nn.Module) -> torch.nn.Module:
        """``network`` with GroupNorm in place of BatchNorm when the run asks for it (``patient-dp.group-norm``)."""
        if not self.cfg.patient_dp.group_norm:
            return network
        from common.trust.patient_dp import group_norm_network

        return group_norm_network(network)

    def build_model(self) -> torch.nn.Module:
        return self.build_classifier()

    def build_encoder(self) -> tuple[torch.nn.Module, int]:
        """The network without its classifier head and the length of the feature vector it gives (what the
        prototype methods put their prototypes on): the built-in ResNet-18 up to its pooling, any other network
        with its last linear layer taken out (that layer's input is the feature)."""
        in_channels = int(self.spec.get("in-channels", 3))
        if self.network_name == "resnet18":
            return (self.dp_compatible(build_resnet18_encoder(in_channels, self.cfg.image_size,
                                                              width=self.cfg.resnet_width)),
                    encoder_feature_dim(self.cfg.resnet_width))
        if self.network_name == "small-cnn":  # built with one class, as it always was: the same draws of the seed
            encoder, features = headless(build_small_cnn(1, in_channels), self.network_name, self.cfg.strategy)
            return self.dp_compatible(encoder), features
        return headless(self.build_classifier(), self.network_name, self.cfg.strategy)

    def initial_model(self) -> torch.nn.Module:
        """The built network with the job's pretrained encoder weights, if any (a ``fc`` head is not loaded:
        classes differ between data sets)."""
        model = self.build_model()
        if not self.cfg.encoder_weights:
            return model
        if self.network_name != "resnet18":
            raise ValueError(f"encoder-weights: pretrained weights are for the built-in ResNet-18; model is "
                             f"{self.network_name!r} (load your own weights in your model's factory)")
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
        order = index_batches(len(data), batch_size, rng if train else None, drop_last=train)
        if isinstance(data, TorchData):  # a data set of the consortium's own: its transforms augment
            yield from data.batches(order, device)
            return
        for index in order:
            x = images_to_tensor(data.images[index], device)
            if train and rng is not None:
                (x,) = random_flips(rng, x)
            yield x, torch.from_numpy(data.labels[index]).to(device)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    @torch.no_grad()
    def predict(self, model: torch.nn.Module, data: LabelledImages, device: torch.device) -> np.ndarray:
        model.to(device).eval()
        with autocast(device, self.cfg.precision):
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
        with torch.no_grad(), autocast(device, self.cfg.precision):
            for x, y in self.batches(data, 256, device, None, train=False):
                output = model(x).float()
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
