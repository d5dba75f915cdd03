"""What secure aggregation costs: plain and secure FedAvg rounds side by side in one run, for 5 and 20 hospitals.

    flock /tmp/fedmed-cpu.lock python -m benchmarks.secure_aggregation.run          # ~1 min on 2 cores
    python -m benchmarks.secure_aggregation.run --hospitals 5 --rounds 2           # a quick look

Hospitals answer in the server's process with fedmed's own ClientApp (FakeGrid, ``tests/fake_grid.py``), so their
work is serial and no network is timed: what the table shows is the protocol's compute and bytes, not SuperLink
latency (each secure round adds two key-stage round trips to it, three with signatures). A small CNN on generated
images (16 x 16, 24 training images a hospital); seconds per round are the mean of rounds 2..N (round 1 builds the
data and the model, and sets up secure aggregation in a stage of its own). Every configuration runs three times, in
turn, and the table gives medians: the CPU time of a run moves by a tenth from one run to the next on a shared
machine. The documented deployment's keys (identity keys, peer keys, and each hospital's policy pinning them) get
rows of their own, SecAgg and SecAgg+.
The protocol alone at a ResNet-18's size (11.2 M values, 5 hospitals, no training) is timed too, and what fresh
training noise would leave of the replay hospitals refuse (:func:`measure_differencing`). Written to
``benchmarks/results/secure_aggregation.md`` and ``.json``, with the CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.machine import cpu_name

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SAMPLES_PER_HOSPITAL = 24
LOAD = os.getloadavg()  #: the machine's load when the run started (the results name it)
JOB = {"model": "small-cnn", "image-size": 16, "batch-size": 8, "min-partition-size": 5, "evaluate-every": 100,
       "round-timeout": 60.0}


def signed_nodes(folder: Path, hospitals: int) -> dict[int, dict[str, Any]]:
    """Node configs as the documented deployment sets them: each hospital its identity key (ECDSA P-384, OpenSSH
    format, as ``deploy/make_hospital_keys.sh`` makes them), the folder of every hospital's registered key, and a
    policy pinning every one of them (``peers``; the shipped template's other rules would refuse the plain runs
    beside, so they are left out)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from common.trust.identity import key_fingerprint

    folder.mkdir(parents=True, exist_ok=True)
    nodes = {}
    for pid in range(hospitals):
        key, name = ec.generate_private_key(ec.SECP384R1()), f"hospital-{pid:02d}"
        (folder / name).write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                      serialization.NoEncryption()))
        (folder / f"{name}.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                           serialization.PublicFormat.OpenSSH))
        nodes[101 + pid] = {"partition-id": pid, "num-partitions": hospitals, "identity-key": str(folder / name),
                            "peer-keys": str(folder), "policy-file": str(folder / "policy.toml")}
    pins = "".join(f'"{name}" = "{key_fingerprint(public)}"\n' for public in sorted(folder.glob("*.pub"))
                   for name in [public.name.removesuffix(".pub")])
    (folder / "policy.toml").write_text(f"[peers]\n{pins}")
    return nodes


def measure_rounds(root: Path, hospitals: int, rounds: int, secure: bool, num_shares: float = 1.0,
                   signed: bool = False, repeat: int = 0) -> dict[str, Any]:
    """One run of ``rounds`` FedAvg rounds over ``hospitals`` in-process hospitals (secure: each sharing with
    ``num-shares``; ``signed``: with identity keys and the consortium's keys, as deployed): seconds per round, bytes
    per hospital each way (key stages included), one training reply's bytes, and for secure rounds each stage's
    time."""
    from strategies import FedAvgStrategy
    from tests.fake_grid import FakeGrid, hospital_node

    kind = "secure" if secure else "plain"
    name = f"{kind}-{hospitals}-{num_shares:g}{'-signed' if signed else ''}-{repeat}"
    config = {**JOB, "synthetic-samples": SAMPLES_PER_HOSPITAL * hospitals, "run-name": name,
              "state-dir": str(root / name), "results-dir": str(root / "results"),
              "min-train-hospitals": hospitals, "min-available-hospitals": hospitals,
              "secure-aggregation.enabled": secure, "secure-aggregation.num-shares": num_shares}
    nodes = {101 + pid: {"partition-id": pid, "num-partitions": hospitals} for pid in range(hospitals)}
    if signed:
        nodes = signed_nodes(root / f"keys-{name}", hospitals)
        config["hospital-keys"] = str(root / f"keys-{name}")
    in_hospitals = [0.0]  #: CPU seconds spent inside the hospitals' handlers (their share of the process)
    by_stage: dict[str, list[float]] = {}  #: a hospital's CPU seconds per message, by what the message asks

    def timed(handler):
        def answer(message):
            started = time.process_time()
            try:
                return handler(message)
            finally:
                spent = time.process_time() - started
                in_hospitals[0] += spent
                by_stage.setdefault(message_stage(message), []).append(spent)

        return answer

    class TimedFedAvg(FedAvgStrategy):
        """FedAvg whose rounds are timed from configure_train to aggregate_train: the key stages, the hospitals'
        work and the aggregation, without the server's test-set scoring; the hospitals' part of the CPU apart."""

        def configure_train(self, server_round, arrays, config, grid):
            self.round_started = time.perf_counter(), time.process_time(), in_hospitals[0]
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            result = super().aggregate_train(server_round, replies)
            self.engine.history[-1]["wall-seconds"] = time.perf_counter() - self.round_started[0]
            self.engine.history[-1]["cpu-seconds"] = time.process_time() - self.round_started[1]
            self.engine.history[-1]["hospitals-cpu-seconds"] = in_hospitals[0] - self.round_started[2]
            return result

    strategy = TimedFedAvg(min_train_nodes=hospitals, min_available_nodes=hospitals, run_config=config)
    grid = FakeGrid({node_id: timed(hospital_node(config, node, node_id)) for node_id, node in nodes.items()})
    strategy.start(grid, num_rounds=rounds)
    later = strategy.engine.history[1:] or strategy.engine.history
    skipped = [r["skipped"] for r in strategy.engine.history if "skipped" in r]
    if skipped:
        raise RuntimeError(f"{kind} round skipped: {skipped[0]}")
    trained = [m for m in grid.replies if m.metadata.message_type == "train" and not m.has_error()
               and (not secure or m.content.config_records.get("config", {}).get("secagg.stage")
                    == "collect_masked_vectors")]
    from common.engine.wire import message_nbytes

    row: dict[str, Any] = {
        "hospitals": hospitals, "kind": kind, "rounds": rounds, "num-shares": num_shares, "signed": signed,
        "pinned": signed,
        "seconds-per-round": mean(r["wall-seconds"] for r in later),
        "cpu-seconds-per-round": mean(r["cpu-seconds"] for r in later),
        "server-cpu-seconds-per-round": mean(r["cpu-seconds"] - r["hospitals-cpu-seconds"] for r in later),
        "hospital-cpu-seconds-per-round": mean(r["hospitals-cpu-seconds"] / hospitals for r in later),
        "bytes-up-per-hospital": mean(r["bytes_up"] / hospitals for r in later),
        "bytes-down-per-hospital": mean(r["bytes_down"] / hospitals for r in later),
        "training-reply-bytes": message_nbytes(trained[-1]),
        "hospital-seconds": mean(sum(m.get("hospital-seconds", 0.0) for m in r["hospital_metrics"].values())
                                 for r in later),
        "hospital-cpu-ms-per-message": {stage: 1000 * mean(times) for stage, times in by_stage.items()},
        "messages-per-hospital-round": {stage: len(times) / (hospitals * rounds) for stage, times in by_stage.items()}}
    if secure:
        stages = [r["secure-aggregation"]["stages"] for r in later]
        for stage in ("setup", "share_keys", "consistency_check", "unmask"):  # no consistency stage unsigned
            row[f"{stage}-seconds"] = mean(s[stage]["seconds"] for s in stages) if stage in stages[0] else None
        row["unmask-and-sums-seconds"] = mean(s["unmask"]["sum-seconds"] for s in stages)
        row["masking-seconds-per-hospital"] = mean(
            mean(m["secagg-seconds"] for m in r["hospital_metrics"].values()) for r in later)
        row["threshold"] = later[-1]["secure-aggregation"]["threshold"]
        row["shares"] = later[-1]["secure-aggregation"]["shares"]
    return row


def message_stage(message) -> str:
    """What a message to a hospital asks: its secure-aggregation stage, else its type (train, evaluate, query)."""
    kind = message.metadata.message_type.split(".")[0]
    stage = message.content.config_records.get("config", {}).get("secagg.stage") if message.has_content() else None
    return str(stage) if stage else kind


def measure_protocol(values: int = 11_200_000, count: int = 5) -> dict[str, Any]:
    """The protocol alone at a ResNet-18's size, no training: one hospital's quantisation and masking, the server's
    sum and unmasking, in seconds; the masked vector's bytes; the sum's largest error."""
    from common.trust.secure_aggregation import Entry, Layout, SecureAggregationSettings, decode_sum, encode
    from common.trust.secure_aggregation.inprocess import InProcess
    from common.trust.secure_aggregation.server import add_masked_vector
    from common.trust.secure_aggregation.vector import pack_values, unpack_values

    layout = Layout((Entry("weight", ()), Entry("model/all", (values,))))
    update = np.random.default_rng(0).normal(0, 1e-3, values)
    started = time.perf_counter()
    vector = encode(layout, {"weight": np.asarray(0.2), "model/all": 0.2 * update}, 8.0, 2**22)
    quantised = time.perf_counter() - started
    protocol = InProcess(list(range(1, count + 1)), SecureAggregationSettings(enabled=True), vector.size)
    protocol.keys()
    masking, adding = [], []
    for node in protocol.plan.nodes:
        started = time.perf_counter()
        packed = pack_values(protocol.mask(node, vector), 32)
        masking.append(time.perf_counter() - started)
        started = time.perf_counter()
        add_masked_vector(protocol.plan, node, unpack_values(packed, 32, vector.size))
        adding.append(time.perf_counter() - started)
    started = time.perf_counter()
    sums = decode_sum(layout, protocol.unmask(), count, 8.0, 2**22)
    unmasking = time.perf_counter() - started
    return {"values": values, "hospitals": count, "quantise-seconds": quantised, "mask-and-pack-seconds":
            mean(masking), "unpack-and-add-seconds": mean(adding), "unmask-and-decode-seconds": unmasking,
            "masked-vector-bytes": int(packed.size), "float32-bytes": 4 * values,
            "largest-error": float(np.abs(sums["model/all"] - count * 0.2 * update).max())}


def measure_differencing(hospitals: int = 4) -> dict[str, Any]:
    """Why a hospital refuses to train again from a model it revealed shares for, rather than train again with
    fresh noise: every hospital trains twice from the same model, with two training seeds (as fresh noise would
    draw); the replay's difference of sums (round again without hospital 0) correlates with hospital 0's update
    about as well as with the same seeds (1.0)."""
    from common.config import load_job_config
    from common.engine.inprocess import simulated_sites
    from common.engine.round_engine import RoundEngine
    from common.methods.registry import hospital_class

    cfg = load_job_config({**JOB, "synthetic-samples": SAMPLES_PER_HOSPITAL * hospitals, "strategy": "fedavg"})
    sites, engine = simulated_sites(cfg, hospitals), RoundEngine(cfg)
    start = {k: v.astype(np.float64) for k, v in engine.method.global_arrays.items() if v.dtype.kind == "f"}

    def update(site, seed_round: int) -> np.ndarray:
        method = hospital_class(cfg.strategy)(cfg, site)
        model = method.train(seed_round, engine.downlink(1, method.info())).arrays["model"]
        return np.concatenate([(model[k] - v).ravel() for k, v in start.items()])

    first = [update(site, 1) for site in sites]
    again = [update(site, 2) for site in sites]  # the same model, other training seeds
    difference = sum(first) - sum(again[1:])
    return {"hospitals": hospitals,
            "update-correlation-across-seeds": mean(np.corrcoef(a, b)[0, 1] for a, b in zip(first, again)),
            "difference-correlation-with-hospital-0": float(np.corrcoef(difference, first[0])[0, 1])}


def mean(values) -> float:
    return float(np.mean(list(values)))


def median_row(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's runs as one row: each number the median over the runs (the machine's noise comes and
    goes between them), the CPU per round of every run kept beside it."""
    row = dict(repeats[0])
    for key, value in row.items():
        if isinstance(value, float):
            row[key] = float(np.median([r[key] for r in repeats]))
    row["cpu-seconds-per-round-runs"] = [round(r["cpu-seconds-per-round"], 4) for r in repeats]
    row["hospital-cpu-ms-per-message"] = {stage: float(np.median([r["hospital-cpu-ms-per-message"].get(stage, 0.0)
                                                                  for r in repeats]))
                                          for stage in repeats[0]["hospital-cpu-ms-per-message"]}
    return row


#: a secure round's messages to a hospital, in order (the setup rides on the last round's unmask)
STAGE_ORDER = ("train", "setup", "share_keys", "collect_masked_vectors", "consistency_check", "unmask", "evaluate",
               "query")


def per_message_table(rows: list[dict[str, Any]]) -> list[str]:
    """A hospital's CPU per message of each kind, and how many it answers a round: what each round trip of the key
    stages costs beside the training message (read from the deployed rows)."""
    chosen = [r for r in rows if r.get("signed")] or rows
    chosen = [r for r in chosen if r["hospitals"] == max(c["hospitals"] for c in chosen)]
    lines = ["", "One hospital's CPU per message it answers, in ms (median of the runs), and messages a round (all "
             "rounds of the run, round 1's own setup included): a key stage's round trip costs the hospital its "
             "audit lines, digests, rules and state besides the stage's own cryptography.", "",
             "| run | " + " | ".join(s for s in STAGE_ORDER) + " | CPU ms a round |", "|---|" + "---:|" * 9]
    for row in chosen:
        per, count = row["hospital-cpu-ms-per-message"], row["messages-per-hospital-round"]
        label = row["kind"] if row["kind"] == "plain" else f"{row['kind']}, {row['shares']} / {row['threshold']}"
        cells = [f"{per[s]:.2f} ({count[s]:.2f})" if s in per else "-" for s in STAGE_ORDER]
        total = sum(per[s] * count[s] for s in per)
        lines.append(f"| {label}, {keys_label(row)} | " + " | ".join(cells) + f" | {total:.1f} |")
    return lines


def keys_label(row: dict[str, Any]) -> str:
    return ("pinned peer keys" if row.get("pinned") else "peer keys") if row.get("signed") else "none"


def table(rows: list[dict[str, Any]], protocol: dict[str, Any] | None, differencing: dict[str, Any] | None,
          rounds: int, repeats: int, before: dict[str, Any] | None = None) -> str:
    lines = ["# Secure aggregation: what it costs (FedAvg, small CNN, generated data)", "",
             f"`python -m benchmarks.secure_aggregation.run` on {cpu_name()}, {time.strftime('%Y-%m-%d')}: hospitals "
             f"in the server's process (FakeGrid, serial, no network), {SAMPLES_PER_HOSPITAL} training images of "
             f"16 x 16 each, means of rounds 2-{rounds}; every configuration run {repeats} times, in turn, and each "
             "figure the median of its runs. Secure: every hospital sharing with every other (SecAgg, num-shares "
             "1.0) or with its ring neighbours (SecAgg+), the default threshold (more than half the shares), masks "
             "from ChaCha20, the consistency stage where signatures are compared (the peer-keys rows), each round "
             "after the first set up with the last one's unmask stage. Keys: none (simulation), or pinned peer keys "
             "as the documented deployment sets them (each hospital signs with its identity key, through the "
             "Ed25519 key it endorses, and checks every neighbour's and survivor's signature against the "
             "consortium's registered keys, each pinned by its fingerprint in the hospital's policy; the server "
             "checks them with hospital-keys; the plain run beside it proves each hospital's name the same way, "
             "under the same policy). Load average "
             f"{LOAD[0]:.1f} when it started, {os.getloadavg()[0]:.1f} when it ended: on a shared machine wall "
             "times vary between runs, the process's CPU time (all of the run is in this process, key stages, "
             "training and masking included; waits for the disk are not) less; bytes do not.", "",
             "| hospitals | shares / threshold | keys | CPU s/round plain | CPU s/round secure | x | wall s/round "
             "plain | wall s/round secure | key stages wall s (setup / share / consistency / unmask) | masking s "
             "per hospital | unmask + sums s (server) | reply B plain | masked reply B | up B/hospital plain | up "
             "B/hospital secure | x | down B/hospital plain | down B/hospital secure | x |",
             "|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    plain_of = {(r["hospitals"], r.get("signed", False)): r for r in rows if r["kind"] == "plain"}
    secure_rows = [r for r in rows if r["kind"] == "secure"]
    for secure in secure_rows:
        plain = plain_of[secure["hospitals"], secure.get("signed", False)]
        keys = " / ".join("-" if secure[f"{s}-seconds"] is None else f"{secure[f'{s}-seconds']:.2f}"
                          for s in ("setup", "share_keys", "consistency_check", "unmask"))
        lines.append(
            f"| {secure['hospitals']} | {secure['shares']} / {secure['threshold']} | {keys_label(secure)} | "
            f"{plain['cpu-seconds-per-round']:.2f} | {secure['cpu-seconds-per-round']:.2f} | "
            f"{secure['cpu-seconds-per-round'] / plain['cpu-seconds-per-round']:.2f} | "
            f"{plain['seconds-per-round']:.2f} | {secure['seconds-per-round']:.2f} | {keys} | "
            f"{secure['masking-seconds-per-hospital']:.3f} | {secure['unmask-and-sums-seconds']:.3f} | "
            f"{plain['training-reply-bytes']:,} | {secure['training-reply-bytes']:,} | "
            f"{plain['bytes-up-per-hospital']:,.0f} | {secure['bytes-up-per-hospital']:,.0f} | "
            f"{secure['bytes-up-per-hospital'] / plain['bytes-up-per-hospital']:.2f} | "
            f"{plain['bytes-down-per-hospital']:,.0f} | {secure['bytes-down-per-hospital']:,.0f} | "
            f"{secure['bytes-down-per-hospital'] / plain['bytes-down-per-hospital']:.2f} |")
    lines += ["", "The CPU s per round of each run, plain then secure (the table's figure is their median):", ""]
    for secure in secure_rows:
        plain = plain_of[secure["hospitals"], secure.get("signed", False)]
        pairs = list(zip(plain["cpu-seconds-per-round-runs"], secure["cpu-seconds-per-round-runs"]))
        lines.append(f"- {secure['hospitals']} hospitals, {secure['shares']} shares, keys {keys_label(secure)}: "
                     f"plain {', '.join(f'{p:.3f}' for p, _ in pairs)}; secure "
                     f"{', '.join(f'{s:.3f}' for _, s in pairs)}; x each run (secure over the plain run before it) "
                     f"{', '.join(f'{s / p:.2f}' for p, s in pairs)}")
    lines += ["", "Each party's own CPU per round (what it pays in a deployment, where every hospital computes on its "
              "own machine at the same time): the server's (the process less the time inside the hospitals' "
              "handlers) and one hospital's.", "",
              "| hospitals | shares / threshold | keys | server CPU s plain | secure | x | one hospital's CPU s "
              "plain | secure | x |", "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for secure in secure_rows:
        plain = plain_of[secure["hospitals"], secure.get("signed", False)]
        lines.append(
            f"| {secure['hospitals']} | {secure['shares']} / {secure['threshold']} | {keys_label(secure)} | "
            f"{plain['server-cpu-seconds-per-round']:.3f} | {secure['server-cpu-seconds-per-round']:.3f} | "
            f"{secure['server-cpu-seconds-per-round'] / plain['server-cpu-seconds-per-round']:.2f} | "
            f"{plain['hospital-cpu-seconds-per-round']:.3f} | {secure['hospital-cpu-seconds-per-round']:.3f} | "
            f"{secure['hospital-cpu-seconds-per-round'] / plain['hospital-cpu-seconds-per-round']:.2f} |")
    lines += per_message_table(rows)
    if before:
        lines += ["", f"Before and after, on this machine: {before['label']} (`{before['command']}`, "
                  f"{before['cpu']}) against this run, load average {before['load'][0]:.1f} and "
                  f"{before['load'][1]:.1f} when it started and ended. CPU s per round of the whole process, plain "
                  "and secure; keys as each run had them.", "",
                  "| hospitals | shares / threshold | keys | before: plain | secure | x | after: plain | secure | x |",
                  "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
        old_plain = {(r["hospitals"], r.get("signed", False)): r for r in before["rounds"] if r["kind"] == "plain"}
        old_secure = {(r["hospitals"], r["num-shares"], r.get("signed", False)): r for r in before["rounds"]
                      if r["kind"] == "secure"}
        for secure in secure_rows:
            signed = secure.get("signed", False)
            was = old_secure.get((secure["hospitals"], secure["num-shares"], signed))
            if was is None:
                continue
            plain, was_plain = plain_of[secure["hospitals"], signed], old_plain[secure["hospitals"], signed]
            lines.append(
                f"| {secure['hospitals']} | {secure['shares']} / {secure['threshold']} | {keys_label(secure)} | "
                f"{was_plain['cpu-seconds-per-round']:.2f} | {was['cpu-seconds-per-round']:.2f} | "
                f"{was['cpu-seconds-per-round'] / was_plain['cpu-seconds-per-round']:.2f} | "
                f"{plain['cpu-seconds-per-round']:.2f} | {secure['cpu-seconds-per-round']:.2f} | "
                f"{secure['cpu-seconds-per-round'] / plain['cpu-seconds-per-round']:.2f} |")
    if differencing:
        lines += ["", f"Training again with fresh noise instead of refusing (FedAvg, {differencing['hospitals']} "
                  "hospitals, each trained twice from the same model with two training seeds): one hospital's two "
                  f"updates correlate at {differencing['update-correlation-across-seeds']:.3f}, and the replay's "
                  "difference of sums (the round again without hospital 0) correlates with hospital 0's update at "
                  f"{differencing['difference-correlation-with-hospital-0']:.3f} (1.0 with the same seeds)."]
    if protocol:
        lines += ["", f"Protocol alone, {protocol['values'] / 1e6:.1f} M float values (a ResNet-18), "
                  f"{protocol['hospitals']} hospitals, no training: a hospital quantises in "
                  f"{protocol['quantise-seconds']:.2f} s and masks and packs in "
                  f"{protocol['mask-and-pack-seconds']:.2f} s; the server unpacks and adds one vector in "
                  f"{protocol['unpack-and-add-seconds']:.2f} s, and runs the consistency and unmask stages and "
                  f"decodes the sum in {protocol['unmask-and-decode-seconds']:.2f} s; a masked vector is "
                  f"{protocol['masked-vector-bytes']:,} B (float32: {protocol['float32-bytes']:,} B); the sum's "
                  f"largest error is {protocol['largest-error']:.2g}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hospitals", type=int, nargs="+", default=[5, 20])
    parser.add_argument("--sparse-shares", type=int, default=7,
                        help="also run the largest round as SecAgg+ with this many shares a hospital (0: not)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each configuration, taken in turn; the table gives their medians")
    parser.add_argument("--no-signed", action="store_true",
                        help="skip the runs with identity keys and the consortium's keys (the deployment's)")
    parser.add_argument("--no-protocol", action="store_true", help="skip the protocol-alone timing")
    parser.add_argument("--output", default=str(RESULTS / "secure_aggregation"),
                        help="results file path without its suffix (.md and .json are written)")
    parser.add_argument("--before", type=Path, default=None,
                        help="the .json of an earlier run (e.g. of an earlier commit) to set beside this one")
    parser.add_argument("--before-label", default="", help="what the earlier run was (its commit, say)")
    args = parser.parse_args(argv)
    import torch

    from common.trust import sandbox

    sandbox.LIFETIME = "answer"  # the hospitals answer in this process, each closed only while it answers (as tests)
    torch.set_num_threads(1)
    logging.getLogger("fedmed").setLevel(logging.ERROR)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    largest = max(args.hospitals)
    runs = [(count, secure, 1.0, False) for count in args.hospitals for secure in (False, True)]
    sparse = float(args.sparse_shares) if args.sparse_shares and args.sparse_shares < largest else 1.0
    if sparse < largest:
        runs.append((largest, True, sparse, False))
    if not args.no_signed:  # as deployed: identity keys and the consortium's keys, plain and secure
        runs += [(largest, False, 1.0, True), (largest, True, 1.0, True)]
        if sparse < largest:
            runs.append((largest, True, sparse, True))
    measured: dict[tuple, list[dict[str, Any]]] = {run: [] for run in runs}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):  # every configuration once, then again: side by side, in turn
            for count, secure, shares, signed in runs:
                measured[count, secure, shares, signed].append(
                    measure_rounds(Path(folder), count, args.rounds, secure, shares, signed, repeat))
                print(json.dumps(measured[count, secure, shares, signed][-1]), flush=True)
    rows = [median_row(repeats) for repeats in measured.values()]
    differencing = measure_differencing()
    protocol = None if args.no_protocol else measure_protocol()
    output = Path(args.output)
    before = None
    if args.before is not None:
        before = {**json.loads(args.before.read_text()), "label": args.before_label or str(args.before),
                  "command": "python -m benchmarks.secure_aggregation.run"}
    output.with_suffix(".md").write_text(table(rows, protocol, differencing, args.rounds, args.repeats, before))
    output.with_suffix(".json").write_text(json.dumps({"cpu": cpu_name(), "load": [LOAD[0], os.getloadavg()[0]],
                                                       "rounds": rows, "protocol": protocol,
                                                       "differencing": differencing}, indent=1) + "\n")
    print(output.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
