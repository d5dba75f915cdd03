"""A ServerApp written against Flower's API alone, plus one of our strategies (docs/own-serverapp.md)."""

import json
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from strategies import FedProInStrategy

app = ServerApp()


def prototype_spread(server_round: int, arrays: ArrayRecord) -> MetricRecord:  # a central check of the user's own
    prototypes = arrays["prototypes"].numpy()
    return MetricRecord({"prototype-spread": float(prototypes.std())})


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedProInStrategy(fraction_train=1.0, min_train_nodes=2, min_available_nodes=2, num_prototypes=2,
                                fdl_weight=1.0, pcl_weight=1.0, run_config=context.run_config)  # own keys left alone
    result = strategy.start(grid, initial_arrays=strategy.initial_arrays(), num_rounds=2,
                            train_config=ConfigRecord({"local-epochs": 1}), evaluate_fn=prototype_spread)
    summary = {"train": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
               "central": {r: dict(m) for r, m in result.evaluate_metrics_serverapp.items()},
               "arrays": list(result.arrays.keys())}
    Path(str(context.run_config["result-file"])).write_text(json.dumps(summary, indent=1))
