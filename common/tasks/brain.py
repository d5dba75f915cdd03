"""Brain tumour segmentation on multimodal 3D MRI (BraTS), where each party owns some of the modalities.

A party's data is a list of :class:`~common.data.brats.BratsCase` with the modalities it lacks
zeroed; the model is the RFNet-style network of :mod:`common.models.rfnet`, with encoders for the
party's own modalities. Training draws random crops (half of them centred on tumour, MONAI's
``RandCropByPosNegLabeld``) with random flips, and minimises RFNet's class-weighted cross-entropy +
Dice on the fused output, on the region maps of every scale and on the auxiliary per-modality
outputs. Evaluation runs MONAI's sliding-window inference over whole volumes (averaged softmax) and
scores the BraTS regions WT {1,2,3}, TC {1,3} and ET {3} with Dice and HD95 (MONAI).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from monai.inferers import sliding_window_inference
from monai.losses import DiceLoss
from monai.transforms import Compose, RandCropByPosNegLabeld, RandFlipd, SpatialPadd

from common.data.brats import MODALITIES, BratsCase, parse_modalities
from common.data.containers import DataError
from common.devices import autocast
from common.metrics import SegmentationScores
from common.models.rfnet import MultimodalSegNet, SegmentationOutputs
from common.trust.code_gate import load_factory

from .base import Task

NUM_CLASSES = 4  # background, necrotic core, edema, enhancing tumour (BraTS 4 -> 3)
REGIONS = {"WT": (1, 2, 3), "TC": (1, 3), "ET": (3,)}


def weighted_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """RFNet's class-balanced cross-entropy: a voxel weighs 1 - (share of its class in its sample)."""
    counts = torch.stack([torch.bincount(t.flatten(), minlength=logits.shape[1]) for t in target]).float()
    share = counts / counts.sum(dim=1, keepdim=True)
    weights = (1.0 - share).gather(1, target.flatten(1)).view_as(target)
    return (F.cross_entropy(logits, target, reduction="none") * weights).mean()


def region_masks(labels: torch.Tensor) -> torch.Tensor:
    """(N, D, H, W) labels -> (N, 3, D, H, W) WT/TC/ET masks."""
    return torch.stack([torch.isin(labels, torch.tensor(classes, device=labels.device))
                        for classes in REGIONS.values()], 1)


def poly_learning_rate(base: float, rnd: int | None, num_rounds: int) -> float:
    """The paper's poly decay over rounds: base * (1 - (rnd - 1) / rounds) ^ 0.9 (base when the round is unknown)."""
    if rnd is None:
        return base
    return base * max(1.0 - (rnd - 1) / num_rounds, 1e-3) ** 0.9


