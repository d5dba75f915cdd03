"""The one list of methods: name -> tasks it supports, its server and hospital halves, its Flower strategy.

Adding a method means a module here, a strategy module, and one entry below. Classes are named
by import path and loaded lazily, so validating a config imports neither torch models nor Flower.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

TWO_D = ("classification", "polyp-segmentation")
BRAIN = ("brain-tumour-segmentation",)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    tasks: tuple[str, ...]
    server: str
    hospital: str
    strategy: str
    summary: str


METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("fedavg", TWO_D, "common.methods.fedavg:FedAvgServer", "common.methods.fedavg:FedAvgHospital",
                   "strategies.fedavg:FedAvgStrategy", "Federated averaging weighted by sample counts"),
        MethodSpec("fedprox", TWO_D, "common.methods.fedavg:FedAvgServer", "common.methods.fedprox:FedProxHospital",
                   "strategies.fedprox:FedProxStrategy", "FedAvg with a proximal term on the hospital side"),
        MethodSpec("fedproin", ("classification",), "common.methods.fedproin:FedProInServer",
                   "common.methods.fedproin:FedProInHospital", "strategies.fedproin:FedProInStrategy",
                   "Learnable multi-prototypes, FDL + PCL, normalised influence aggregation"),
        MethodSpec("moon", ("classification",), "common.methods.fedavg:FedAvgServer",
                   "common.methods.moon:MoonHospital", "strategies.moon:MoonStrategy",
                   "FedAvg with a model-contrastive term on the representation"),
        MethodSpec("fedproto", ("classification",), "common.methods.fedproto:FedProtoServer",
                   "common.methods.fedproto:FedProtoHospital", "strategies.fedproto:FedProtoStrategy",
                   "Personal models that share per-class mean features (prototypes)"),
        MethodSpec("qfedpolyp", ("polyp-segmentation",), "common.methods.qfedpolyp:QFedPolypServer",
                   "common.methods.qfedpolyp:QFedPolypHospital", "strategies.qfedpolyp:QFedPolypStrategy",
                   "Quantisation-aware training, per-hospital b-bit packed uploads, FedAvg"),
        MethodSpec("fedmepd", BRAIN, "common.methods.fedmepd:FedMEPDServer", "common.methods.fedmepd:FedMEPDHospital",
                   "strategies.fedmepd:FedMEPDStrategy",
                   "Modality-specific encoders, per-filter personalised fusion decoder, multi-anchor LACCA"),
        MethodSpec("fedmepd-fedavg", BRAIN, "common.methods.fedmepd_baselines:SharedEncoderFedAvgServer",
                   "common.methods.fedavg:FedAvgHospital", "strategies.fedmepd:SharedEncoderFedAvgStrategy",
                   "Baseline: FedAvg of the whole model with one encoder shared by all modalities"),
        MethodSpec("fedmepd-federated-decoder", BRAIN, "common.methods.fedmepd_baselines:FederatedDecoderServer",
                   "common.methods.fedmepd_baselines:FederatedDecoderHospital",
                   "strategies.fedmepd:FederatedDecoderStrategy",
                   "Baseline: modality-specific encoders with a fully federated fusion decoder"),
        MethodSpec("fedmepd-local", BRAIN, "common.methods.fedmepd_baselines:LocalServer",
                   "common.methods.fedmepd_baselines:LocalHospital", "strategies.fedmepd:LocalOnlyStrategy",
                   "Baseline: every hospital (and the server) trains alone"),
    )
}


def method_names() -> list[str]:
    return sorted(METHODS)


def method_spec(name: str) -> MethodSpec:
    if name not in METHODS:
        raise KeyError(f"unknown strategy {name!r}; choose one of {', '.join(method_names())}")
    return METHODS[name]


def method_tasks(name: str) -> tuple[str, ...]:
    return method_spec(name).tasks


def load(path: str):
    module, attribute = path.split(":")
    return getattr(import_module(module), attribute)


def server_class(name: str):
    return load(method_spec(name).server)


def hospital_class(name: str):
    return load(method_spec(name).hospital)


def strategy_class(name: str):
    return load(method_spec(name).strategy)
