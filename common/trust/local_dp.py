"""Local DP at a hospital: its update clipped and noised before it leaves, and the accountant that turns the
noise of every release into epsilon (Google's ``dp-accounting``, installed by the ``privacy`` extra)."""

from __future__ import annotations

import math
import secrets
from typing import Mapping

import numpy as np

from common.settings import ConfigError
from common.trust.policy import PolicyRefusal


def accountant_module():
    try:
        import dp_accounting
    except ImportError:
        raise ConfigError("the policy's local-dp needs Google's dp-accounting to count epsilon: pip install "
                          "'fedmed-hospitals[privacy]' (or dp-accounting) in the hospital's environment") from None
    return dp_accounting


def epsilon_of(noise_multipliers: list[float | None], delta: float) -> float:
    """Epsilon at ``delta`` of the Gaussian mechanisms with these noise multipliers (relative to their sensitivity),
    composed (RDP accountant); a release without noise (None) makes it infinite; no release, 0."""
    if not noise_multipliers:
        return 0.0
    if any(z is None for z in noise_multipliers):
        return math.inf
    dp_accounting = accountant_module()
    from dp_accounting import rdp

    accountant = rdp.RdpAccountant()
    counts: dict[float, int] = {}
    for z in noise_multipliers:
        counts[float(z)] = counts.get(float(z), 0) + 1
    for z, count in sorted(counts.items()):
        accountant.compose(dp_accounting.GaussianDpEvent(z), count)
    return float(accountant.get_epsilon(delta))


def effective_noise_multiplier(method: str, noise_multiplier: float) -> float:
    """The noise multiplier of one round's release of ``method`` relative to its sensitivity when one sample of the
    hospital's data is replaced by another, as the method declares it (``PrivacyRules.noise_multiplier``: sigma / 2
    for a clipped update, which moves by at most 2C; FedProIn adds its noised influence counts)."""
    from common.methods.registry import privacy_rules

    return privacy_rules(method).noise_multiplier(noise_multiplier)


def noise_rng() -> np.random.Generator:
    """Noise the server cannot reproduce: seeded from the operating system's entropy, never from the run's seed
    (which the server knows)."""
    return np.random.default_rng(secrets.randbits(128))


def clip_and_noise(received: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray], clip_norm: float,
                   noise_multiplier: float, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], float]:
    """``received + clip(trained - received, C) + N(0, (sigma C)^2)``, every array; the update's norm before
    clipping. Arrays must be floating point of the received shapes (anything else could leave unbounded)."""
    deltas: dict[str, np.ndarray] = {}
    for name, value in trained.items():
        value = np.asarray(value)
        base = received.get(name)
        if base is None or np.shape(base) != value.shape or value.dtype.kind != "f":
            raise PolicyRefusal(f"local-dp: array {name!r} of the reply is not a floating-point array of the received "
                                "model, so its change cannot be bounded")
        deltas[name] = value.astype(np.float64) - np.asarray(base, dtype=np.float64)
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in deltas.values()))
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    std = noise_multiplier * clip_norm
    noised = {}
    for name, delta in deltas.items():
        value = np.asarray(received[name], dtype=np.float64) + scale * delta + rng.normal(0.0, std, delta.shape)
        if name.endswith("running_var"):  # post-processing: a variance stays positive (the server refuses others)
            value = np.maximum(value, 1e-5)
        noised[name] = value.astype(np.asarray(trained[name]).dtype)
    return noised, norm
