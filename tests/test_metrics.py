"""Metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.metrics import SegmentationScores, binary_segmentation_metrics, classification_metrics


def test_classification_metrics_match_hand_computation():
    y_true = np.array([0, 0, 1, 1, 2, 2])
    y_pred = np.array([0, 1, 1, 1, 2, 0])
    scores = classification_metrics(y_true, y_pred)
    assert scores["accuracy"] == pytest.approx(4 / 6)
    # per class F1: c0 p=1/2 r=1/2 -> .5; c1 p=2/3 r=1 -> .8; c2 p=1 r=1/2 -> 2/3; equal supports
    assert scores["f1_weighted"] == pytest.approx((0.5 + 0.8 + 2 / 3) / 3)
    assert 0 < scores["mcc"] < 1
    assert classification_metrics(y_true, y_true)["mcc"] == pytest.approx(1.0)


def square(size=20, top=5, side=6):
    mask = np.zeros((size, size), np.uint8)
    mask[top:top + side, top:top + side] = 1
    return mask


def test_dice_iou_hd95_of_shifted_squares():
    target = square()
    prediction = np.roll(target, 2, axis=1)  # 6x6 square shifted by 2: overlap 6x4
    scores = binary_segmentation_metrics(prediction[None], target[None])
    assert scores["dice"] == pytest.approx(2 * 24 / 72)
    assert scores["iou"] == pytest.approx(24 / 48)
    assert scores["hd95"] == pytest.approx(2.0)


def test_empty_masks_count_as_documented():
    empty = np.zeros((1, 10, 10), np.uint8)
    both_empty = binary_segmentation_metrics(empty, empty)
    assert both_empty["dice"] == 1.0 and math.isnan(both_empty["hd95"]) and both_empty["hd95_undefined"] == 1
    missed = binary_segmentation_metrics(empty, square(10, 2, 3)[None])
    assert missed["dice"] == 0.0


def test_cumulative_scores_equal_one_shot_scores():
    rng = np.random.default_rng(0)
    prediction = (rng.random((6, 16, 16)) > 0.5).astype(np.uint8)
    target = (rng.random((6, 16, 16)) > 0.5).astype(np.uint8)
    import torch

    cumulative = SegmentationScores()
    for start in (0, 2, 4):
        cumulative.update(torch.from_numpy(prediction[start:start + 2, None]),
                          torch.from_numpy(target[start:start + 2, None]))
    assert cumulative.compute()["dice"] == pytest.approx(binary_segmentation_metrics(prediction, target)["dice"])
