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

from pydantic import Field, ValidationError, create_model, field_validator, model_validator

from common.settings import ConfigError, Section, hyphenated
from common.trust.patient_dp_plan import PatientDPPlan
from common.trust.secure_aggregation import SecureAggregationSettings

__all__ = ["ConfigError", "Section", "JobConfig", "load_job_config"]

TaskName = Literal["classification", "polyp-segmentation", "brain-tumour-segmentation"]

#: Which data set formats each task can read.
TASK_DATASETS: dict[str, tuple[str, ...]] = {
    "classification": ("synthetic", "ham10000", "npz", "dicom"),
    "polyp-segmentation": ("synthetic", "image-mask", "dicom"),
    "brain-tumour-segmentation": ("synthetic", "brats", "dicom"),
}

_hyphen = hyphenated


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


class ScreeningSection(Section):
    """How the server screens hospital replies before aggregating (docs/faults.md): a hostile or broken
    hospital is refused with a logged reason, the round goes on with the others."""

    update_norm_limit: float = Field(10.0, ge=0.0, description=(
        "Refuse an update whose distance from the model the hospital received is more than this many times "
        "the median of the round's other updates (0: off). Honest hospitals measured at most 5.6x on the real "
        "data sets (benchmarks/results/screening_honest_norms.md)."))
    max_hospital_weight: float = Field(0.5, gt=0.0, le=1.0, description=(
        "Largest share of the aggregate any one hospital may have; the excess is spread over the others. 0.5: no "
        "hospital, whatever it declares, carries more than half of any average (two hospitals weigh equally); 1.0: "
        "plain sample weighting."))
    max_reply_mb: float = Field(0.0, ge=0.0, description=(
        "Largest reply, in MB of arrays once decoded (0: 4x the global state + 64 MB). Checked on declared sizes "
        "before anything is decompressed."))
    robust_aggregate: Literal["mean", "median", "trimmed-mean"] = Field("mean", description=(
        "FedAvg-family model aggregation: the sample-weighted mean, or Flower's FedMedian / FedTrimmedAvg rules "
        "(coordinate-wise, unweighted)."))
    trim_fraction: float = Field(0.2, ge=0.0, lt=0.5, description="trimmed-mean: share cut at each end.")
    max_samples: int = Field(10_000_000, ge=1, description=(
        "Most training samples a hospital may declare when it joins (a bound the consortium sets; a declared count "
        "weighs the hospital's updates): a node declaring more is refused, naming this key."))
    sample_ratio_limit: float = Field(10.0, ge=0.0, description=(
        "A hospital's update weighs at most this many times the median sample count of the round's other accepted "
        "hospitals (0: off), so no declared size can take the aggregate over; max-hospital-weight caps it besides."))
    refuse_unchanged: bool = Field(True, description=(
        "Refuse an update that returns the received model unchanged (a free-rider, whose weight would only pull "
        "the average back); each round records every hospital's update norm relative to the others' median."))


SAFE_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _built_in_networks(task: str) -> tuple[str, ...]:
    """The task's built-in network names; imported only for a config that names a model (the module imports torch,
    which reading a hospital's policy and node config, as ``fedmed console`` does, needs not)."""
    from common.models.networks import TASK_BUILT_IN

    return TASK_BUILT_IN[task]


