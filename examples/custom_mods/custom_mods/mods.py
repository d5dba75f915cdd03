"""custom_mods: Flower's TensorBoard and W&B mods, the trackers replaced by stubs that write JSON lines (no W&B account
or TensorBoard here); what each mod sees and logs is Flower's example's."""

import json
import os
import time

from flwr.app import Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable, Mod


class SummaryWriter:
    """Stub of TensorBoard's SummaryWriter: one JSON line per scalar."""

    def __init__(self, logdir):
        os.makedirs(logdir, exist_ok=True)
        self.path = os.path.join(logdir, "scalars.jsonl")

    def add_scalar(self, tag, value, global_step):
        with open(self.path, "a") as out:
            out.write(json.dumps({"tag": tag, "value": float(value), "step": global_step}) + "\n")

    def flush(self):
        pass


def server_round_of(msg: Message) -> int:
    return int(msg.content["config"]["server-round"]) if "config" in msg.content else 0


def get_wandb_mod(name: str, logdir: str) -> Mod:
    """Return a mod that logs the train reply's metrics to W&B (a stub: JSON lines under ``logdir``)."""

    def wandb_mod(msg: Message, context: Context, app: ClientAppCallable) -> Message:
        start_time = time.time()
        reply = app(msg, context)
        if msg.metadata.message_type == MessageType.TRAIN and reply.has_content():
            results_to_log = dict(reply.content["metrics"])
            results_to_log["fit_time"] = time.time() - start_time
            results_to_log["server-round"] = server_round_of(msg)
            os.makedirs(logdir, exist_ok=True)
            with open(os.path.join(logdir, f"wandb-{name}-{msg.metadata.dst_node_id}.jsonl"), "a") as out:
                out.write(json.dumps(results_to_log) + "\n")
        return reply

    return wandb_mod


def get_tensorboard_mod(logdir) -> Mod:
    """Return a mod that logs the train reply's metrics to TensorBoard."""
    os.makedirs(logdir, exist_ok=True)

    def tensorboard_mod(msg: Message, context: Context, app: ClientAppCallable) -> Message:
        logdir_run = os.path.join(logdir, str(msg.metadata.run_id))
        node_id = str(msg.metadata.dst_node_id)
        server_round = server_round_of(msg)
        start_time = time.time()
        reply = app(msg, context)
        time_diff = time.time() - start_time
        if msg.metadata.message_type == MessageType.TRAIN and reply.has_content():
            writer = SummaryWriter(os.path.join(logdir_run, node_id))
            writer.add_scalar("fit_time", time_diff, global_step=server_round)
            for metric, value in reply.content["metrics"].items():
                writer.add_scalar(f"{metric}", value, global_step=server_round)
            writer.flush()
        return reply

    return tensorboard_mod
