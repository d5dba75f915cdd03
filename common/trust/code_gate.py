"""Which code a hospital runs by name: its built-in networks and loaders, and the import paths it approved.

The run config and every message name a network and a data loader (``model``, ``dataset``, the brain network's
``model-args`` encoder and decoder), and a name may be an import path, ``package.module:callable``. Both come from
the server, so a hospital that imported whatever they name would run whatever the coordinator chose
(``model='os:system' model-args='{"command": ...}'``). A hospital therefore imports only:

- the built-in networks and data formats (by name, or by the import path they stand for);
- import paths it approved itself, in its node config (``models``, ``datasets``: comma-separated) or its policy
  (``models = ["monai.networks.nets:DenseNet121", "my_site.nets:*"]``), where ``*`` matches any run of characters.

Approval is by kind: a pattern (``monai.*``, ``*``, ``my_site.nets:*``) approves only networks, classes that subclass
``torch.nn.Module``, whose constructor arguments are data; a function or any other callable (a data loader, a
factory, ``monai.utils.misc:run_cmd``, ``torch:load``) runs only when the hospital named it exactly.

:func:`CodeGate.check` names every path that is not approved before anything is imported; while a hospital answers
a message, :func:`common.models.networks.load_factory` asks :func:`refusal` again before each import, so a path
that reaches it some other way is refused too. A virtual hospital of Flower's simulation engine (node config of
only ``partition-id``/``num-partitions``, no policy) takes the run config's paths: there one operator writes the
run config and runs every hospital on their own machine (docs/privacy.md); only that engine's own node config
is virtual (``client_app/node_config.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import json
from dataclasses import dataclass
from typing import Any, Iterator

from common.settings import ConfigError

#: the kinds of code a job names: networks (and network parts) and data loaders
MODELS, DATASETS = "models", "datasets"

#: built-in networks (``common/models/``): name -> "module:factory" (each takes the task's keyword arguments it names)
BUILT_IN_NETWORKS: dict[str, str] = {
    "resnet18": "common.models.resnet:build_resnet18_classifier",
    "small-cnn": "common.models.small_cnn:build_small_cnn",
    "polyp-unet": "common.models.unet2d:PolypUNet",
    "rfnet": "common.models.rfnet:MultimodalSegNet",
}
#: the data formats we read, each a loader of the task's (``common.tasks.base.Task.builtin_data``)
DATA_FORMATS = ("synthetic", "ham10000", "npz", "image-mask", "brats", "dicom")


def built_in(kind: str) -> tuple[str, ...]:
    """The names (and the import paths they stand for) a hospital runs without listing them."""
    if kind == MODELS:
        return tuple(BUILT_IN_NETWORKS) + tuple(BUILT_IN_NETWORKS.values())
    return DATA_FORMATS


def kind_of(key: str) -> str:
    """The kind of code a config key names: ``dataset`` a loader, anything else (``model``, ``model-args encoder``)
    a network."""
    return DATASETS if key.split(" ")[0] == "dataset" else MODELS


def named_code(cfg: Any) -> list[tuple[str, str]]:
    """Every (key, name) of code the job ``cfg`` names: its network, its loader and, for the brain network, the
    encoder and decoder factories in ``model-args``."""
    named = [("model", cfg.model), ("dataset", cfg.dataset)]
    if cfg.task == "brain-tumour-segmentation" and cfg.model_args:
        for part in ("encoder", "decoder"):
            value = parse_arguments(cfg.model_args, "model-args").get(part)
            if value is not None:
                named.append((f"model-args {part}", str(value)))
    return [(key, name) for key, name in named if name]


@dataclass(frozen=True)
class CodeGate:
    """A hospital's approved import paths; ``trust_run_config`` for a simulation's virtual hospital."""

    models: tuple[str, ...] = ()
    datasets: tuple[str, ...] = ()
    trust_run_config: bool = False
    source: str = "node config"  #: where the lists come from, for the refusal's reason
    max_parameters: int = 0  #: the most parameters a network it builds may have (0: no limit)

    def approved(self, kind: str) -> tuple[str, ...]:
        return self.models if kind == MODELS else self.datasets

    def named_exactly(self, key: str, name: str) -> bool:
        """Whether ``name`` is built in or listed as it is, not only matched by a pattern."""
        return self.trust_run_config or name in built_in(kind_of(key)) or name in self.approved(kind_of(key))

    def allows(self, key: str, name: str) -> bool:
        """Whether ``name`` may be imported (what it resolves to is checked then: :meth:`kind_refusal`)."""
        return self.named_exactly(key, name) or any(fnmatch.fnmatchcase(name, pattern)
                                                    for pattern in self.approved(kind_of(key)))

    def kind_refusal(self, key: str, name: str, obj: object) -> str | None:
        """Why ``obj``, which ``name`` resolved to, is not run although a pattern matched ``name``: a pattern
        approves networks (``torch.nn.Module`` classes) only; None when it is one or the hospital named it
        exactly."""
        if self.named_exactly(key, name) or is_network_class(obj):
            return None
        return (f"{name!r} is a {type(obj).__name__}, not a network class, and a pattern approves only "
                f"networks (torch.nn.Module classes): a hospital that wants to run it lists {name!r} exactly under "
                f"'{kind_of(key)}' in its {self.source}")

    def refusal(self, key: str, name: str) -> str | None:
        """Why ``name`` (named by ``key``) is not run here; None when it is approved."""
        if self.allows(key, name):
            return None
        kind = kind_of(key)
        listed = ", ".join(self.approved(kind)) or "none"
        return (f"{key}={name!r} is not code this hospital approved, so it was not imported (built in: "
                f"{', '.join(built_in(kind)[:6])}...; approved {kind} in its {self.source}: {listed}); a hospital "
                f"that wants it lists it under '{kind}' in its node config or policy")

    def problems(self, cfg: Any) -> list[str]:
        """Every refusal for the code ``cfg`` names (empty: all approved); once every name is approved, what each
        resolves to is checked too (:func:`resolution_problems`: approved modules are then imported)."""
        refused = [reason for key, name in named_code(cfg) if (reason := self.refusal(key, name))]
        if refused:
            return refused
        with self.enforced():
            return resolution_problems(cfg)

    @contextlib.contextmanager
    def enforced(self) -> Iterator[None]:
        """While inside, :func:`load_factory` imports only what this gate allows."""
        token = _GATE.set(self)
        try:
            yield
        finally:
            _GATE.reset(token)


_GATE: contextvars.ContextVar[CodeGate | None] = contextvars.ContextVar("fedmed_code_gate", default=None)


def refusal(key: str, name: str) -> str | None:
    """The gate in force (a hospital answering a message) refuses ``name``: why; None outside a hospital's answer
    (the server, benchmarks, in-process runs) or when it is approved."""
    gate = gate_in_force()
    return None if gate is None else gate.refusal(key, name)


def gate_in_force() -> CodeGate | None:
    """The gate of the hospital answering now (None: the server, benchmarks, in-process runs)."""
    return _GATE.get()


def is_network_class(obj: object) -> bool:
    import inspect

    import torch

    return inspect.isclass(obj) and issubclass(obj, torch.nn.Module)


#: Callables that turn a string into an object, module or code run (MONAI's ``instantiate``, ``pydoc.locate``,
#: ``importlib.import_module``...): never a network or loader, whatever pattern they match, since with
#: ``model-args`` they reach anything (``{"__path": "os.system", ...}``). Anything defined in Python's standard
#: library is refused too (``os:system``, ``builtins:eval``).
BUILDER_NAMES = frozenset({"instantiate", "locate", "import_module", "optional_import", "import_string", "get_class",
                           "get_obj", "get_object", "load_submodules", "dynamic_import", "load_class", "call",
                           "eval", "exec", "compile", "getattr", "__import__"})
#: Packages whose callables build objects from names or text (a config parser's classes included).
BUILDER_MODULES = ("monai.bundle", "monai.utils.module", "hydra", "omegaconf", "importlib", "pydoc", "runpy",
                   "torch.hub", "torch.package", "yaml", "pickle", "dill", "cloudpickle", "jsonpickle")


def kind_problem(kind: str, name: str, obj: object) -> str | None:
    """Why the object ``name`` resolved to is not a network (``models``) or data loader (``datasets``) of its
    module (None: it is): it must be defined in the module the name imports (or a submodule of it: not re-exported
    from elsewhere), be a class (a ``torch.nn.Module`` subclass for a network) or a function, and build no object
    from a name (:data:`BUILDER_NAMES`, :data:`BUILDER_MODULES`, the standard library)."""
    import inspect
    import sys

    module = name.partition(":")[0]
    defined_in = str(getattr(obj, "__module__", "") or "")
    what = "network" if kind == MODELS else "data loader"
    if defined_in.split(".")[0] in sys.stdlib_module_names or defined_in == "builtins":
        return f"{name!r} is Python's own {defined_in}.{getattr(obj, '__name__', '?')}, not a {what}"
    if defined_in != module and not defined_in.startswith(module + "."):
        return (f"{name!r} is defined in {defined_in or 'no module'}, not in {module} (a name the module imported "
                f"from elsewhere is not its {what})")
    short = str(getattr(obj, "__name__", "")).lower()
    if short in BUILDER_NAMES or any(defined_in == m or defined_in.startswith(m + ".") for m in BUILDER_MODULES):
        return f"{name!r} builds objects from names ({defined_in}.{getattr(obj, '__name__', '?')}), not a {what}"
    if inspect.isclass(obj):
        if kind == MODELS and not is_network_class(obj):
            return f"{name!r} is a class but not a torch.nn.Module, so not a network"
        return None
    if not inspect.isfunction(obj):
        return f"{name!r} is a {type(obj).__name__}, neither a class nor a function"
    return None


def resolution_problems(cfg: Any) -> list[str]:
    """Why a network or loader ``cfg`` names by import path is none (it cannot be imported, or it resolves to what
    :func:`kind_problem` refuses); empty when each is one. Imports the modules (those a gate in force allows)."""
    problems = []
    for key, name in named_code(cfg):
        if is_import_path(name) and name not in BUILT_IN_NETWORKS and name not in DATA_FORMATS:
            try:
                load_factory(name, key)
            except ConfigError as error:
                problems.append(str(error))
    return problems


def wide_patterns(patterns: tuple[str, ...]) -> list[str]:
    """The approved patterns that match modules the hospital has not named one by one (``monai.*``, ``my_site*``):
    every module of a package, including its helpers (``fedmed policy check`` warns about them)."""
    return [pattern for pattern in patterns if any(c in pattern.partition(":")[0] for c in "*?[")]


def split_list(text: str) -> tuple[str, ...]:
    """A node config's list: comma- or whitespace-separated."""
    return tuple(item for item in text.replace(",", " ").split() if item)