class CoreConfig(Section):
    """Every run-config key but the methods' own tables (``JobConfig`` adds those). Defaults here equal those in
    pyproject.toml (a test keeps them in step)."""

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
    fraction_train: float = Field(1.0, ge=0.0, le=1.0, description=(
        "Fraction of the connected hospitals trained per round, at least min-train-hospitals (0: that many), as "
        "Flower's FedAvg samples."))
    min_train_hospitals: int = Field(2, ge=1, description="A round needs at least this many replies.")
    min_available_hospitals: int = Field(2, ge=1, description=(
        "Wait for this many hospitals before each round: up to the strategy's wait-for-nodes before round 1, up to "
        "round-timeout before a later one."))
    round_timeout: float = Field(600.0, gt=0.0, description="Seconds to wait for hospital replies per round.")
    messages_in_flight: int = Field(0, ge=0, description=(
        "Most messages pending at once; the next goes out as a reply comes in. 0: all at once in a deployment, "
        "one per CPU (at least 4) in Flower's simulation engine, whose state slows with every pending message "
        "(strategies/base.py)."))
    reply_store: Literal["disk", "memory"] = Field("disk", description=(
        "Where the server keeps a round's accepted replies until the round closes, in its own round loop: 'disk', "
        "files in <run>/.round-<n> (removed then), each reply screened and released as it arrives, so the ServerApp "
        "holds about 3 model sizes whatever the number of hospitals (docs/memory.md); 'memory': every reply in "
        "memory at once, as under Flower's own loop. The same aggregate bit for bit either way."))
    seed: int = Field(42, ge=0, le=2**32 - 1)
    batch_size: int = Field(32, ge=1)
    learning_rate: float = Field(1e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)

    dataset: str = Field("synthetic", description=(
        "A format we read (synthetic, ham10000, npz, image-mask, brats, dicom) or a loader of your own, "
        "'package.module:loader' (common/data/loaders.py says what it is given and returns)."))
    dataset_args: str = Field("", description=(
        "Keyword arguments for a loader of your own, a JSON object (a hospital's node config may add its own); "
        "dataset='dicom' classification takes its class names from '{\"classes\": [...]}'."))
    data_workers: int = Field(-1, ge=-1, description=(
        "Processes reading a torch Dataset of your own while a hospital trains (-1: 4 on a GPU, none on the "
        "CPU); batches go to a GPU from pinned memory."))
    data_dir: str = Field("", description="Simulation: the whole data set, partitioned across hospitals.")
    test_dir: str = Field("", description="Server's held-out test set (deployment); empty: split off data-dir.")
    image_size: int = Field(32, ge=8, le=1024)
    input_shape: str = Field("", description=(
        "One input of the network as 'C,H,W' (or 'C,D,H,W'), e.g. '1,64,64': the batch the server checks the "
        "network on before round 1 where it holds no data (a loader that gives the server none), and the "
        "in-channels the network is built with there; empty: the server's data, else 3 x image-size x image-size."))
    num_classes: int = Field(0, ge=0, description="0: take it from the data set.")
    model: str = Field("", description=(
        "The network: built in (classification: resnet18, MONAI's ResNet-18, or small-cnn, ~25k parameters for "
        "load tests; polyp-segmentation: polyp-unet; brain-tumour-segmentation: rfnet), or a factory of your own, "
        "'package.module:factory' (common/models/networks.py); empty: the task's built-in default."))
    model_args: str = Field("", description=(
        "Keyword arguments of the network's factory over the ones the task gives it (num_classes, in_channels, "
        "out_channels, spatial_dims, image_size), a JSON object, e.g. '{\"spatial_dims\": 2}'."))
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
    device: str = Field("auto", description=(
        "Where hospitals (unless their node config says) and the server compute: auto (a GPU where one is "
        "visible; in simulation the one Ray gave the hospital), cpu, cuda or cuda:N (common/devices.py)."))
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field("auto", description=(
        "Local training and evaluation in mixed precision: bf16 or fp16 autocast (fp16 with gradient scaling), "
        "fp32; auto: fp32 on the CPU, bf16 on a GPU that has it, else fp16."))
    evaluate_every: int = Field(1, ge=1, description="Evaluate the global model on the test set every N rounds.")
    cross_site_evaluation: bool = Field(False, description=(
        "After the last round every hospital scores the final global model (and its own, for methods that "
        "personalise) on its validation data: a hospitals x models table and heatmap in the run's results."))
    message_arrays: Literal["auto", "per-tensor", "flat", "packed"] = Field("auto", description=(
        "How a message's arrays travel (common/engine/wire.py): one Flower Array per tensor; 'flat': one Array "
        "per dtype "
        "of each array group, every tensor raveled into it, names and shapes in the config (weights still, for "
        "Flower's client-side DP and SecAgg+ mods; each Array costs the SuperLink milliseconds, so this is "
        "several seconds a round faster); 'packed': each group as one .npz Array (bytes: no mod can read it); "
        "'auto': flat in the strategy's own round loop, per tensor under Flower's (e.g. inside Flower's DP "
        "wrappers, which compare each reply with the sent model tensor by tensor)."))

    tracking: str = Field("none", description=(
        "Experiment tracking of every round from the server (docs/tracking.md): none, tensorboard (event files in "
        "<run>/tensorboard, extra fedmed-hospitals[tensorboard]), mlflow (a file store in <run>/mlruns unless "
        "tracking-uri, extra fedmed-hospitals[mlflow]), or both, 'tensorboard,mlflow'."))
    tracking_uri: str = Field("", description=(
        "MLflow: where runs go, a tracking server (http://host:5000), a database (sqlite:////abs/mlflow.db) or a "
        "file store (file:///abs/mlruns); empty: <run>/mlruns. Credentials go in MLFLOW_TRACKING_USERNAME/PASSWORD, "
        "never in the URI (run config reaches every hospital)."))
    select_by: str = Field("", description=(
        "Keep the best round's global model in checkpoints/best.npz besides the latest: a metric of the round "
        "records, e.g. 'test.dice', 'train.val-dice' (the hospitals' validation mean), 'min:test.loss'; without "
        "max:/min: loss and hd95 are minimised, other metrics maximised. Empty: no best model."))

    audit_log: str = Field("", description=(
        "The server's audit log (common/trust/audit.py, docs/privacy.md): every message it sends and receives (run, "
        "round, "
        "method, kind, bytes, SHA-256 of the content, the hospital), chained by SHA-256, appended across restarts. "
        "Empty: <results-dir>/<run-name>/audit.jsonl; 'none': no log."))

    screening: ScreeningSection = ScreeningSection()
    secure_aggregation: SecureAggregationSettings = SecureAggregationSettings()
    patient_dp: PatientDPPlan = PatientDPPlan()
    brain: BrainSection = BrainSection()

    @field_validator("input_shape")
    @classmethod
    def _input_shape(cls, value: str) -> str:
        if value.strip() and len(parse_input_shape(value)) not in (3, 4):
            raise ValueError(f"{value!r} is not one input's shape: 'C,H,W' or 'C,D,H,W' (channels first), "
                             "e.g. '1,64,64'")
        return value.strip()

    @property
    def input_dims(self) -> tuple[int, ...] | None:
        """``input-shape`` as numbers, None where it is not given."""
        return parse_input_shape(self.input_shape) if self.input_shape else None

    @field_validator("tracking")
    @classmethod
    def _known_trackers(cls, value: str) -> str:
        trackers = ("tensorboard", "mlflow")  # server_app/tracking.py
        items = [item.strip().lower() for item in value.replace(";", ",").split(",") if item.strip()]
        if items in ([], ["none"]):
            return "none"
        unknown = [item for item in items if item not in trackers]
        if unknown:
            raise ValueError(f"unknown tracker {unknown[0]!r}: use none, tensorboard, mlflow or 'tensorboard,mlflow'")
        return ",".join(dict.fromkeys(items))

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials_in_uri(cls, value: str) -> str:
        from urllib.parse import urlsplit

        value = value.strip()
        try:
            password = urlsplit(value).password
        except ValueError as error:
            raise ValueError(f"{value[:200]!r} is not a URI ({error})") from None
        if password is not None:
            raise ValueError("holds a password: the run config reaches every hospital, so give MLflow's "
                             "credentials in MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD on the server")
        return value

    @field_validator("select_by")
    @classmethod
    def _selectable_metric(cls, value: str) -> str:
        value = value.strip()
        if not value:
            return value
        tables = ("test", "train", "hospital_metrics", "method", "traffic", "update-norm", "update-norm-vs-median")
        numbers = ("bytes_up", "bytes_down", "seconds")  # the round record's own (server_app/results.py reads them)
        direction, _, path = value.partition(":") if value.startswith(("max:", "min:")) else ("", "", value)
        section, dot, key = path.partition(".")
        if not (section in tables and dot and key.strip(".") or section in numbers and not dot):
            raise ValueError(f"{value!r} is not a metric of the round records: use <table>.<metric> with table one "
                             f"of {', '.join(tables[:5])} (e.g. 'test.dice', 'train.val-accuracy', 'min:test.loss'), "
                             f"or one of {', '.join(numbers)}, with max: or min: in front to say which way is better")
        return f"{direction}:{path}" if direction else path

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        from common.devices import check_device

        return check_device(value)

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
        from common.methods.registry import method_names

        if value not in method_names():
            raise ValueError(f"unknown strategy {value!r}; choose one of {', '.join(method_names())}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "CoreConfig":
        custom_data = ":" in self.dataset
        if not custom_data and self.dataset not in TASK_DATASETS[self.task]:
            raise ValueError(
                f"dataset={self.dataset!r} does not fit task={self.task!r}; use one of "
                f"{', '.join(TASK_DATASETS[self.task])}, or a loader of your own as 'package.module:loader'")
        from common.trust.code_gate import parse_arguments

        built_in = _built_in_networks(self.task) if self.model and ":" not in self.model else ()
        if built_in and self.model not in built_in:
            raise ValueError(f"model={self.model!r} is not a built-in network of task={self.task!r} "
                             f"({', '.join(built_in)}) nor a factory of your own, "
                             "'package.module:factory'")
        for key, text in (("model-args", self.model_args), ("dataset-args", self.dataset_args)):
            try:
                parse_arguments(text, key)
            except ConfigError as error:
                raise ValueError(str(error)) from None
        if self.task == "polyp-segmentation" and self.model in ("", "polyp-unet"):
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
        folders = ("ham10000", "npz", "image-mask", "brats", "dicom")
        if self.dataset in folders and not self.data_dir and not self.test_dir:
            raise ConfigError(f"data-dir: dataset={self.dataset!r} needs data-dir (simulation) or test-dir")
        checks = [("data-dir", self.data_dir, "exists"), ("test-dir", self.test_dir, "exists"),
                  ("brain.server-data-dir", self.brain.server_data_dir, "exists"),
                  ("hospital-keys", self.hospital_keys, "is_dir"), ("resume-from", self.resume_from, "exists")]
        for key, value, test in checks:
            if not value:
                continue
            try:
                found = getattr(Path(value), test)()
            except OSError as error:  # a name too long, a symbolic link loop, a folder that cannot be searched
                raise ConfigError(f"{key}: {value[:200]!r} cannot be used as a path: {error.strerror or error}") \
                    from None
            if not found:
                what = "is not a folder of <hospital>.pub files" if key == "hospital-keys" else "does not exist"
                raise ConfigError(f"{key}: {value!r} {what}")


def _job_config_type() -> type[CoreConfig]:
    """The core keys with one table per method that has settings (``strategies/<method>/settings.py``), each
    method's defaults written once, in its settings class."""
    from common.methods.registry import settings_tables

    tables = {name: (table, table()) for name, table in settings_tables().items()}
    return create_model("JobConfig", __base__=CoreConfig, __doc__="Every run-config key: the core keys and each "
                        "method's table (strategies/<method>/settings.py).", **tables)


JobConfig = _job_config_type()


#: Keys that are the server's alone, never sent to hospitals: where it writes, what it resumes from, its test
#: set and the hospitals' registered keys, how it schedules rounds.
def parse_input_shape(value: str) -> tuple[int, ...]:
    """'1,64,64' -> (1, 64, 64); ValueError for anything but positive whole numbers."""
    try:
        dims = tuple(int(part) for part in value.replace("x", ",").split(","))
    except ValueError:
        raise ValueError(f"{value!r} is not one input's shape: whole numbers 'C,H,W', e.g. '1,64,64'") from None
    if any(d <= 0 for d in dims):
        raise ValueError(f"{value!r}: every size of an input's shape must be positive")
    return dims


SERVER_ONLY_KEYS = frozenset({"results-dir", "resume-from", "overwrite-run", "keep-checkpoints", "test-dir",
                              "hospital-keys", "cross-site-evaluation", "evaluate-every", "messages-in-flight",
                              "round-timeout", "min-available-hospitals", "min-train-hospitals", "fraction-train",
                              "tracking", "tracking-uri", "select-by", "audit-log", "reply-store"})
#: Keys a hospital never takes from a message: where it keeps its own memory (a server must not choose where a
#: hospital writes files).
HOSPITAL_OWN_KEYS = frozenset({"state-dir"})


def hospital_keys(cfg: "JobConfig") -> dict[str, Any]:
    """The part of the server's job every message carries: all of it but :data:`SERVER_ONLY_KEYS`, so that what a
    ServerApp sets in Python (a task, a model, a split) reaches the hospitals as it reaches the server."""
    return {k: v for k, v in cfg.to_flat().items() if k not in SERVER_ONLY_KEYS}


#: From this length on, a key of an app's own one edit from one of ours is taken for a typo of ours; shorter keys are
#: too often words of their own (``mode``/``model``, ``seeds``/``seed``) and are only warned about.
MIN_TYPO_LENGTH = 6


def fedmed_keys_of(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a Flower run config that are fedmed's. The others are the app's own (a ServerApp's or ClientApp's:
    ``lr``, ``mode``, ``result-file``, ``myapp.threshold``): left out here, logged once, and read by the app from its
    ``context.run_config``. A key taken for a misspelt one of ours (:func:`misspelt_key`) is a ConfigError naming
    the key meant."""
    import logging

    ours, foreign = {}, []
    for key, value in run_config.items():
        if key in _FLAT_KEYS:
            ours[key] = value
            continue
        problem = misspelt_key(key)
        if problem:
            raise ConfigError(f"run config key {key!r}: {problem}")
        foreign.append(key)
    log = logging.getLogger("fedmed")
    if foreign:
        log.info("run-config keys that are not fedmed's, left to the app: %s", ", ".join(sorted(foreign)))
    for key in foreign:
        near = next((k for k in sorted(_FLAT_KEYS) if one_edit_apart(normalised(key), k)), None)
        if near:
            log.warning("run-config key %r is not fedmed's and is left to the app; if you meant fedmed's %r, spell "
                        "it so", key, near)
    return ours


def misspelt_key(key: str) -> str | None:
    """Why ``key`` (not one of ours) is taken for a misspelt key of fedmed's, naming the key meant; None where it is
    an app's own. The rule (docs/own-serverapp.md): it is one of ours but for case or '_' for '-'
    (``learning_rate``); it lies in one of our tables (``fedprox.muu``), or in a table one edit from one of ours
    (``scrrening.max-reply-mb``); or it is one edit (a letter inserted, deleted, replaced, or two swapped) from a
    key of ours and at least :data:`MIN_TYPO_LENGTH` long (``num-server-round``)."""
    import difflib

    spelt = normalised(key)
    if spelt in _FLAT_KEYS:
        return f"did you mean {spelt!r}? (fedmed's keys are lower case, words joined by '-')"
    if spelt in _TABLES:
        return f"{spelt!r} is a table of fedmed's, not a key: write {spelt}.<key>"
    table, dot, rest = spelt.partition(".")
    if dot and table in _TABLES:
        fields = sorted(k.removeprefix(f"{table}.") for k in _FLAT_KEYS if k.startswith(f"{table}."))
        meant = next((f for f in fields if one_edit_apart(rest, f)), None) or next(
            iter(difflib.get_close_matches(rest, fields, n=1, cutoff=0.6)), None)
        hint = f"did you mean '{table}.{meant}'?" if meant else f"its keys are {', '.join(fields)}"
        return f"not a key of fedmed's table {table!r}; {hint}"
    if dot:
        meant = next((t for t in sorted(_TABLES) if len(table) >= MIN_TYPO_LENGTH and one_edit_apart(table, t)), None)
        if meant is None:
            return None  # a table of the app's own
        return (f"did you mean {meant + '.' + rest if meant + '.' + rest in _FLAT_KEYS else meant + '.<key>'!r}? "
                f"({table!r} is one letter from fedmed's table {meant!r}; an app's own table needs another name)")
    if len(spelt) < MIN_TYPO_LENGTH:
        return None
    meant = next((k for k in sorted(_FLAT_KEYS) if "." not in k and one_edit_apart(spelt, k)), None)
    if meant is None:
        return None
    return (f"did you mean {meant!r}? (a key of the app's own this close to one of fedmed's must go under a table "
            f"of its own, e.g. 'app.{key}')")


def normalised(key: str) -> str:
    """A key as fedmed spells its own: lower case, words joined by '-'."""
    return key.strip().lower().replace("_", "-")


def one_edit_apart(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by one edit: a character inserted, deleted or replaced, or two neighbours
    swapped (the optimal string alignment distance is 1)."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) > len(b):
        a, b = b, a
    i = next((k for k in range(len(a)) if a[k] != b[k]), len(a))  # the first difference
    if len(a) < len(b):
        return a[i:] == b[i + 1:]
    return a[i + 1:] == b[i + 1:] or (a[i:i + 2] == b[i:i + 2][::-1] and a[i + 2:] == b[i + 2:])


def server_settable_keys() -> list[str]:
    """The run-config keys a server may set in a hospital's job (its run config and every message): all of fedmed's
    but :data:`HOSPITAL_OWN_KEYS` and the server's own (``fedmed policy check`` prints them for the hospital). A
    node config may pin more (``dataset``); what code the keys may name is the hospital's too
    (common/trust/code_gate.py)."""
    return sorted(key for key in _FLAT_KEYS if key not in HOSPITAL_OWN_KEYS | SERVER_ONLY_KEYS | set(RENAMED_KEYS))


def hospital_job_config(run_config: Mapping[str, Any], message_config: Mapping[str, Any],
                        pinned: Mapping[str, Any] | None = None) -> "JobConfig":
    """A hospital's job: its run config, with the server's job from the message over it (all but
    :data:`HOSPITAL_OWN_KEYS`), and the keys the hospital ``pinned`` (its node config's) over both. Keys that are
    not fedmed's are left out: a user's own app (docs/own-serverapp.md) may have run-config keys of its own."""
    overrides = {k: v for k, v in message_config.items() if k in _FLAT_KEYS and k not in HOSPITAL_OWN_KEYS}
    merged = {k: v for k, v in {**run_config, **overrides}.items() if k in _FLAT_KEYS}
    return load_job_config({**merged, **dict(pinned or {})})


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


#: keys renamed since a checkpoint may have been written: old -> new (read as the new key)
RENAMED_KEYS = {"classifier": "model"}


def upgrade_keys(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A run config written before a key was renamed, with the new names (an old run resumes as it was)."""
    return {RENAMED_KEYS.get(key, key): value for key, value in flat.items()
            if not (key in RENAMED_KEYS and RENAMED_KEYS[key] in flat)}


def load_job_config(flat: Mapping[str, Any], *, check_paths: bool = False) -> JobConfig:
    """Validate a flat Flower run config; raise :class:`ConfigError` naming every bad key."""
    try:
        config = JobConfig.model_validate(unflatten(upgrade_keys(flat)))
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None
    if check_paths:
        config.check_paths()
    return config


_FLAT_KEYS = frozenset(JobConfig().to_flat()) | frozenset(RENAMED_KEYS)
_TABLES = frozenset(key.split(".")[0] for key in _FLAT_KEYS if "." in key)
