"""The job's settings: one validated model shared by the server, the hospitals and the benchmarks.

Flower hands run config over as a flat dict whose nested tables are joined with dots
(``fedprox.mu``). :func:`load_job_config` unflattens it and validates it with pydantic, so an
unknown key, a wrong type or an impossible value stops the run before round 1 with a message that
names the key, in the spelling the user typed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

TaskName = Literal["classification", "polyp-segmentation", "brain-tumour-segmentation"]
DatasetName = Literal["synthetic", "ham10000", "npz", "image-mask", "brats"]

#: Which data set formats each task can read.
TASK_DATASETS: dict[str, tuple[str, ...]] = {
    "classification": ("synthetic", "ham10000", "npz"),
    "polyp-segmentation": ("synthetic", "image-mask"),
    "brain-tumour-segmentation": ("synthetic", "brats"),
}


class ConfigError(ValueError):
    """A run or node configuration that cannot work; the message names the key at fault."""


def _hyphen(name: str) -> str:
    return name.replace("_", "-")


class Section(BaseModel):
    """Base for every config table: hyphenated keys, unknown keys refused, values checked on assignment."""

    model_config = ConfigDict(
        alias_generator=_hyphen, populate_by_name=True, extra="forbid", validate_assignment=True, strict=True,
        allow_inf_nan=False,  # a learning rate or timeout of inf/nan is a typo, not a setting
    )


class FedProxSection(Section):
    mu: float = Field(0.01, ge=0.0, description="Weight of the proximal term (mu/2)||w - w_global||^2.")


class FedProInSection(Section):
    """FedProIn (docs/fedproin.md).

    Ablations: fdl-weight=0 (no FDL), pcl-weight=0 (no PCL), aggregation='fedavg' (no NIA)."""

    num_prototypes: int = Field(2, ge=1, le=4, description="M, learnable prototypes per class (paper: 2 on HAM10000).")
    task_loss: Literal["dce", "mcel", "mcl"] = Field("dce", description=(
        "Distance-based cross-entropy over all classes (default, docs/fedproin.md has the measurements), or the "
        "paper's minimum classification error, or the margin loss."))
    mcel_xi: float = Field(0.05, gt=0.0, description="xi in sigmoid(xi * (d_true - d_rival)), squared distances.")
    mcl_margin: float = Field(0.5, ge=0.0, description="Margin of the MCL loss relu(d_true - d_rival + margin).")
    dce_gamma: float = Field(0.05, gt=0.0, description="gamma in cross-entropy(-gamma * d_class), squared distances.")
    fdl_weight: float = Field(1.0, ge=0.0, description="lambda_FDL: feature divergence loss (0: off).")
    pcl_weight: float = Field(1.0, ge=0.0, description="lambda_PCL: prototype contrastive loss (0: off).")
    pcl_margin: float = Field(0.5, ge=0.0, description="m in relu((d_glob - d_prev) / (d_glob + d_prev) + m).")
    aggregation: Literal["nia", "fedavg"] = Field("nia", description="Prototypes by normalised influence or FedAvg.")
    class_balanced: bool = Field(False, description=(
        "Draw training samples class-balanced, with replacement (the paper's; off by default, docs/fedproin.md)."))
    class_augmentation: bool = Field(False, description="Augment class c with probability 1 - n_c / n_max (paper's).")
    prototype_learning_rate: float = Field(0.0, ge=0.0, description="Adam step for prototypes; 0: learning-rate.")
    prototype_init: Literal["normal", "class-means", "feature-moments"] = Field("normal", description=(
        "Prototypes at the start: N(0, 1) from the server (paper); or, at each hospital of round 1, K-means "
        "centres of its class-c features under the received encoder ('class-means'), or N(0, 1) scaled and "
        "shifted to its features' per-dimension std and mean ('feature-moments')."))
    keep_optimizer_state: bool = Field(False, description=(
        "Keep a hospital's Adam moments from one of its rounds to the next (public code), in its state store."))
    epoch_draws: Literal["samples", "max-class"] = Field("samples", description=(
        "Class-balanced draws per epoch: as many as the hospital's samples (a FedAvg epoch's cost), or "
        "n_max x classes present (public code)."))
    reseed_after: int = Field(0, ge=0, description=(
        "Re-seed a prototype that no hospital's samples chose for this many rounds in a row (0: never)."))
    reseed_rule: Literal["split", "far-sample"] = Field("split", description=(
        "How: the server copies the class's most-used prototype (plus 1 % noise), or ('far-sample') each receiving "
        "hospital puts it at its class sample farthest from the class's prototypes."))


class MoonSection(Section):
    mu: float = Field(1.0, ge=0.0, description="Weight of MOON's model-contrastive term.")
    temperature: float = Field(0.5, gt=0.0, description="Temperature of the cosine similarities.")


class FedProtoSection(Section):
    proto_weight: float = Field(1.0, ge=0.0,
                                description="lambda: weight of MSE(feature, global prototype of its class).")


class QFedPolypSection(Section):
    """QFedPolyp (docs/qfedpolyp.md): each hospital's uplink bit-width, the downlink's, and QAT on/off."""

    bit_widths: str = Field("8", description="Uplink bit-width per hospital in name order, e.g. '8,8,8,16,16'; "
                                             "one value: every hospital. Each 2..16, or 32 for plain floats. "
                                             "A hospital's node config 'bit-width' wins over this list.")
    downlink_bit_width: int = Field(32, description="Bit-width of the global model sent to hospitals "
                                                    "(32: plain floats).")
    qat: bool = Field(True, description="Fake-quantise weights to the hospital's bit-width in local training "
                                        "(quantise='weights'; updates are quantised after full-precision training).")
    quantise: Literal["weights", "update"] = Field("weights", description=(
        "What a hospital sends at its bit-width: its trained weights (the paper's), or its round's update "
        "(trained minus received weights, far narrower per tensor); BatchNorm statistics then go as floats."))
    error_feedback: bool = Field(False, description=(
        "quantise='update': a hospital adds what quantisation lost last time to its next update "
        "(kept in its state folder)."))

    @model_validator(mode="after")
    def _feedback_needs_updates(self) -> "QFedPolypSection":
        if self.error_feedback and self.quantise != "update":
            raise ValueError("qfedpolyp.error-feedback=true needs qfedpolyp.quantise='update'")
        return self

    @field_validator("bit_widths", mode="before")
    @classmethod
    def _single_number(cls, value):
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value  # bit-widths=8

    @field_validator("bit_widths")
    @classmethod
    def _bit_width_list(cls, value: str) -> str:
        from common.quantization.codec import check_bit_width

        items = [item.strip() for item in value.split(",")]
        if not all(item.lstrip("-").isdigit() for item in items):
            raise ValueError(f"{value!r} is not a comma-separated list of integers such as '8,8,8,16,16'")
        for item in items:
            check_bit_width(int(item), f"bit-width {item}")
        return ",".join(items)

    @field_validator("downlink_bit_width")
    @classmethod
    def _downlink(cls, value: int) -> int:
        from common.quantization.codec import check_bit_width

        return check_bit_width(value, "downlink bit-width")

    @property
    def bit_width_list(self) -> list[int]:
        return [int(item) for item in self.bit_widths.split(",")]


#: The paper's 8 hospitals (BraTS 2018 table): T1c; T2; FLAIR+T1c; T1+T2; FLAIR+T1c+T1; FLAIR+T1+T2; full; full.
PAPER_HOSPITAL_MODALITIES = "t1ce;t2;flair,t1ce;t1,t2;flair,t1ce,t1;flair,t1,t2;flair,t1ce,t1,t2;flair,t1ce,t1,t2"


class BrainSection(Section):
    """Brain tumour task (docs/fedmepd.md): network size, crops, which cases and modalities each party holds.
    Defaults are the paper's (16-32-64-128 channels, 80^3 crops at full resolution)."""

    widths: str = Field("16,32,64,128", description="Channels of the 4 encoder/decoder scales, finest first.")
    crop_size: int = Field(80, ge=8, description="Edge of training crops and sliding windows, a multiple of 8.")
    downsample: int = Field(1, ge=1, le=4, description="Volumes are shrunk by this factor after cropping to the brain.")
    crops_per_case: int = Field(1, ge=1, description="Random crops drawn from each case per epoch (paper: 1).")
    window_overlap: float = Field(0.5, ge=0.0, lt=1.0,
                                  description="Sliding-window overlap at evaluation (0.5: stride 40 of 80).")
    server_data_dir: str = Field("", description="The server's own full-modality training cases; "
                                                 "empty: simulation takes server-fraction of data-dir.")
    server_fraction: float = Field(0.2, gt=0.0, lt=0.9,
                                   description="Simulation: share of the cases the server trains on.")
    hospital_modalities: str = Field(PAPER_HOSPITAL_MODALITIES, description=(
        "Simulation: modalities of hospital 0, 1, ... separated by ';' (a node config 'modalities' wins)."))
    synthetic_cases: int = Field(24, ge=4, description="Generated data: volumes in all (server, hospitals, test).")
    synthetic_size: int = Field(32, ge=16, le=256, description="Generated data: edge of each volume in voxels.")

    @field_validator("widths")
    @classmethod
    def _four_widths(cls, value: str) -> str:
        items = [item.strip() for item in value.split(",")]
        if len(items) != 4 or not all(item.isdigit() and int(item) >= 2 for item in items):
            raise ValueError(f"{value!r} must be 4 comma-separated channel counts of at least 2, e.g. '16,32,64,128'")
        return ",".join(items)

    @field_validator("crop_size")
    @classmethod
    def _multiple_of_eight(cls, value: int) -> int:
        if value % 8:
            raise ValueError(f"{value} is not a multiple of 8 (the network halves a crop three times)")
        return value

    @field_validator("hospital_modalities")
    @classmethod
    def _modality_subsets(cls, value: str) -> str:
        from common.data.brats import parse_modalities

        for item in value.split(";"):
            try:
                parse_modalities(item)
            except ValueError as error:
                raise ValueError(f"{item!r}: {error}") from None
        return value

    @property
    def width_tuple(self) -> tuple[int, ...]:
        return tuple(int(item) for item in self.widths.split(","))


