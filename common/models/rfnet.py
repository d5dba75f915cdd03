"""The RFNet-style 3D network of FedMEPD (RFNet: Ding et al. 2021), built from MONAI blocks.

* One encoder per MRI modality (1 input channel; 4 stages, stride 2 from the second, each a
  convolution and a residual pair; Conv3d + InstanceNorm3d + LeakyReLU(0.2)), or one encoder
  shared by every modality (the FedAvg baseline).
* A fusion decoder: at each of the 4 scales RFNet's region-aware fusion of the modalities present
  (absent ones are zero features), then upsampling and merging with the finer scale; a 1x1x1 head.
* An auxiliary decoder shared across modalities that segments from each present modality alone,
  a regulariser during training.
* Optionally a LACCA module after each decoder scale (FedMEPD's hospitals).

Which modalities a sample carries is read from the input: an all-zero channel is absent (the
loaders zero what a hospital does not have). An encoder fed zeros gives zero features anyway (the
instance norm of a constant is zero), so skipping absent modalities only saves work. Crops must be
a multiple of 8 voxels on each side (three halvings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from monai.networks.blocks import Convolution, ResidualUnit
from torch import nn

from common.data.brats import MODALITIES

from .lacca import LACCA

LEAKY_RELU = ("leakyrelu", {"negative_slope": 0.2, "inplace": True})
INSTANCE_NORM = ("instance", {"affine": False})
LACCA_HEADS = (4, 8, 8, 8)  # the paper's heads per scale, finest first


def conv(in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1) -> Convolution:
    return Convolution(3, in_channels, out_channels, strides=stride, kernel_size=kernel_size,
                       act=LEAKY_RELU, norm=INSTANCE_NORM)


def present_modalities(x: torch.Tensor) -> torch.Tensor:
    """(B, 4) bool: which modality channels of each sample hold anything."""
    return x.flatten(2).abs().amax(dim=2) > 0


class ModalityEncoder(nn.Module):
    """Features of one modality at 4 scales (finest first)."""

    def __init__(self, widths: tuple[int, ...]):
        super().__init__()
        stages, in_channels = [], 1
        for index, width in enumerate(widths):
            stages.append(nn.Sequential(
                conv(in_channels, width, stride=1 if index == 0 else 2),
                ResidualUnit(3, width, width, subunits=2, act=LEAKY_RELU, norm=INSTANCE_NORM)))
            in_channels = width
        self.stages = nn.ModuleList(stages)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        features = []
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        return features


class RegionAwareFusion(nn.Module):
    """RFNet's fusion at one scale: a region probability map from the stacked modality features
    (and the coarser decoder feature), a sigmoid weight per modality and region from the region's
    pooled features, the weighted region features merged, plus a shortcut over all modalities."""

    def __init__(self, channels: int, num_classes: int, guide_channels: int = 0, num_modalities: int = len(MODALITIES)):
        super().__init__()
        hidden = max(channels // 4, 8)
        stacked = num_modalities * channels
        self.region_map = nn.Sequential(conv(stacked + guide_channels, hidden, 1), conv(hidden, hidden),
                                        nn.Conv3d(hidden, num_classes, 1))
        self.modality_weights = nn.ModuleList(
            nn.Sequential(nn.Conv3d(stacked + 1, hidden, 1), nn.LeakyReLU(0.2), nn.Conv3d(hidden, num_modalities, 1))
            for _ in range(num_classes))
        self.region_fusion = nn.Sequential(conv(num_classes * channels, channels, 1), conv(channels, channels),
                                           conv(channels, channels // 2, 1))
        self.shortcut = nn.Sequential(conv(stacked, channels, 1), conv(channels, channels),
                                      conv(channels, channels - channels // 2, 1))

    def forward(self, features: torch.Tensor, guide: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``features`` (B, M, C, D, H, W), absent modalities zero -> fused (B, C, ...), region logits (B, K, ...)."""
        batch, modalities = features.shape[:2]
        stacked = features.flatten(1, 2)
        region_logits = self.region_map(stacked if guide is None else torch.cat([stacked, guide], 1))
        regions = torch.softmax(region_logits.detach(), dim=1)  # RFNet weighs with a detached map
        fused = []
        for k, weigh in enumerate(self.modality_weights):
            region = regions[:, k:k + 1]
            share = region.mean(dim=(2, 3, 4)) + 1e-7  # (B, 1)
            masked = features * region.unsqueeze(1)
            pooled = masked.mean(dim=(3, 4, 5)) / share.unsqueeze(-1)  # (B, M, C): mean feature inside the region
            logits = weigh(torch.cat([pooled.flatten(1), share], 1)[..., None, None, None])
            weights = torch.sigmoid(logits).view(batch, modalities, 1, 1, 1, 1)
            fused.append((masked * weights).sum(dim=1))
        return torch.cat([self.region_fusion(torch.cat(fused, 1)), self.shortcut(stacked)], 1), region_logits


