"""Every built-in loader hands networks contiguous NCHW batches, so a tutorial network that flattens with
``x.view(-1, 16 * 5 * 5)`` trains on them; a network whose own tensor is not contiguous is stopped before round 1
with the layout and the fix named."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from common.config import ConfigError, load_job_config
from common.data.synthetic import make_classification, make_polyps
from common.data.torch_data import TorchData
from common.models.requirements import check_network
from common.tasks import get_task
from strategies.fedproin.task import PrototypeClassificationTask

from .conftest import ROOT

sys.path.insert(0, str(ROOT / "examples" / "quickstart_pytorch"))
from quickstart.task import Net  # noqa: E402  (the tutorial network of Flower's quickstart)


def job(**keys):
    return load_job_config({"image-size": 32, "synthetic-samples": 40, "batch-size": 8, **keys})


def first_batches(task, data, train: bool) -> list[torch.Tensor]:
    rng = np.random.default_rng(0) if train else None
    batches = task.batches(data, 8, torch.device("cpu"), rng, train=train)
    return [x for x, _ in (next(batches), next(batches))]


@pytest.mark.parametrize("train", [True, False], ids=["training", "evaluation"])
def test_classification_batches_are_contiguous_nchw_and_the_tutorial_network_takes_them(train):
    task = get_task(job(), {"num-classes": 4, "in-channels": 3})
    for x in first_batches(task, make_classification(20, 32, seed=0), train):
        assert x.shape[1:] == (3, 32, 32) and x.is_contiguous()
        assert Net()(x).shape == (x.shape[0], 10)  # its x.view(-1, 16 * 5 * 5) works on them


def test_fedproins_class_balanced_augmented_batches_are_contiguous():
    cfg = job(**{"strategy": "fedproin", "fedproin.class-balanced": True, "fedproin.class-augmentation": True})
    task = PrototypeClassificationTask(cfg, {"num-classes": 4, "in-channels": 3})
    for x in first_batches(task, make_classification(20, 32, seed=0), train=True):
        assert x.is_contiguous() and Net()(x).shape[0] == x.shape[0]


def test_polyp_batches_are_contiguous():
    task = get_task(job(task="polyp-segmentation"), {"in-channels": 3})
    for x in first_batches(task, make_polyps(20, 32, seed=0), train=True):
        assert x.shape[1:] == (3, 32, 32) and x.is_contiguous()


def test_a_datasets_own_channels_last_images_reach_the_network_contiguous():
    images = torch.rand(16, 3, 32, 32).to(memory_format=torch.channels_last)
    assert not images[0:8].is_contiguous()
    data = TorchData(TensorDataset(images, torch.arange(16) % 4), "hospital-00 train")
    task = get_task(job(), {"num-classes": 4, "in-channels": 3})
    for x in first_batches(task, data, train=True):
        assert x.is_contiguous() and Net()(x).shape == (8, 10)


class ChannelsLastInside(Net):
    """A network that turns its own tensor channels-last before flattening with ``view``."""

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x))).permute(0, 2, 3, 1)  # NHWC: no longer readable by view
        return x.view(x.shape[0], -1)


def test_a_network_that_views_a_tensor_it_made_non_contiguous_is_named_with_the_layout_and_the_fix(monkeypatch):
    task = get_task(job(model="tests.test_batch_layout:ChannelsLastInside"), {"num-classes": 4, "in-channels": 3})
    with pytest.raises(ConfigError) as refused:
        check_network(task, "any", make_classification(4, 32, seed=0))
    message = str(refused.value)
    assert "view size is not compatible" in message and "contiguous NCHW" in message
    assert "reshape" in message and "tests.test_batch_layout:ChannelsLastInside" in message