class CodeRefused(ConfigError):
    """A hospital was asked to import code it did not approve (``common/trust/code_gate.py``); nothing was imported."""


def is_import_path(name: str) -> bool:
    return ":" in name


def parse_arguments(text: str, key: str) -> dict[str, Any]:
    """``'{"depth": 3}'`` -> ``{"depth": 3}``; ConfigError naming ``key`` for anything but a JSON object."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{key}: {text!r} is not JSON ({error.msg}); write a JSON object such as "
                          "'{\"spatial_dims\": 2}'") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{key}: {text!r} is not a JSON object of keyword arguments")
    return value


def load_factory(name: str, key: str = "model"):
    """The callable a model (or data set) name stands for: a built-in name or ``package.module:attribute``;
    ConfigError naming ``key`` when it cannot be imported."""
    from importlib import import_module

    path = BUILT_IN_NETWORKS.get(name, name)
    module, _, attribute = path.partition(":")
    if not module or not attribute:
        raise ConfigError(f"{key}: {name!r} is neither a built-in network ({', '.join(BUILT_IN_NETWORKS)}) nor "
                          "'package.module:factory'")
    refused = refusal(key, name)  # a hospital imports only the code it approved
    if refused:
        raise CodeRefused(refused)
    try:
        factory = getattr(import_module(module), attribute)
    except ImportError as error:
        raise ConfigError(f"{key}: {name!r}: module {module!r} cannot be imported ({error})") from None
    except AttributeError:
        raise ConfigError(f"{key}: {name!r}: module {module!r} has no {attribute!r}") from None
    if not callable(factory):
        raise ConfigError(f"{key}: {name!r} is not callable")
    gate = gate_in_force()
    problem = kind_problem(kind_of(key), name, factory) if name not in BUILT_IN_NETWORKS else None
    problem = problem or (gate.kind_refusal(key, name, factory) if gate is not None else None)
    if problem:
        raise CodeRefused(f"{key}: {problem}; it was not run")
    return factory