class UpMerge(nn.Module):
    """Upsample the coarser feature, bring it to the finer width, merge it with the finer feature."""

    def __init__(self, coarse: int, fine: int):
        super().__init__()
        self.upsample = nn.Upsample(scale_factor=2, mode="trilinear", align_corners=True)
        self.lift = conv(coarse, fine)
        self.merge = nn.Sequential(conv(2 * fine, fine), conv(fine, fine, 1))

    def lifted(self, coarse: torch.Tensor) -> torch.Tensor:
        return self.lift(self.upsample(coarse))

    def forward(self, lifted: torch.Tensor, fine: torch.Tensor) -> torch.Tensor:
        return self.merge(torch.cat([fine, lifted], 1))


class FusionDecoder(nn.Module):
    """Region-aware fusion at each scale, coarse to fine; the calibration hook is where LACCA goes."""

    def __init__(self, widths: tuple[int, ...], num_classes: int):
        super().__init__()
        last = len(widths) - 1
        self.fusions = nn.ModuleList(RegionAwareFusion(w, num_classes, guide_channels=0 if s == last else w)
                                     for s, w in enumerate(widths))
        self.ups = nn.ModuleList(UpMerge(widths[s + 1], widths[s]) for s in range(last))
        self.head = nn.Conv3d(widths[0], num_classes, 1)

    def forward(self, features: list[torch.Tensor], calibrate: nn.ModuleList | None = None):
        """Logits, region logits per scale and decoder features per scale (before calibration), finest first."""
        last = len(features) - 1
        x, region = self.fusions[last](features[last])
        regions, scale_features = [region], [x]
        if calibrate is not None:
            x = calibrate[last](x)
        for s in range(last - 1, -1, -1):
            guide = self.ups[s].lifted(x)
            fused, region = self.fusions[s](features[s], guide)
            x = self.ups[s](guide, fused)
            regions.insert(0, region)
            scale_features.insert(0, x)
            if calibrate is not None:
                x = calibrate[s](x)
        return self.head(x), regions, scale_features


class AuxiliaryDecoder(nn.Module):
    """A U-Net decoder over one modality's features (shared by all modalities)."""

    def __init__(self, widths: tuple[int, ...], num_classes: int):
        super().__init__()
        self.ups = nn.ModuleList(UpMerge(widths[s + 1], widths[s]) for s in range(len(widths) - 1))
        self.head = nn.Conv3d(widths[0], num_classes, 1)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = features[-1]
        for s in range(len(features) - 2, -1, -1):
            x = self.ups[s](self.ups[s].lifted(x), features[s])
        return self.head(x)


@dataclass
class SegmentationOutputs:
    """What the network gives in training mode (in eval mode it gives ``logits`` only)."""

    logits: torch.Tensor               # (B, K, D, H, W): the fused prediction
    region_logits: list[torch.Tensor]  # per scale, finest first: RFNet's region maps
    aux_logits: torch.Tensor           # (P, K, D, H, W): one row per (sample, present modality)
    aux_samples: torch.Tensor          # (P,): the sample each auxiliary row belongs to
    features: list[torch.Tensor]       # decoder features per scale, before LACCA


