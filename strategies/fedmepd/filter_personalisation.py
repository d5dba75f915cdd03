"""FedMEPD's partial personalisation of the fusion decoder, filter by filter, in plain NumPy.

A *filter* is one output channel of a decoder layer: its kernel and its bias (every decoder
parameter's first axis). For every hospital and filter the server keeps

* a patience counter, starting at P: a round in which the hospital's change of the filter points
  against the server's own change (negative cosine) counts it down, an agreeing round resets it
  to P, a round without information (a zero change) leaves it; at 0 the filter turns personal for
  that hospital, for good;
* an aggregation weight w, starting at 1 (the public code's; or at the hospital's share of the round's
  samples, ``fedmepd.initial-weight='share'``) and moved by
  ``w <- m w + (1 - m) (||delta_server|| / (||delta_hospital|| + eps)) share`` (left as it is in a
  round without information); 0 once personal.

The server's decoder becomes ``lambda theta + (1 - lambda) sum_k w_k theta_k / sum_k w_k`` for each
filter some hospital contributes to (H_f > 0) and stays as it is otherwise. Personal masks travel
to hospitals bit-packed, one bit per filter, in the decoder's parameter-name order.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from common.arrays import NamedArrays

EPS = 1e-12


def filter_layers(arrays: NamedArrays) -> dict[str, list[str]]:
    """Parameter names grouped by layer (the name up to its last dot), in name order."""
    layers: dict[str, list[str]] = {}
    for name in sorted(arrays):
        layers.setdefault(name.rsplit(".", 1)[0], []).append(name)
    for layer, names in layers.items():
        if len({arrays[n].shape[0] if arrays[n].ndim else -1 for n in names}) != 1 or arrays[names[0]].ndim == 0:
            raise ValueError(f"layer {layer}: parameters {names} do not share a first (filter) axis")
    return layers


def kernels_only(layers: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each layer's kernel (``<layer>.weight``) without its bias, as the public code compares filters;
    a layer without a kernel keeps what it has."""
    return {layer: [n for n in names if n.endswith(".weight")] or names for layer, names in layers.items()}


def layer_sizes(arrays: NamedArrays) -> dict[str, int]:
    """Filters per layer, in the order masks are packed."""
    return {layer: int(arrays[names[0]].shape[0]) for layer, names in filter_layers(arrays).items()}


def filter_rows(arrays: NamedArrays, names: list[str]) -> np.ndarray:
    """(filters, values) in float64: each filter's kernel and bias side by side."""
    return np.concatenate([arrays[n].reshape(arrays[n].shape[0], -1).astype(np.float64) for n in names], axis=1)


def filter_cosines(a: NamedArrays, b: NamedArrays, layers: dict[str, list[str]]) -> dict[str, np.ndarray]:
    """Per layer and filter the cosine between two changes; NaN where either is zero."""
    cosines = {}
    for layer, names in layers.items():
        x, y = filter_rows(a, names), filter_rows(b, names)
        norms = np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            cosines[layer] = np.where(norms > EPS, (x * y).sum(axis=1) / norms, np.nan)
    return cosines


def filter_norms(delta: NamedArrays, layers: dict[str, list[str]]) -> dict[str, np.ndarray]:
    return {layer: np.linalg.norm(filter_rows(delta, names), axis=1) for layer, names in layers.items()}


def subtract(a: NamedArrays, b: NamedArrays) -> NamedArrays:
    return {name: a[name].astype(np.float64) - b[name].astype(np.float64) for name in b}


def pack_mask(masks: dict[str, np.ndarray], sizes: dict[str, int]) -> bytes:
    """One bit per filter, layers in ``sizes`` order."""
    bits = np.concatenate([np.asarray(masks[layer], dtype=bool).reshape(n) for layer, n in sizes.items()])
    return np.packbits(bits).tobytes()


def unpack_mask(data: bytes, sizes: dict[str, int]) -> dict[str, np.ndarray]:
    total = sum(sizes.values())
    if len(data) != (total + 7) // 8:
        raise ValueError(f"personal mask of {len(data)} bytes does not fit a decoder of {total} filters "
                         f"({(total + 7) // 8} bytes)")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=total).astype(bool)
    masks, start = {}, 0
    for layer, n in sizes.items():
        masks[layer] = bits[start:start + n]
        start += n
    return masks


