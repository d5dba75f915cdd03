"""Our Flower strategies, one package per method (``strategies/<method>/``: settings, server half, hospital half,
strategy), listed in ``common/methods/registry.py``. Each strategy is a Flower ``Strategy`` that owns its method:

    from strategies import FedProInStrategy
    strategy = FedProInStrategy(fraction_train=0.5, min_train_nodes=2, num_prototypes=2)
    result = strategy.start(grid, initial_arrays=strategy.initial_arrays(), num_rounds=10)

The strategy classes are loaded when first asked for, so ``strategies.<method>.server`` and ``.hospital`` (plain
PyTorch/NumPy) import without Flower, e.g. on a GPU machine that has none. See docs/own-serverapp.md.
"""

from __future__ import annotations

from typing import Any

_HELPERS = {"HospitalStrategy": "strategies.base:HospitalStrategy",
            "strategy_arguments": "strategies.base:strategy_arguments"}


def _exports() -> dict[str, str]:
    from common.methods.registry import methods

    return {**_HELPERS, **{spec.strategy.rpartition(":")[2]: spec.strategy for spec in methods().values()}}


def __getattr__(name: str) -> Any:
    if name == "__all__":  # ``from strategies import *``: the helpers and every registered method's strategy
        return list(_exports())
    path = _exports().get(name)
    if path is None:
        raise AttributeError(f"module 'strategies' has no attribute {name!r}")
    from common.methods.registry import load

    return load(path)


def __dir__() -> list[str]:
    return sorted({*globals(), *_exports()})

