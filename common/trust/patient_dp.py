"""Patient-level DP-SGD at a hospital (Abadi et al. 2016, as Opacus trains): each step Poisson-samples patients, takes
every patient's gradient (the sum of its images' per-sample gradients, Opacus's ``GradSampleModule``), clips it to C,
sums, and adds Gaussian noise of std sigma C. Epsilon per patient comes from the RDP of the Poisson-subsampled
Gaussian (Opacus's accountant), in the same ledger as every other release (docs/privacy.md).

The consortium's plan is the run config's ``patient-dp`` table (``patient_dp_plan.PatientDPPlan``); the hospital's
policy table ``[patient-dp]`` (``common.trust.policy.PatientDP``) says the clip, the noise or the epsilon, delta and
the unit."""

from __future__ import annotations

import math
import secrets
import types
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.settings import ConfigError
from common.trust.policy import PatientDP, PolicyRefusal
from common.trust.secure_aggregation import distributed_dp as ddp


def opacus():
    try:
        import opacus
    except ImportError:
        raise ConfigError("the policy's patient-dp trains with Opacus: pip install 'fedmed-hospitals[privacy]' (or "
                          "opacus) in the hospital's environment") from None
    return opacus


#: channels per group when BatchNorm is replaced (De et al. 2022 use groups of 16 channels). Opacus's own fix takes
#: min(32, C) groups, which on narrow networks is one channel a group: each image's colour is normalised away, and
#: the blood cells' no-DP accuracy fell from 0.73 to 0.19 with it.
CHANNELS_PER_GROUP = 16


