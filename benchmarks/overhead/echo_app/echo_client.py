"""Echoes a train message's arrays back, and says how long the handler itself took."""

import time

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    arrays = msg.content["arrays"]
    _ = [a.numpy() for a in arrays.values()]  # decode, as a hospital does
    metrics = MetricRecord({"handler-seconds": time.perf_counter() - started})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)