class FedMEPDSection(Section):
    """FedMEPD (docs/fedmepd.md): partial personalisation of the fusion decoder and multi-anchor LACCA."""

    patience: int = Field(10, ge=0, description="P: rounds of negative cosine in a row before a filter turns personal.")
    warmup_rounds: int = Field(30, ge=0, description="Rounds before patience counters and weights start to move.")
    server_momentum: float = Field(0.3, ge=0.0, le=1.0,
                                   description="lambda: server decoder = lambda*server + (1-lambda)*hospitals.")
    weight_momentum: float = Field(0.95, ge=0.0, lt=1.0, description="EMA of the per-filter hospital weights.")
    num_anchors: int = Field(4, ge=1, description="N_k: anchors per class and scale (K-means clusters).")
    anchor_momentum: float = Field(0.999, ge=0.0, le=1.0, description="EMA of the anchors after their K-means start.")
    lacca: bool = Field(True, description="Hospitals calibrate decoder features with the anchors (false: ablation).")
    server_change_from: Literal["sent", "aggregated"] = Field("sent", description=(
        "The server's decoder change delta_s is its trained decoder minus the decoder it held before "
        "aggregating ('sent', the public code's) or minus the aggregate ('aggregated', this project's first rule)."))
    initial_weight: Literal["one", "share"] = Field("one", description=(
        "A hospital's filter weights start at 1, an unweighted mean until the warm-up ends (the public code's), "
        "or at its share of the round's samples."))
    filter_vector: Literal["kernel", "kernel-and-bias"] = Field("kernel", description=(
        "What a filter's cosine and norms are computed on: its kernel (the public code's) or kernel and bias."))