class BrainTumourTask(Task):
    name = "brain-tumour-segmentation"

    def __init__(self, cfg, spec=None):
        super().__init__(cfg, spec)
        self.round: int | None = None  # the round being trained (learning-rate decay); set from the round config
        self._dice = DiceLoss(include_background=True, to_onehot_y=True, softmax=True, batch=True)

    # --- model ------------------------------------------------------------------------------------
    @staticmethod
    def describe(data: list[BratsCase]) -> dict[str, Any]:
        return {"num-classes": NUM_CLASSES}

    def build_model(self, modalities: tuple[str, ...] = MODALITIES, lacca: bool = False) -> MultimodalSegNet:
        """The network with encoders for ``modalities``; ``model.shared-encoder`` in the spec gives the
        FedAvg baseline's one encoder for all."""
        parts = {}  # a consortium's own encoder and decoder factories: model-args '{"encoder": "pkg.mod:fn", ...}'
        for part, path in self.network_model_args().items():
            if part not in ("encoder", "decoder"):
                raise ValueError(f"model-args: the brain network takes 'encoder' and 'decoder' factories, not {part!r}")
            parts[part] = load_factory(str(path), f"model-args {part}")
        return MultimodalSegNet(self.cfg.brain.width_tuple, int(self.spec.get("num-classes", NUM_CLASSES)),
                                modalities, shared_encoder=bool(self.spec.get("shared-encoder", False)), lacca=lacca,
                                **parts)

    def adopt_spec(self, config: dict[str, Any]) -> None:
        super().adopt_spec(config)
        if "server-round" in config:
            self.round = int(config["server-round"])

    # --- data -------------------------------------------------------------------------------------
    @classmethod
    def builtin_test(cls, cfg) -> list[BratsCase]:
        from common.data.brain_sources import test_cases

        return test_cases(cfg)

    @classmethod
    def hospital_properties(cls, cfg, partition_id: int | None, properties: dict[str, Any]) -> dict[str, Any]:
        """A simulated hospital's modalities come from ``brain.hospital-modalities``; declared ones are checked."""
        from common.data.brain_sources import simulated_modalities

        if properties.get("modalities"):
            modalities = parse_modalities(str(properties["modalities"]), "node config key 'modalities'")
        elif partition_id is not None:
            modalities = simulated_modalities(cfg, int(partition_id))
        else:
            raise DataError("node config key 'modalities' is missing: a brain tumour hospital declares the MRI "
                            "modalities it has, e.g. modalities='flair,t1ce'")
        return {**properties, "modalities": ",".join(modalities)}

    @classmethod
    def builtin_hospital_data(cls, cfg, *, partition_id=None, num_partitions=None, data_dir=None, properties=None,
                              seed: int = 0) -> tuple[list[BratsCase], list[BratsCase]]:
        from common.data import brain_sources

        modalities = parse_modalities(str((properties or {}).get("modalities", "")) or ",".join(MODALITIES))
        if data_dir:
            cases = brain_sources.load_folder_cases(cfg, data_dir, modalities)
            n_val = round(cfg.val_fraction * len(cases)) if len(cases) > 1 else 0
            order = np.random.default_rng(seed).permutation(len(cases))
            return [cases[i] for i in sorted(order[n_val:])], [cases[i] for i in sorted(order[:n_val])]
        names = brain_sources.hospital_cases(cfg, int(partition_id or 0), int(num_partitions or 1))
        return brain_sources.load_named_cases(cfg, names, modalities), brain_sources.test_cases(cfg, modalities)

    def load_server_train(self) -> list[BratsCase]:
        from common.data.brain_sources import server_training_cases

        return server_training_cases(self.cfg)

    def check_data(self, data: list[BratsCase], where: str) -> None:
        for case in data:
            if case.image.shape[0] != len(MODALITIES) or case.label is None:
                raise DataError(f"{where}: case {case.name} has no labels or not {len(MODALITIES)} modality channels")
            if int(case.label.max()) >= NUM_CLASSES:
                raise DataError(f"{where}: case {case.name} has label {int(case.label.max())}, beyond the 4 classes")

    def crop_transform(self) -> Compose:
        keys, size = ("image", "label"), (self.cfg.brain.crop_size,) * 3
        return Compose([SpatialPadd(keys, spatial_size=size),
                        RandCropByPosNegLabeld(keys, label_key="label", spatial_size=size, pos=1, neg=1, num_samples=1),
                        *[RandFlipd(keys, prob=0.5, spatial_axis=axis) for axis in range(3)]])

    def batches(self, data: list[BratsCase], batch_size: int, device: torch.device, rng: np.random.Generator | None,
                train: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Training: ``brain.crops-per-case`` random crops of every case per epoch, shuffled, in full
        batches (the last is topped up with random further crops: on CPUs PyTorch sends batch-1 3D
        convolutions to a much slower kernel). Otherwise whole volumes, one at a time."""
        if not train:
            for case in data:
                yield (torch.from_numpy(case.image)[None].to(device),
                       torch.from_numpy(case.label.astype(np.int64))[None].to(device))
            return
        rng = rng or np.random.default_rng(0)
        picks = rng.permutation(np.repeat(np.arange(len(data)), self.cfg.brain.crops_per_case))
        steps = math.ceil(len(picks) / batch_size)
        picks = np.concatenate([picks, rng.integers(0, len(data), steps * batch_size - len(picks))])
        transform = self.crop_transform()
        transform.set_random_state(seed=int(rng.integers(2**31)))
        for step in range(steps):
            crops = [transform({"image": data[i].image, "label": data[i].label[None]})[0]
                     for i in picks[step * batch_size:(step + 1) * batch_size]]
            x = torch.stack([torch.as_tensor(np.asarray(c["image"])) for c in crops]).float()
            y = torch.stack([torch.as_tensor(np.asarray(c["label"]))[0] for c in crops]).long()
            yield x.to(device), y.to(device)

    # --- training ---------------------------------------------------------------------------------
    def segmentation_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return weighted_cross_entropy(logits, target) + self._dice(logits, target.unsqueeze(1))

    def loss(self, output: SegmentationOutputs, target: torch.Tensor) -> torch.Tensor:
        """Fused output + the region map of every scale + each present modality's auxiliary output."""
        total = self.segmentation_loss(output.logits, target)
        for region in output.region_logits:
            upsampled = F.interpolate(region, size=target.shape[1:], mode="trilinear", align_corners=True)
            total = total + self.segmentation_loss(upsampled, target)
        if len(output.aux_samples):  # summed over modalities, as RFNet does
            aux = self.segmentation_loss(output.aux_logits, target[output.aux_samples])
            total = total + aux * len(output.aux_samples) / len(target)
        return total

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        lr = poly_learning_rate(self.cfg.learning_rate, self.round, self.cfg.num_server_rounds)
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=self.cfg.weight_decay)

    # --- evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def predict(self, model: torch.nn.Module, image: torch.Tensor) -> torch.Tensor:
        """Labels (1, D, H, W) of one volume (1, 4, D, H, W): sliding windows, averaged softmax."""
        model.eval()
        with autocast(image.device, self.cfg.precision):
            probabilities = sliding_window_inference(
                image, (self.cfg.brain.crop_size,) * 3, max(2, self.cfg.batch_size),
                lambda window: torch.softmax(model(window).float(), dim=1), overlap=self.cfg.brain.window_overlap)
        return torch.as_tensor(probabilities).argmax(dim=1)

    def evaluate(self, model: torch.nn.Module, data: list[BratsCase],
                 device: torch.device = torch.device("cpu")) -> dict[str, float]:
        """Dice, IoU and HD95 of WT, TC and ET over whole volumes, their means, and the case count."""
        if not data:
            return {}
        model.to(device)
        scores = SegmentationScores(region_names=tuple(REGIONS))
        for image, label in self.batches(data, 1, device, None, train=False):
            scores.update(region_masks(self.predict(model, image)).cpu(), region_masks(label).cpu())
        metrics = scores.compute()
        hd95 = [metrics[f"hd95_{r}"] for r in REGIONS if math.isfinite(metrics[f"hd95_{r}"])]
        metrics["hd95_mean"] = float(np.mean(hd95)) if hd95 else math.nan
        metrics["num-examples"] = float(len(data))
        return metrics

    def validate(self, model: torch.nn.Module, data: list[BratsCase],
                 device: torch.device = torch.device("cpu")) -> dict[str, float]:
        """A hospital scores the model it holds in evaluation rounds only (every ``evaluate-every``
        rounds and the last): whole-volume inference is the dearest part of a round on a CPU."""
        rnd = self.round
        if rnd is not None and rnd % self.cfg.evaluate_every and rnd != self.cfg.num_server_rounds:
            return {}
        return self.evaluate(model, data, device)

    @property
    def headline_metric(self) -> str:
        return "dice_mean"