class MultimodalSegNet(nn.Module):
    """Modality-specific (or one shared) encoders, fusion decoder, auxiliary decoder, optional LACCA.

    ``modalities`` are the encoders the model has: all four on the server, a hospital's own
    otherwise. Parameter names group by part: ``encoders.<modality>.``, ``encoder.`` (shared),
    ``decoder.``, ``aux_decoder.``, ``lacca.``.
    """

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64, 128), num_classes: int = 4,
                 modalities: tuple[str, ...] = MODALITIES, shared_encoder: bool = False, lacca: bool = False,
                 encoder: Callable[[tuple[int, ...]], nn.Module] | None = None,
                 decoder: Callable[[tuple[int, ...], int], nn.Module] | None = None):
        """``encoder(widths)`` and ``decoder(widths, num_classes)`` build a consortium's own modality encoder and
        fusion decoder in place of ours; they must keep :class:`ModalityEncoder`'s and :class:`FusionDecoder`'s
        ``forward`` (checked on a crop before round 1: ``common.models.requirements``)."""
        super().__init__()
        self.widths = tuple(widths)
        self.modalities = tuple(m for m in MODALITIES if m in modalities)
        self.shared_encoder = shared_encoder
        make_encoder = encoder or ModalityEncoder
        if shared_encoder:
            self.encoder = make_encoder(self.widths)
        else:
            self.encoders = nn.ModuleDict({m: make_encoder(self.widths) for m in self.modalities})
        self.decoder = (decoder or FusionDecoder)(self.widths, num_classes)
        self.aux_decoder = AuxiliaryDecoder(self.widths, num_classes)
        self.lacca = nn.ModuleList(LACCA(w, h) for w, h in zip(self.widths, LACCA_HEADS)) if lacca else None

    def set_anchors(self, anchors: list[torch.Tensor] | None) -> None:
        """The server's anchors per scale (finest first); ``None`` turns LACCA into the identity."""
        if self.lacca is None:
            return
        for s, module in enumerate(self.lacca):
            module.set_anchors(None if anchors is None else anchors[s])

    def encode(self, x: torch.Tensor, present: torch.Tensor) -> list[torch.Tensor]:
        """Per scale (B, 4, C_s, ...) with zeros where a modality is absent."""
        sizes = [tuple(x.shape[2:])]
        for _ in self.widths[1:]:
            sizes.append(tuple((n + 1) // 2 for n in sizes[-1]))
        per_scale: list[list[torch.Tensor]] = [[] for _ in self.widths]
        for i, modality in enumerate(MODALITIES):
            here = present[:, i]
            if here.any():
                if not self.shared_encoder and modality not in self.modalities:
                    raise ValueError(f"the input carries {modality}, but this model has encoders for "
                                     f"{', '.join(self.modalities)} only")
                encoder = self.encoder if self.shared_encoder else self.encoders[modality]
                features = encoder(x[:, i:i + 1])
                if not here.all():
                    features = [f * here.view(-1, 1, 1, 1, 1).to(f.dtype) for f in features]
            else:
                features = [x.new_zeros((x.shape[0], w, *size)) for w, size in zip(self.widths, sizes)]
            for s, f in enumerate(features):
                per_scale[s].append(f)
        return [torch.stack(fs, dim=1) for fs in per_scale]

    def decoder_features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The fusion decoder's feature at each scale (before LACCA), what the anchors are made of."""
        _, _, features = self.decoder(self.encode(x, present_modalities(x)), self.lacca)
        return features

    def forward(self, x: torch.Tensor, present: torch.Tensor | None = None):
        present = present_modalities(x) if present is None else present
        features = self.encode(x, present)
        logits, regions, scale_features = self.decoder(features, self.lacca)
        if not self.training:
            return logits
        pairs = present.nonzero()
        if len(pairs):
            aux_logits = self.aux_decoder([f[pairs[:, 0], pairs[:, 1]] for f in features])
        else:
            aux_logits = logits.new_zeros((0, *logits.shape[1:]))
        return SegmentationOutputs(logits, regions, aux_logits, pairs[:, 0], scale_features)