class ScreeningSection(Section):
    """How the server screens hospital replies before aggregating (docs/faults.md): a hostile or broken
    hospital is refused with a logged reason, the round goes on with the others."""

    update_norm_limit: float = Field(10.0, ge=0.0, description=(
        "Refuse an update whose distance from the model the hospital received is more than this many times "
        "the median of the round's other updates (0: off). Honest hospitals measured at most 5.6x on the real "
        "data sets (benchmarks/results/screening_honest_norms.md)."))
    max_hospital_weight: float = Field(1.0, gt=0.0, le=1.0, description=(
        "Largest share of the aggregate any one hospital may have; the excess is spread over the others."))
    max_reply_mb: float = Field(0.0, ge=0.0, description=(
        "Largest reply, in MB of arrays once decoded (0: 4x the global state + 64 MB). Checked on declared sizes "
        "before anything is decompressed."))
    robust_aggregate: Literal["mean", "median", "trimmed-mean"] = Field("mean", description=(
        "FedAvg-family model aggregation: the sample-weighted mean, or Flower's FedMedian / FedTrimmedAvg rules "
        "(coordinate-wise, unweighted)."))
    trim_fraction: float = Field(0.2, ge=0.0, lt=0.5, description="trimmed-mean: share cut at each end.")


SAFE_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class JobConfig(Section):
    """Every run-config key. Defaults here equal those in pyproject.toml (a test keeps them in step)."""

    run_name: str = Field("", max_length=120, description=(
        "Folder under results-dir (letters, digits, '.', '_', '-'); empty: <task>-<strategy>-<date-time>."))
    overwrite_run: bool = Field(False, description="Replace an existing run folder of the same name (else refused).")
    hospital_keys: str = Field("", description=(
        "Folder of the hospitals' public keys, <hospital>.pub (the files registered with `flwr supernode "
        "register`): a node must sign its identity with that hospital's key, or it is refused."))
    task: TaskName = "classification"
    strategy: str = "fedavg"
    num_server_rounds: int = Field(5, ge=1)
    local_epochs: int = Field(1, ge=1)
    fraction_train: float = Field(1.0, gt=0.0, le=1.0, description="Fraction of hospitals trained per round.")
    min_train_hospitals: int = Field(2, ge=1, description="A round needs at least this many replies.")
    min_available_hospitals: int = Field(2, ge=1, description="Wait for this many hospitals before round 1.")
    round_timeout: float = Field(600.0, gt=0.0, description="Seconds to wait for hospital replies per round.")
    messages_in_flight: int = Field(0, ge=0, description=(
        "Most messages pending at once; the next goes out as a reply comes in. 0: all at once in a deployment, "
        "one per CPU (at least 4) in Flower's simulation engine, whose state slows with every pending message "
        "(strategies/base.py)."))
    seed: int = Field(42, ge=0, le=2**32 - 1)
    batch_size: int = Field(32, ge=1)
    learning_rate: float = Field(1e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)

    dataset: DatasetName = "synthetic"
    data_dir: str = Field("", description="Simulation: the whole data set, partitioned across hospitals.")
    test_dir: str = Field("", description="Server's held-out test set (deployment); empty: split off data-dir.")
    image_size: int = Field(32, ge=8, le=1024)
    num_classes: int = Field(0, ge=0, description="0: take it from the data set.")
    classifier: Literal["resnet18", "small-cnn"] = Field(
        "resnet18", description="Classification network: MONAI ResNet-18, or a ~25k-parameter CNN (load tests).")
    resnet_width: float = Field(1.0, gt=0.0, le=4.0, description=(
        "Channel multiplier of the ResNet-18 (MONAI widen_factor): 1.0 is the standard network (45 MB); "
        "0.25 (16-32-64-128 channels, 128-d features) is the CPU benchmark preset's; 1.5 (100 MB) the large-model "
        "benchmark's."))
    encoder_weights: str = Field("", description=(
        "A pretrained ResNet-18 state-dict file (a 'fc.*' head is ignored): the initial encoder of every "
        "classification method, read by the server (FedProto's hospitals build their first model too, so "
        "with FedProto each hospital reads the same path)."))
    partitioner: Literal["iid", "dirichlet", "by-source"] = "iid"
    dirichlet_alpha: float = Field(0.5, gt=0.0)
    min_partition_size: int = Field(10, ge=1)
    val_fraction: float = Field(0.1, ge=0.0, lt=0.5)
    test_fraction: float = Field(0.2, gt=0.0, lt=0.9)
    synthetic_samples: int = Field(1200, ge=20, description="Training samples the generator makes in all.")

    results_dir: str = "results"
    state_dir: str = Field("state", description="Simulation: root of the virtual hospitals' state folders.")
    resume_from: str = Field("", description="Checkpoint file or run folder to continue from.")
    keep_checkpoints: int = Field(2, ge=1, description="Round checkpoints kept besides the latest.")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    evaluate_every: int = Field(1, ge=1, description="Evaluate the global model on the test set every N rounds.")
    cross_site_evaluation: bool = Field(False, description=(
        "After the last round every hospital scores the final global model (and its own, for methods that "
        "personalise) on its validation data: a hospitals x models table and heatmap in the run's results."))
    message_arrays: Literal["auto", "per-tensor", "flat", "packed"] = Field("auto", description=(
        "How a message's arrays travel (common/wire.py): one Flower Array per tensor; 'flat': one Array per dtype "
        "of each array group, every tensor raveled into it, names and shapes in the config (weights still, for "
        "Flower's client-side DP and SecAgg+ mods; each Array costs the SuperLink milliseconds, so this is "
        "several seconds a round faster); 'packed': each group as one .npz Array (bytes: no mod can read it); "
        "'auto': flat in the strategy's own round loop, per tensor under Flower's (e.g. inside Flower's DP "
        "wrappers, which compare each reply with the sent model tensor by tensor)."))

    screening: ScreeningSection = ScreeningSection()
    fedprox: FedProxSection = FedProxSection()
    fedproin: FedProInSection = FedProInSection()
    moon: MoonSection = MoonSection()
    fedproto: FedProtoSection = FedProtoSection()
    qfedpolyp: QFedPolypSection = QFedPolypSection()
    brain: BrainSection = BrainSection()
    fedmepd: FedMEPDSection = FedMEPDSection()

    @field_validator("run_name")
    @classmethod
    def _safe_run_name(cls, value: str) -> str:
        if value and (not SAFE_RUN_NAME.match(value) or ".." in value):
            raise ValueError(f"{value!r} is not a safe folder name: use letters, digits, '.', '_' and '-', "
                             "no path separators or '..'")
        return value

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        from common.methods.registry import method_names  # local: the registry imports this module

        if value not in method_names():
            raise ValueError(f"unknown strategy {value!r}; choose one of {', '.join(method_names())}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "JobConfig":
        if self.dataset not in TASK_DATASETS[self.task]:
            raise ValueError(
                f"dataset={self.dataset!r} does not fit task={self.task!r}; "
                f"use one of {', '.join(TASK_DATASETS[self.task])}"
            )
        if self.task == "polyp-segmentation":
            from common.models.unet2d import PolypUNet  # local: torch is not needed to read a config

            if self.image_size % PolypUNet.SIZE_MULTIPLE:
                raise ValueError(f"image-size={self.image_size}: the polyp U-Net halves an image three times, so "
                                 f"its edge must be a multiple of {PolypUNet.SIZE_MULTIPLE} (e.g. 16, 32, 128)")
        if self.encoder_weights and self.task != "classification":
            raise ValueError(f"encoder-weights: pretrained encoder weights are for the classification ResNet-18; "
                             f"this job's task is {self.task}")
        if self.min_available_hospitals < self.min_train_hospitals:
            raise ValueError("min-available-hospitals must be at least min-train-hospitals")
        from common.methods.registry import method_tasks

        if self.task not in method_tasks(self.strategy):
            raise ValueError(f"strategy={self.strategy!r} does not support task={self.task!r}")
        return self

    # --- conveniences ---------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.results_dir) / (self.run_name or "unnamed")

    def to_flat(self) -> dict[str, Any]:
        """Flat dotted-key dict, the shape of Flower's run config."""
        return flatten(self.model_dump(by_alias=True))

    def check_paths(self) -> None:
        """Paths the server itself reads must exist (checked before round 1)."""
        if self.dataset != "synthetic" and not self.data_dir and not self.test_dir:
            raise ConfigError(f"data-dir: dataset={self.dataset!r} needs data-dir (simulation) or test-dir")
        for key in ("data_dir", "test_dir"):
            value = getattr(self, key)
            if value and not Path(value).exists():
                raise ConfigError(f"{_hyphen(key)}: {value!r} does not exist")
        if self.brain.server_data_dir and not Path(self.brain.server_data_dir).exists():
            raise ConfigError(f"brain.server-data-dir: {self.brain.server_data_dir!r} does not exist")
        if self.hospital_keys and not Path(self.hospital_keys).is_dir():
            raise ConfigError(f"hospital-keys: {self.hospital_keys!r} is not a folder of <hospital>.pub files")
        if self.resume_from and not Path(self.resume_from).exists():
            raise ConfigError(f"resume-from: {self.resume_from!r} does not exist")


#: Run-config keys the server sends with every message and a hospital takes from it over its own run
#: config: which method runs and how it trains (the number of rounds sets learning-rate schedules). Data,
#: model size and paths stay the hospital's own.
SERVER_SET_KEYS = ("strategy", "num-server-rounds", "local-epochs", "batch-size", "learning-rate", "weight-decay",
                   "seed", "message-arrays")
SERVER_SET_SECTIONS = ("fedprox", "fedproin", "moon", "fedproto", "qfedpolyp", "fedmepd")


def server_set_keys(cfg: "JobConfig") -> dict[str, Any]:
    """The part of ``cfg`` a hospital takes from the server (see :data:`SERVER_SET_KEYS`)."""
    return {k: v for k, v in cfg.to_flat().items() if is_server_set(k)}


def is_server_set(key: str) -> bool:
    return key in SERVER_SET_KEYS or key.split(".")[0] in SERVER_SET_SECTIONS and key in _FLAT_KEYS


def hospital_job_config(run_config: Mapping[str, Any], message_config: Mapping[str, Any]) -> "JobConfig":
    """A hospital's job: its run config, with the server-set keys of the message's config over it.

    Keys that are not fedmed's are left out: the ServerApp validated the run config before round 1,
    and a user's own ServerApp (docs/own-serverapp.md) may have run-config keys of its own."""
    overrides = {k: v for k, v in message_config.items() if is_server_set(k)}
    return load_job_config({k: v for k, v in {**run_config, **overrides}.items() if k in _FLAT_KEYS})


def flatten(nested: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {'.'.join(parts[:-1])} is a value, not a table")
        node[parts[-1]] = value
    return nested


def describe_validation_error(error: ValidationError, what: str = "run config") -> str:
    """One line per problem, each naming the key as the user spells it (``fedprox.mu``)."""
    lines = []
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "(whole config)"
        message = problem["msg"]
        if problem["type"] == "extra_forbidden":
            message = "unknown key"
        lines.append(f"{what} key {key!r}: {message} (got {problem.get('input')!r})")
    return "; ".join(lines)


def load_job_config(flat: Mapping[str, Any], *, check_paths: bool = False) -> JobConfig:
    """Validate a flat Flower run config; raise :class:`ConfigError` naming every bad key."""
    try:
        config = JobConfig.model_validate(unflatten(flat))
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None
    if check_paths:
        config.check_paths()
    return config


_FLAT_KEYS = frozenset(JobConfig().to_flat())
