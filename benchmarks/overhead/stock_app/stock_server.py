"""Stock-style ServerApp: Flower's FedAvg and its own round loop. It only records when each round ends
(through ``evaluate_fn``, which Flower calls after every round) and the slowest hospital's compute time."""

import json
import time

from flwr.app import ArrayRecord, Context, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from common.models.small_cnn import build_small_cnn

app = ServerApp()


def slowest(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """Keep the largest compute time of the round (hospitals work in parallel)."""
    values = [next(iter(r.metric_records.values())) for r in records]
    keys = [k for k in values[0] if k.endswith("-seconds")]
    return MetricRecord({k: max(float(v[k]) for v in values) for k in keys})


@app.main()
def main(grid: Grid, context: Context) -> None:
    ends: list[float] = []
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=1.0,
                      min_available_nodes=int(context.run_config.get("min-nodes", 2)),
                      train_metrics_aggr_fn=slowest, evaluate_metrics_aggr_fn=slowest)

    def mark(server_round: int, arrays: ArrayRecord):
        ends.append(time.time())
        return None

    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(build_small_cnn(4).state_dict()),
                            num_rounds=int(context.run_config["num-server-rounds"]), evaluate_fn=mark)
    rounds = []
    for rnd in range(1, len(ends)):
        train = result.train_metrics_clientapp.get(rnd, {})
        evaluate = result.evaluate_metrics_clientapp.get(rnd, {})
        rounds.append({"round": rnd, "seconds": ends[rnd] - ends[rnd - 1],
                       "hospital-seconds": float(train.get("train-seconds", 0.0))
                       + float(evaluate.get("eval-seconds", 0.0))})
    with open(str(context.run_config["timings-file"]), "w") as handle:
        json.dump(rounds, handle)