def aggregate_filters(server: NamedArrays, uploads: list[Mapping[str, np.ndarray]],
                      weights: list[dict[str, np.ndarray]], layers: dict[str, list[str]],
                      server_momentum: float) -> tuple[NamedArrays, dict[str, np.ndarray]]:
    """Per-filter weighted mean of the uploads, EMA'd into the server's filters where any hospital
    contributes; returns the new arrays and, per layer, which filters had contributors.

    Each parameter's weighted sum goes upload by upload (an upload on disk is read one tensor at a time), the first
    term copied and the others added in order, as NumPy's sum over the stacked uploads adds them: the same values
    bit for bit, without every hospital's decoder in memory at once."""
    result, contributed = dict(server), {}
    for layer, names in layers.items():
        w = np.stack([weight[layer] for weight in weights]) if weights else np.zeros((0, server[names[0]].shape[0]))
        total = w.sum(axis=0)
        contributed[layer] = total > 0
        for name in names:
            shape = (-1,) + (1,) * (server[name].ndim - 1)
            mean = np.zeros(server[name].shape, dtype=np.float64)
            for h, upload in enumerate(uploads):
                term = w[h].reshape(shape) * upload[name].astype(np.float64)
                mean = term if h == 0 else np.add(mean, term, out=mean)
            mean = mean / np.where(total > 0, total, 1.0).reshape(shape)
            blended = server_momentum * server[name].astype(np.float64) + (1.0 - server_momentum) * mean
            result[name] = np.where(contributed[layer].reshape(shape), blended, server[name]).astype(server[name].dtype)
    return result, contributed


class FilterPersonalisation:
    """Patience counters, personal masks and aggregation weights of every hospital, per decoder layer.

    State is one array per (kind, layer) with a row per hospital, keyed by layer name.
    """

    def __init__(self, sizes: dict[str, int], patience: int, weight_momentum: float):
        self.sizes = dict(sizes)
        self.patience = patience
        self.weight_momentum = weight_momentum
        self.hospitals: list[str] = []
        self.counters: dict[str, dict[str, np.ndarray]] = {}
        self.personal: dict[str, dict[str, np.ndarray]] = {}
        self.weights: dict[str, dict[str, np.ndarray]] = {}

    def ensure(self, hospital: str, weight: float) -> None:
        """Start a hospital's state the first time it contributes: no personal filter, every weight ``weight``."""
        if hospital in self.personal:
            return
        self.hospitals.append(hospital)
        self.counters[hospital] = {layer: np.full(n, self.patience, np.int32) for layer, n in self.sizes.items()}
        self.personal[hospital] = {layer: np.zeros(n, bool) for layer, n in self.sizes.items()}
        self.weights[hospital] = {layer: np.full(n, weight, np.float64) for layer, n in self.sizes.items()}

    def mask(self, hospital: str) -> dict[str, np.ndarray]:
        if hospital not in self.personal:
            return {layer: np.zeros(n, bool) for layer, n in self.sizes.items()}
        return self.personal[hospital]

    def observe(self, hospital: str, cosines: dict[str, np.ndarray], norm_ratios: dict[str, np.ndarray],
                share: float) -> None:
        """One round's agreement of a hospital's decoder change with the server's."""
        for layer in self.sizes:
            personal = self.personal[hospital][layer]
            counter = self.counters[hospital][layer]
            cosine = cosines[layer]
            counter = np.where(cosine < 0, counter - 1, np.where(cosine > 0, self.patience, counter))
            personal |= counter <= 0
            self.counters[hospital][layer] = np.where(personal, 0, counter).astype(np.int32)
            m, old = self.weight_momentum, self.weights[hospital][layer]
            weight = np.where(np.isfinite(cosine), m * old + (1 - m) * norm_ratios[layer] * share, old)
            self.weights[hospital][layer] = np.where(personal, 0.0, weight)

    def fraction_personal(self, hospital: str) -> dict[str, float]:
        """The share of personal filters overall ('all') and per layer."""
        masks = self.mask(hospital)
        total = sum(self.sizes.values())
        fractions = {"all": float(sum(m.sum() for m in masks.values()) / total)}
        fractions.update({layer: float(m.mean()) for layer, m in masks.items()})
        return fractions

    # --- checkpoints ------------------------------------------------------------------------------
    def state_dict(self, prefix: str) -> dict[str, np.ndarray]:
        from common.methods.base import pack_json

        state = {f"{prefix}hospitals": pack_json(self.hospitals)}
        for kind, table in (("counter", self.counters), ("personal", self.personal), ("weight", self.weights)):
            for layer in self.sizes:
                rows = [table[h][layer] for h in self.hospitals]
                state[f"{prefix}{kind}/{layer}"] = np.stack(rows) if rows else np.zeros((0, self.sizes[layer]))
        return state

    def load_state_dict(self, state: dict[str, np.ndarray], prefix: str) -> None:
        from common.methods.base import unpack_json

        self.hospitals = list(unpack_json(state[f"{prefix}hospitals"]))
        for kind, table, dtype in (("counter", self.counters, np.int32), ("personal", self.personal, bool),
                                   ("weight", self.weights, np.float64)):
            table.clear()
            for h, hospital in enumerate(self.hospitals):
                table[hospital] = {layer: state[f"{prefix}{kind}/{layer}"][h].astype(dtype) for layer in self.sizes}
