"""Times train messages with K Arrays (the same number of floats in all, split K ways) to every node and back:
the push (ServerApp to SuperLink), and the whole round trip (SuperNode poll, ClientApp process, reply, pull)."""

import json
import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


def message(node: int, count: int, total: int, rng: np.random.Generator) -> Message:
    sizes = np.full(count, total // count)
    arrays = ArrayRecord({f"tensor-{i}": Array(rng.standard_normal(int(n)).astype(np.float32))
                          for i, n in enumerate(sizes)})
    return Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"k": count})}),
                   message_type=MessageType.TRAIN, dst_node_id=node)


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    counts = [int(c) for c in str(config["array-counts"]).split(",")]
    rng = np.random.default_rng(0)
    while len(list(grid.get_node_ids())) < 1:
        time.sleep(0.5)
    nodes = list(grid.get_node_ids())
    rows = []
    for repeat in range(int(config["repeats"]) + 1):  # the first pass warms up
        for count in counts:
            messages = [message(node, count, int(config["total-floats"]), rng) for node in nodes]
            started = time.perf_counter()
            pending = set(grid.push_messages(messages))
            pushed = time.perf_counter()
            handler = []
            while pending:
                for reply in grid.pull_messages(pending):
                    pending.discard(reply.metadata.reply_to_message_id)
                    handler.append(float(reply.content["metrics"]["handler-seconds"]))
                    arrived = time.perf_counter()
                time.sleep(0.05)
            if repeat:
                rows.append({"arrays": count, "push_s": pushed - started, "round_trip_s": arrived - started,
                             "handler_s": max(handler)})
    with open(str(config["timings-file"]), "w") as handle:
        json.dump(rows, handle)