def group_norm_network(network):
    """``network`` with every BatchNorm replaced by GroupNorm of groups of CHANNELS_PER_GROUP channels (as Opacus's
    ModuleValidator.fix replaces it, with wider groups)."""
    import torch

    for name, child in list(network.named_children()):
        if isinstance(child, torch.nn.modules.batchnorm._BatchNorm):
            groups = max(1, child.num_features // CHANNELS_PER_GROUP)
            while child.num_features % groups:
                groups -= 1
            setattr(network, name, torch.nn.GroupNorm(groups, child.num_features, eps=child.eps,
                                                      affine=child.affine))
        else:
            group_norm_network(child)
    return network


def plan_epsilon(sample_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """Epsilon at ``delta`` of ``steps`` DP-SGD steps, counted exactly as the ledger counts them."""
    return ddp.epsilon([Release(noise_multiplier, sample_rate, steps, "", 0).entry()], delta)


def noise_for(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The least noise multiplier (to 0.1 %) whose ``steps`` steps stay within ``target_epsilon``."""
    low, high = 0.05, 1.0
    while plan_epsilon(sample_rate, high, steps, delta) > target_epsilon:
        low, high = high, high * 2
        if high > 1e4:
            raise PolicyRefusal(f"patient-dp: no noise multiplier reaches target-epsilon={target_epsilon:g} in "
                                f"{steps} steps")
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if plan_epsilon(sample_rate, middle, steps, delta) > target_epsilon else (low,
                                                                                                            middle)
    return high


@dataclass(frozen=True)
class Release:
    """One training's DP-SGD as the ledger counts it."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    unit: str
    units: int  #: patients (or images) in the training data

    def entry(self) -> dict[str, Any]:
        return {"mechanism": ddp.POISSON_GAUSSIAN, "noise-multiplier": self.noise_multiplier,
                "sample-rate": self.sample_rate, "steps": self.steps, "unit": self.unit, "adjacency": "add-remove"}


def unit_ids(data, unit: str) -> np.ndarray:
    """Each sample's unit as 0..U-1: its group (one patient or lesion; one image where the data has no groups), or
    itself."""
    if unit == "image":
        return np.arange(len(data))
    return np.unique(np.asarray(data.groups), return_inverse=True)[1].astype(np.int64)


def plan_release(table: PatientDP, cfg, data) -> Release:
    """What this training will release, decided before it runs (so its budget is checked first)."""
    plan = cfg.patient_dp
    if not hasattr(data, "images"):
        raise PolicyRefusal("patient-dp: DP-SGD takes the built-in image arrays; a torch Dataset of the "
                            "consortium's own is not taken through it yet")
    units = int(unit_ids(data, table.unit).max()) + 1 if len(data) else 0
    if units == 0:
        raise PolicyRefusal("patient-dp: it holds no training data")
    rate = min(1.0, plan.batch_size / units)
    steps = plan.steps or max(1, math.ceil(cfg.local_epochs / rate))
    sigma = table.noise_multiplier or noise_for(table.target_epsilon, table.delta, rate,
                                                steps * cfg.num_server_rounds)
    return Release(sigma, rate, steps, table.unit, units)


#: How a method's extra loss term (``common.tasks.base.ExtraLoss``) goes through DP-SGD, set as its ``patient_dp``
#: attribute by :func:`loss_term`. PER_SAMPLE: the batch mean of a term of each image alone (MOON's contrastive term);
#: its per-sample gradients are clipped with the task loss's. DATA_FREE: a term of the parameters alone (FedProx's
#: proximal term), called with no data; its gradient is added after the noise. SPLIT: the sum of one of each
#: (FedProIn's feature divergence, per sample, and prototype contrastive loss, data-free; :func:`split_term`). A term
#: that declares none of them is refused.
PER_SAMPLE, DATA_FREE, SPLIT = "per-sample", "data-free", "split"


def loss_term(term, kind: str):
    """``term`` declared as a PER_SAMPLE or DATA_FREE extra loss (how DP-SGD takes it)."""
    assert kind in (PER_SAMPLE, DATA_FREE), kind
    term.patient_dp = kind
    return term


def split_term(per_sample, data_free):
    """The extra loss ``per_sample + data_free`` (either may be None), each part declared as its kind: plain training
    adds both; DP-SGD clips the first with the task loss and adds the second's gradient after the noise."""
    parts = [part for part in (per_sample, data_free) if part is not None]

    def term(model, x, y, output):
        return sum(part(model, x, y, output) for part in parts)

    term.patient_dp = SPLIT
    term.per_sample_part = loss_term(per_sample, PER_SAMPLE) if per_sample is not None else None
    term.data_free_part = loss_term(data_free, DATA_FREE) if data_free is not None else None
    return term


def check_network(model) -> None:
    """Refuse a network Opacus cannot take per-sample gradients of (BatchNorm), with the reason and the fix."""
    from opacus.validators import ModuleValidator

    opacus()
    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        first = str(errors[0]).split(". ")[0]  # Opacus explains at length; the first sentence names the layer
        raise PolicyRefusal(f"patient-dp: the network cannot give per-patient gradients ({first}); run it with "
                            "patient-dp.group-norm = true (GroupNorm in place of BatchNorm)")


class DPSGD:
    """A hospital's local training as DP-SGD: what :meth:`common.tasks.base.Task.fit` does, privately."""

    def __init__(self, table: PatientDP, release: Release):
        self.table = table
        self.release = release
        self.steps_done = 0  #: the enforcer sends no reply whose training did not come through here

    def fit(self, task, model, data, device, seed: int, extra_loss=None, optimizer=None) -> dict[str, float]:
        import torch
        from opacus import GradSampleModule

        kind = getattr(extra_loss, "patient_dp", None) if extra_loss is not None else None
        if extra_loss is not None and kind not in (PER_SAMPLE, DATA_FREE, SPLIT):
            raise PolicyRefusal("patient-dp: the method adds a loss term that declares neither per-sample nor "
                                "data-free (common/trust/patient_dp.py), so per-patient clipping cannot bound it")
        per_sample = extra_loss if kind == PER_SAMPLE else getattr(extra_loss, "per_sample_part", None)
        data_free = extra_loss if kind == DATA_FREE else getattr(extra_loss, "data_free_part", None)
        plan, release = task.cfg.patient_dp, self.release
        clip = self.table.max_grad_norm
        torch.manual_seed(seed)
        private = np.random.default_rng(secrets.randbits(128))  # sampling and noise the server cannot reproduce
        noise = torch.Generator(device="cpu").manual_seed(secrets.randbits(63))
        units = unit_ids(data, release.unit)
        members = np.argsort(units, kind="stable")
        starts = np.searchsorted(units[members], np.arange(release.units + 1))
        model.to(device).train()
        check_network(model)
        for module in model.modules():  # Opacus's backward hooks cannot see through in-place activations
            if getattr(module, "inplace", False):
                module.inplace = False
        if plan.train_layers == "head":
            from common.models.representations import classifier_head

            head = classifier_head(model, method="patient-dp.train-layers = 'head'")[1]
            for p in model.parameters():
                p.requires_grad_(False)
            head.requires_grad_(True)
        residuals = _out_of_place_residuals(model)
        view = model.per_sample_view() if hasattr(model, "per_sample_view") else model  # its parameters in leaves
        sampled = GradSampleModule(view, batch_first=True, loss_reduction="sum")
        params = [p for p in model.parameters() if p.requires_grad]
        if optimizer is None:
            optimizer = (torch.optim.SGD(params, lr=plan.learning_rate, momentum=plan.momentum) if plan.learning_rate
                         else task.make_optimizer(model))
        average = [p.detach().clone() for p in params] if plan.averaging else None
        expected = max(release.sample_rate * release.units, 1.0)
        total, count = 0.0, 0
        try:
            for _ in range(release.steps):
                chosen = np.flatnonzero(private.random(release.units) < release.sample_rate)
                summed = [torch.zeros_like(p) for p in params]
                for chunk in _whole_units(chosen, starts, plan.physical_batch):
                    loss = self._clipped_sum(task, sampled, params, data, members, starts, chunk, device, private,
                                             summed, clip, per_sample)
                    total, count = total + loss, count + len(chunk)
                for p, s in zip(params, summed):
                    s += torch.normal(0.0, release.noise_multiplier * clip, p.shape, generator=noise).to(device)
                    p.grad = s / expected
                if data_free is not None:  # its gradient reads no patient: added after the noise, at no privacy cost
                    for p, g in zip(params, torch.autograd.grad(data_free(model, None, None, None), params,
                                                                allow_unused=True)):
                        if g is not None:
                            p.grad += g
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                self.steps_done += 1
                if average is not None:
                    with torch.no_grad():
                        for a, p in zip(average, params):
                            a.mul_(plan.averaging).add_(p.detach(), alpha=1 - plan.averaging)
            if average is not None:
                with torch.no_grad():
                    for a, p in zip(average, params):
                        p.copy_(a)
        finally:
            sampled._close()
            for block in residuals:
                del block.forward
        return {"train-loss": total / max(count, 1)}

    def _clipped_sum(self, task, sampled, params, data, members, starts, chunk, device, rng, summed, clip,
                     per_sample=None) -> float:
        """Adds to ``summed`` the clipped gradients of the patients in ``chunk``; their mean loss per patient."""
        import torch

        from common.tasks.base import images_to_tensor, random_flips

        index = np.concatenate([members[starts[u]:starts[u + 1]] for u in chunk])
        owner = torch.from_numpy(np.repeat(np.arange(len(chunk)), np.diff(starts)[chunk])).to(device)
        k = task.cfg.patient_dp.augmentations
        x = images_to_tensor(np.repeat(data.images[index], k, axis=0), device)
        (x,) = random_flips(rng, x)
        y = torch.from_numpy(np.repeat(data.labels[index], k)).to(device)
        owner = owner.repeat_interleave(k)
        output = sampled(x)
        loss = task.loss(output, y)
        if per_sample is not None:  # a mean over the batch of each image's own term (MOON's), clipped with it
            loss = loss + per_sample(sampled, x, y, output)
        loss = loss * len(y) / k  # the sum over images of the mean over their augmentations
        with warnings.catch_warnings():  # torch's note that the first layer's input needs no gradient
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            loss.backward()
        per_unit = []
        for p in params:
            grads = p.grad_sample
            grouped = torch.zeros((len(chunk),) + tuple(p.shape), dtype=grads.dtype, device=device)
            per_unit.append(grouped.index_add_(0, owner, grads))
            p.grad_sample = None
            p.grad = None
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_unit))
        scale = torch.clamp(clip / (norms + 1e-12), max=1.0)
        for s, g in zip(summed, per_unit):
            s += torch.einsum("u,u...->...", scale, g)
        return float(loss.detach())


def _residual_block_forward(self, x):
    """MONAI's ``ResNetBlock.forward`` with ``out + residual`` for its in-place ``out += residual``: Opacus's hooks
    hand back their layer's output as a view, which autograd refuses to modify in place."""
    out = self.act(self.bn1(self.conv1(x)))
    out = self.bn2(self.conv2(out))
    return self.act(out + (self.downsample(x) if self.downsample is not None else x))


def _out_of_place_residuals(model) -> list:
    """The network's MONAI ResNet blocks (the built-in ``resnet18``), each given :func:`_residual_block_forward` for
    the training (``del block.forward`` restores its own)."""
    from monai.networks.nets.resnet import ResNetBlock

    blocks = [m for m in model.modules() if type(m) is ResNetBlock]
    for block in blocks:
        block.forward = types.MethodType(_residual_block_forward, block)
    return blocks


def _whole_units(chosen: np.ndarray, starts: np.ndarray, physical: int):
    """The chosen units in chunks of about ``physical`` images, no unit split."""
    chunk, size = [], 0
    for unit in chosen:
        n = int(starts[unit + 1] - starts[unit])
        if chunk and size + n > physical:
            yield np.asarray(chunk)
            chunk, size = [], 0
        chunk.append(int(unit))
        size += n
    if chunk:
        yield np.asarray(chunk)
