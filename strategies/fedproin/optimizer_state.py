"""A hospital's optimizer state as named arrays, so its Adam moments can outlive a round.

FedProIn's public code keeps one Adam per client for the whole run; here a hospital's method object
lives for one round (and its ClientApp process may too), so the moments go into the hospital's state
store (``common.methods.site.HospitalStateStore``) next to what else it remembers, and come back next time.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger("fedmed")
PREFIX = "optimizer/"


def optimizer_arrays(optimizer: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """``optimizer/<parameter index>/<name>`` -> array, for every per-parameter state tensor (Adam: step,
    exp_avg, exp_avg_sq)."""
    return {f"{PREFIX}{index}/{name}": value.detach().cpu().numpy().copy()
            for index, state in optimizer.state_dict()["state"].items()
            for name, value in state.items() if torch.is_tensor(value)}


def restore_optimizer(optimizer: torch.optim.Optimizer, arrays: dict[str, np.ndarray], owner: str) -> bool:
    """Load what :func:`optimizer_arrays` saved into a fresh optimizer over the same parameters; False (and a
    warning naming ``owner``) when nothing was saved or it does not fit, so training starts with fresh moments."""
    saved: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in arrays.items():
        if key.startswith(PREFIX):
            index, name = key.removeprefix(PREFIX).split("/", 1)
            saved.setdefault(int(index), {})[name] = torch.from_numpy(np.array(value))
    if not saved:
        return False
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    fits = set(saved) <= set(range(len(parameters))) and all(
        value.shape == parameters[index].shape for index, state in saved.items()
        for name, value in state.items() if name != "step")
    if not fits:
        log.warning("%s: saved optimizer state does not match the model's parameters; starting with fresh "
                    "moments", owner)
        return False
    optimizer.load_state_dict({"state": saved, "param_groups": optimizer.state_dict()["param_groups"]})
    return True
