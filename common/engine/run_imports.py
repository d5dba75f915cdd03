"""A run's own code, found again after the run. A run may name its network and data loader by import path
(``model='pkg.nets:make'``, ``dataset='pkg.data:load'``, factories in ``model-args``); the server records in every
checkpoint (``run/import-paths``) the folders those modules were imported from, e.g. the app folder Flower installed
the run's app in, and the post-run tools (``fedmed evaluate``, ``fedmed export-int8``) import them from there, or
from ``--app-dir``, or say exactly what to pass.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from common.settings import ConfigError

if TYPE_CHECKING:
    from common.config import JobConfig

IMPORT_PATHS_KEY = "run/import-paths"  #: checkpoint entry: the folders the run's own modules came from
_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def own_modules(cfg: "JobConfig") -> dict[str, str]:
    """The modules the run names by import path, by the key naming each (``model``, ``dataset``, ``model-args
    encoder``): its network, its loader, and factories given in ``model-args`` (FedMEPD's encoder and decoder)."""
    from common.trust.code_gate import BUILT_IN_NETWORKS, parse_arguments

    named = {"model": cfg.model if cfg.model not in BUILT_IN_NETWORKS else "", "dataset": cfg.dataset}
    try:
        named.update({f"model-args {key}": value for key, value in parse_arguments(cfg.model_args, "model-args").items()
                      if isinstance(value, str)})
    except ConfigError:
        pass
    return {key: value.partition(":")[0] for key, value in named.items() if _IMPORT_PATH.match(value)}


def _installed_roots() -> set[Path]:
    paths = sysconfig.get_paths()
    return {Path(paths[name]).resolve() for name in ("purelib", "platlib", "stdlib", "platstdlib") if name in paths}


def import_roots(cfg: "JobConfig") -> list[str]:
    """The folders (of ``sys.path``) the run's own modules were imported from, those of installed packages left out:
    what another process needs on its path to import them again."""
    roots: set[str] = set()
    installed = _installed_roots()
    for module in own_modules(cfg).values():
        top = sys.modules.get(module.split(".")[0])
        if top is None:
            continue
        file = getattr(top, "__file__", None)
        if file:
            root = Path(file).resolve().parent
            if Path(file).name == "__init__.py":
                root = root.parent
        else:  # a namespace package
            locations = list(getattr(top, "__path__", []))
            if not locations:
                continue
            root = Path(locations[0]).resolve().parent
        if root not in installed:
            roots.add(str(root))
    return sorted(roots)


@contextlib.contextmanager
def run_modules_importable(cfg: "JobConfig", state: Mapping[str, Any],
                           app_dir: str | Path | None = None) -> Iterator[None]:
    """The run's own modules imported, with ``app_dir`` and the folders its checkpoint ``state`` records on the path
    (restored after); a ConfigError naming the key and saying what to pass when one cannot be imported."""
    from common.methods.base import unpack_json

    recorded = [str(p) for p in unpack_json(state[IMPORT_PATHS_KEY])] if IMPORT_PATHS_KEY in state else []
    if app_dir is not None and not Path(app_dir).is_dir():
        raise ConfigError(f"--app-dir: {app_dir} is not a folder")
    added = [str(Path(app_dir).resolve())] if app_dir is not None else []
    added += [root for root in recorded if Path(root).is_dir() and root not in added]
    before = list(sys.path)
    sys.path[:0] = [root for root in added if root not in sys.path]
    try:
        for key, module in own_modules(cfg).items():
            try:
                importlib.import_module(module)
            except ImportError as error:
                raise ConfigError(cannot_import(key, module, error, recorded, app_dir)) from None
        yield
    finally:
        sys.path[:] = before


def cannot_import(key: str, module: str, error: ImportError, recorded: list[str], app_dir: str | Path | None) -> str:
    """What to pass so that ``module`` (named by the run config's ``key``) can be imported."""
    top = module.split(".")[0]
    where = [f"--app-dir {app_dir} does not hold it"] if app_dir is not None else []
    if recorded:
        gone = [root for root in recorded if not Path(root).is_dir()]
        where.append(f"the run imported its code from {', '.join(recorded)}" + (" (gone now)" if gone else ""))
    else:
        where.append("the run's checkpoint records no folder it imported its code from (it came from an installed "
                     "package, or the run predates the record)")
    return (f"{key}: module {module!r} of the run cannot be imported here ({error}); {'; '.join(where)}. Pass "
            f"--app-dir FOLDER, the folder holding {top}/ or {top}.py (the run's app folder), or run with "
            f"PYTHONPATH=FOLDER, or install the package")
