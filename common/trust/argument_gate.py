"""What the server may hand a hospital's network and data loader: arguments that stay inside the hospital.

The code gate (``common/trust/code_gate.py``) decides which code a hospital runs; its arguments come from the server too
(``model-args``, ``dataset-args``, ``encoder-weights`` and the job's sizes). At a deployed hospital they may not:

- **download** anything: a pretrained flag (``"pretrained": true``, ``"weights": "DEFAULT"``...) is refused unless the
  hospital's policy says ``allow-pretrained = true`` (weights then come from the hospital's own cache), and while it
  answers, ``common/trust/sandbox.py`` refuses every connection and name lookup and puts the model hubs' libraries
  offline;
- **name a file** outside the hospital's own folders (data-dir, state-dir, the policy's ``argument-folders``): every
  string, dict keys included, is resolved as the loader would open it (``$VARIABLES`` and ``~`` expanded, relative
  to the working folder); one that looks like a path is refused with the same words whether or not it exists, and
  any other that names an existing file or folder (``".."``, ``"secret.key"``) is refused too;
- **size the job** past the hospital's limits (:data:`DEFAULT_JOB_LIMITS`, the policy's ``[job-limits]``):
  ``local-epochs=1e9`` or ``data-workers=100000`` would take the hospital's machine; ``model-parameters`` bounds
  the network ``model-args`` describe, counted on PyTorch's meta device before it is built
  (``common/models/networks.py``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

#: The most each job key may ask of a hospital unless its policy's ``[job-limits]`` says otherwise.
DEFAULT_JOB_LIMITS: dict[str, int] = {
    "local-epochs": 100, "batch-size": 1024, "data-workers": 16, "image-size": 1024, "synthetic-samples": 200_000,
    "brain.crop-size": 256, "brain.crops-per-case": 64, "brain.synthetic-cases": 2000, "brain.synthetic-size": 256,
    "model-parameters": 250_000_000,
}
#: Argument names (any case, '-' or '_') that make a network or loader fetch weights or data.
DOWNLOAD_FLAGS = frozenset({"pretrained", "pretrain", "use_pretrained", "pretrained_weights", "weights", "download",
                            "from_pretrained", "pretrained_path", "weights_path", "checkpoint", "ckpt", "url",
                            "hub", "repo_id"})
#: A string argument is read as a path when it holds a separator, starts with '~', names a URL, or ends in a
#: weights or data file's suffix.
_PATH_LIKE = re.compile(r"[/\\]|^~|://|\.(pt|pth|ckpt|bin|safetensors|onnx|npz|npy|csv|tsv|json|ya?ml|toml|txt|nii"
                        r"(\.gz)?|h5|hdf5|pkl|pickle|zip|tar(\.gz)?|png|jpe?g)$", re.IGNORECASE)
#: The keys whose values are handed to the hospital's code as they are.
ARGUMENT_KEYS = ("model-args", "dataset-args")


def looks_like_path(value: str) -> bool:
    return bool(_PATH_LIKE.search(value.strip()))


def as_opened(value: str) -> str:
    """``value`` as code that takes it for a path opens it: variables and ``~`` expanded (relative: to the working
    folder)."""
    return os.path.expanduser(os.path.expandvars(value.strip()))


def inside(value: str, folders: tuple[str | Path, ...]) -> bool:
    """Whether ``value``, as the hospital's code would open it (links followed), lies in one of ``folders``."""
    try:
        resolved = Path(os.path.realpath(as_opened(value)))
        roots = [Path(os.path.realpath(folder)) for folder in folders if folder]
    except (OSError, ValueError):
        return False
    return any(resolved == root or root in resolved.parents for root in roots)


def _flag_name(key: str) -> str:
    return key.lower().replace("-", "_")


def names_outside(value: str, roots: tuple[str | Path, ...]) -> bool:
    """Whether the string ``value`` would reach a file outside ``roots``: it looks like a path (or expands to one),
    or it names a file or folder that exists, and it does not lie in them."""
    opened = as_opened(value)
    try:
        named = looks_like_path(value) or looks_like_path(opened) or os.path.lexists(opened)
    except (OSError, ValueError):
        named = True
    return named and not inside(value, roots)


def _walk(value: Any, where: str) -> Iterator[tuple[str, str, Any]]:
    """(where, key, value) of every entry of a JSON value, nested ones included."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield f"{where}.{key}", str(key), item
            yield from _walk(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield f"{where}[{index}]", "", item
            yield from _walk(item, f"{where}[{index}]")


def argument_problems(cfg: Any, folders: tuple[str | Path, ...], allow_pretrained: bool,
                      limits: Mapping[str, int]) -> list[str]:
    """Every reason the job ``cfg`` (the server's keys over the hospital's run config) reaches outside the hospital:
    a download flag, a path outside ``folders``, a job key above ``limits``. Empty: it stays inside."""
    from common.trust.code_gate import parse_arguments

    roots = tuple(folder for folder in folders if folder)
    named = "its data-dir, state-dir and its policy's argument-folders"  # never the paths: they stay here
    problems = []
    flat = cfg.to_flat()
    for key in ARGUMENT_KEYS:
        text = flat.get(key) or ""
        try:
            arguments = parse_arguments(text, key) if text else {}
        except ValueError as error:
            problems.append(str(error))
            continue
        for where, name, value in _walk(arguments, key):
            # a flag is on unless it is false, 0, null or empty: the string "false" is true to the code that reads it
            if name and _flag_name(name) in DOWNLOAD_FLAGS and bool(value) and not allow_pretrained:
                problems.append(f"{where}={value!r} would fetch weights or data from outside the hospital; its "
                                "policy does not allow-pretrained")
            elif (name and names_outside(name, roots)) or (isinstance(value, str) and names_outside(value, roots)):
                problems.append(f"{where} names a file or address outside this hospital's own folders "
                                f"({named}), so it was not read")
    weights = str(flat.get("encoder-weights") or "")
    if weights and not inside(weights, roots):
        problems.append(f"encoder-weights names a file outside this hospital's own folders ({named}), so it was "
                        "not read")
    for key, most in sorted(limits.items()):
        value = flat.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > most:
            problems.append(f"{key}={value:g} is more than this hospital allows ({most}; its policy's [job-limits] "
                            "sets it)")
    return problems
