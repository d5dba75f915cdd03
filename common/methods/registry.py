"""The one list of methods. Each method is a package under ``strategies/`` that declares its ``METHODS`` (a
``MethodSpec`` per strategy it offers) in its ``__init__``; adding a method is that package and one line in
:data:`METHOD_PACKAGES`.

Classes are named by import path and loaded when first used, so validating a config imports neither torch
models nor Flower.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import import_module
from typing import Any

from common.methods.privacy import UNDECLARED, PrivacyRules

TWO_D = ("classification", "polyp-segmentation")
BRAIN = ("brain-tumour-segmentation",)

#: Every method package, in the order the docs list them.
METHOD_PACKAGES = ("strategies.fedavg", "strategies.fedprox", "strategies.moon", "strategies.fedproto",
                   "strategies.fedproin", "strategies.fedbn", "strategies.qfedpolyp", "strategies.fedmepd")


@dataclass(frozen=True)
class MethodSpec:
    """What the rest of fedmed needs to know of a method, each class as ``"module:Class"``."""

    name: str  #: the run config's ``strategy`` value
    tasks: tuple[str, ...]  #: the tasks it can train
    server: str  #: its server half, a ``common.methods.base.ServerMethod``
    hospital: str  #: its hospital half, a ``common.methods.base.HospitalMethod``
    strategy: str  #: its Flower strategy, a ``strategies.base.HospitalStrategy``
    summary: str
    settings: str | None = None  #: its settings table (``common.settings.Section``), the one source of its defaults
    section: str | None = None  #: the run-config table of those settings (``fedproin`` for ``fedproin.*``)
    model_needs: str = "any"  #: what it needs of a model (``common.models.requirements``), checked before round 1
    #: what it sums under secure aggregation, a ``common.trust.secure_aggregation.SecureMethod``
    secure: str | None = None
    not_secure: str = ""  #: without ``secure``: why it does not run under secure aggregation
    #: what its training reply releases, a ``common.methods.privacy.PrivacyRules`` the hospital's policy enforces
    privacy: str | None = None
    #: why Flower's DP wrappers (``flwr.serverapp.strategy.DifferentialPrivacy*``) cannot take its replies, which they
    #: clip tensor by tensor against the model sent; empty: they can (a reply is the model as one ArrayRecord)
    not_for_central_dp: str = ""
    #: Flower's FedAvg contract fits it: its hospital step is plain local training of the model and its server half
    #: averages named arrays, so a standard Flower ClientApp that trains itself (one ArrayRecord of its own tensor
    #: names, one MetricRecord with the sample count) can be one of its hospitals, and its global model may be any
    #: network's, taken from ``initial_arrays`` (docs/own-serverapp.md). The others need fedmed's hospital step.
    flower_contract: bool = False


@cache
def methods() -> dict[str, MethodSpec]:
    specs: dict[str, MethodSpec] = {}
    for package in METHOD_PACKAGES:
        for spec in import_module(package).METHODS:
            if spec.name in specs:
                raise RuntimeError(f"{package} registers method {spec.name!r} a second time")
            specs[spec.name] = spec
    return specs


def method_names() -> list[str]:
    return sorted(methods())


def method_spec(name: str) -> MethodSpec:
    if name not in methods():
        raise KeyError(f"unknown strategy {name!r}; choose one of {', '.join(method_names())}")
    return methods()[name]


def method_tasks(name: str) -> tuple[str, ...]:
    return method_spec(name).tasks


def settings_tables() -> dict[str, Any]:
    """Run-config table name -> its settings class, for every method that has settings (one table may serve
    several methods, e.g. FedMEPD's and its ablations')."""
    tables: dict[str, Any] = {}
    for spec in methods().values():
        if spec.settings:
            tables.setdefault(spec.section or spec.name, load(spec.settings))
    return tables


def load(path: str):
    """``"package.module:attribute"`` -> the attribute."""
    module, _, attribute = path.partition(":")
    if not module or not attribute:
        raise ValueError(f"{path!r} is not 'package.module:name'")
    return getattr(import_module(module), attribute)


def privacy_rules(name: str) -> PrivacyRules:
    """What method ``name`` declares its reply releases (``common.methods.privacy.UNDECLARED`` when it declares
    nothing); KeyError for an unknown method."""
    spec = method_spec(name)
    return load(spec.privacy) if spec.privacy else UNDECLARED


def local_dp_method_names() -> list[str]:
    """The methods whose reply local DP can bound."""
    return sorted(name for name in methods() if privacy_rules(name).local_dp)


def server_class(name: str):
    return load(method_spec(name).server)


def hospital_class(name: str):
    return load(method_spec(name).hospital)


def strategy_class(name: str):
    return load(method_spec(name).strategy)
