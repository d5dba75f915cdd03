"""Binary polyp segmentation with the small U-Net and MONAI's Dice loss."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from monai.losses import DiceLoss

from common.data.containers import SegmentationImages
from common.data.torch_data import TorchData
from common.devices import autocast
from common.metrics import SegmentationScores
from common.models.networks import build_network

from .base import Task, images_to_tensor, index_batches, random_flips


class PolypSegmentationTask(Task):
    name = "polyp-segmentation"

    def __init__(self, cfg, spec=None):
        super().__init__(cfg, spec)
        self._dice_loss = DiceLoss(sigmoid=True, smooth_nr=1.0, smooth_dr=1.0)

    @staticmethod
    def describe(data) -> dict[str, Any]:
        return {"in-channels": data.in_channels if hasattr(data, "in_channels") else int(data.images.shape[-1])}

    def build_model(self) -> torch.nn.Module:
        """The polyp U-Net, or the job's own segmentation network (one output channel of logits)."""
        offered = {"in_channels": int(self.spec.get("in-channels", 3)), "out_channels": 1, "spatial_dims": 2,
                   "image_size": self.cfg.image_size}
        return build_network(self.network_name, offered, self.network_model_args())

    def batches(self, data: SegmentationImages, batch_size: int, device: torch.device,
                rng: np.random.Generator | None, train: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = index_batches(len(data), batch_size, rng if train else None, drop_last=False)
        if isinstance(data, TorchData):  # a data set of the consortium's own: its transforms augment
            yield from data.batches(order, device, segmentation=True)
            return
        for index in order:
            x = images_to_tensor(data.images[index], device)
            y = torch.from_numpy(data.masks[index]).to(device).unsqueeze(1).float()
            if train and rng is not None:
                x, y = random_flips(rng, x, y)
            yield x, y

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._dice_loss(output, target)

    @torch.no_grad()
    def predict_masks(self, model: torch.nn.Module, data: SegmentationImages, device: torch.device,
                      batch_size: int = 32) -> np.ndarray:
        model.to(device).eval()
        with autocast(device, self.cfg.precision):
            masks = [(torch.sigmoid(model(x).float()) > 0.5).squeeze(1).cpu().numpy().astype(np.uint8)
                     for x, _ in self.batches(data, batch_size, device, None, train=False)]
        return np.concatenate(masks) if masks else np.zeros((0,) + data.masks.shape[1:], np.uint8)

    def evaluate(self, model: torch.nn.Module, data: SegmentationImages,
                 device: torch.device = torch.device("cpu")) -> dict[str, float]:
        """Dice, IoU and HD95 over all test images, and per source (data set) when there are several."""
        if len(data) == 0:
            return {}
        predicted = self.predict_masks(model, data, device)
        metrics = score_masks(predicted, data.masks)
        sources = data.source_names()
        if len(sources) > 1:
            for source in sources:
                chosen = data.sources == source
                for key, value in score_masks(predicted[chosen], data.masks[chosen]).items():
                    metrics[f"{key}/{source}"] = value
        metrics["num-examples"] = float(len(data))
        return metrics

    @property
    def headline_metric(self) -> str:
        return "dice"


def score_masks(predicted: np.ndarray, target: np.ndarray) -> dict[str, float]:
    scores = SegmentationScores()
    for start in range(0, len(predicted), 64):
        scores.update(torch.from_numpy(predicted[start:start + 64]).unsqueeze(1),
                      torch.from_numpy(target[start:start + 64]).unsqueeze(1))
    result = scores.compute()
    return {k: v for k, v in result.items() if k in ("dice", "iou", "hd95")}
