"""Evaluation metrics, from the field's libraries: scikit-learn for classification, MONAI for masks.

Each comes as a plain function and, for segmentation, a cumulative class that takes batches
(MONAI's pattern), so whole test sets never have to sit in memory at once.

Empty masks: Dice and IoU of an empty prediction against an empty ground truth count as 1 and
against a non-empty one as 0 (MONAI's ``ignore_empty=False``); HD95 is undefined when either mask
is empty, so such images are left out of the HD95 mean and counted in ``hd95_undefined``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# scikit-learn and MONAI are imported inside the functions that use them: a hospital's ClientApp
# process starts afresh for every message, and importing both costs seconds of CPU each time.


def classification_metrics(y_true: np.ndarray, y_pred: np.ndarray) -> dict[str, float]:
    """Accuracy, weighted F1 and Matthews correlation (all classes, multi-class MCC)."""
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    return {
        "accuracy": float(accuracy_score(y_true, y_pred)),
        "f1_weighted": float(f1_score(y_true, y_pred, average="weighted", zero_division=0)),
        "mcc": float(matthews_corrcoef(y_true, y_pred)) if len(np.unique(y_true)) > 1 else 0.0,
    }


class SegmentationScores:
    """Cumulative Dice, IoU and HD95 over batches of binary (or per-region) masks.

    Masks are (N, R, *spatial) with R regions (1 for polyps; WT/TC/ET for brain tumours).
    """

    def __init__(self, region_names: tuple[str, ...] = ("",)):
        from monai.metrics import DiceMetric, HausdorffDistanceMetric, MeanIoU

        self.region_names = region_names
        self._dice = DiceMetric(include_background=True, reduction="none", ignore_empty=False)
        self._iou = MeanIoU(include_background=True, reduction="none", ignore_empty=False)
        self._hd95 = HausdorffDistanceMetric(include_background=True, percentile=95, reduction="none")

    def update(self, prediction: torch.Tensor, target: torch.Tensor) -> None:
        prediction, target = prediction.float(), target.float()
        self._dice(prediction, target)
        self._iou(prediction, target)
        self._hd95(prediction, target)

    def compute(self) -> dict[str, float]:
        dice = self._dice.aggregate().cpu().numpy()
        iou = self._iou.aggregate().cpu().numpy()
        hd95 = self._hd95.aggregate().cpu().numpy()
        scores: dict[str, float] = {}
        for r, name in enumerate(self.region_names):
            suffix = f"_{name}" if name else ""
            finite = hd95[:, r][np.isfinite(hd95[:, r])]
            scores[f"dice{suffix}"] = float(np.nanmean(dice[:, r]))
            scores[f"iou{suffix}"] = float(np.nanmean(iou[:, r]))
            scores[f"hd95{suffix}"] = float(finite.mean()) if finite.size else math.nan
            scores[f"hd95_undefined{suffix}"] = float(len(hd95) - finite.size)
        if len(self.region_names) > 1:
            scores["dice_mean"] = float(np.mean([scores[f"dice_{n}"] for n in self.region_names]))
        return scores

    def reset(self) -> None:
        for metric in (self._dice, self._iou, self._hd95):
            metric.reset()


def binary_segmentation_metrics(prediction: np.ndarray | torch.Tensor,
                                target: np.ndarray | torch.Tensor) -> dict[str, float]:
    """Dice, IoU and HD95 of binary masks (N, H, W) or (N, 1, H, W)."""
    prediction, target = torch.as_tensor(np.asarray(prediction)), torch.as_tensor(np.asarray(target))
    if prediction.ndim == 3:
        prediction, target = prediction[:, None], target[:, None]
    scores = SegmentationScores()
    scores.update(prediction, target)
    return scores.compute()
