"""The consortium's DP-SGD plan: the run config's ``patient-dp`` table, read by the server and every hospital (the
hospital's own policy, ``[patient-dp]``, holds the privacy numbers: common/trust/patient_dp.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.settings import Section


class PatientDPPlan(Section):
    """The consortium's DP-SGD plan (run config ``patient-dp.*``); the hospital's policy holds the privacy numbers."""

    batch_size: int = Field(256, ge=1, description=(
        "Patients expected in one step's logical batch: each is drawn with probability batch-size / its patients."))
    steps: int = Field(0, ge=0, description="Steps per round (0: local-epochs expected passes over the patients).")
    learning_rate: float = Field(1.0, ge=0.0, description=(
        "SGD's step on the noised mean gradient, for every method (0: the method's own optimizer, else the task's "
        "Adam at learning-rate). Adam divides by the noise's own scale, so it mostly follows the noise: on the blood "
        "cells at sigma 1 it learnt nothing where SGD with momentum reached 0.45."))
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD's momentum.")
    physical_batch: int = Field(256, ge=1, description=(
        "Images per backward pass (whole patients each): memory, never the privacy."))
    augmentations: int = Field(1, ge=1, description=(
        "Augmentation multiplicity: each image's gradient is the mean over this many random flips of it, before "
        "its patient's gradient is clipped (De et al. 2022)."))
    averaging: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "Parameter averaging: the reply is the exponential moving average of the round's steps with this decay "
        "(0: the last step's)."))
    train_layers: Literal["all", "head"] = Field("all", description=(
        "What DP-SGD trains: every layer, or the classifier's last linear layer alone on a frozen (pretrained) "
        "encoder, whose far fewer coordinates each carry the same noise (the field's usual start under DP)."))
    group_norm: bool = Field(False, description=(
        "Build the network with GroupNorm (groups of 16 channels) in place of BatchNorm, at the server and every "
        "hospital: DP-SGD needs per-sample gradients, which BatchNorm does not have."))
