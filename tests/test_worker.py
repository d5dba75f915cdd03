"""The hospital's warm worker (deployment): payload bytes, answers equal to in-process ones, errors
named, one worker reused across messages, and the worker gone once its SuperExec is."""

import subprocess
import sys
import time

import numpy as np
import pytest

from client_app import hospital
from client_app.worker import WorkerFailed, ask_worker, socket_path
from common.config import load_job_config
from common.engine.round_engine import RoundEngine
from common.methods.base import HospitalInfo
from common.payload import Payload, payload_from_bytes, payload_to_bytes
from tests.flower_processes import TINY_JOB

JOB = {**TINY_JOB, "model": "small-cnn", "run-name": "worker-test"}


def test_payload_bytes_round_trip_exactly():
    payload = Payload(arrays={"model": {"conv.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
                                        "bn.num_batches_tracked": np.array(7, dtype=np.int64)},
                              "influence": {"counts": np.array([[3, 0], [1, 2]], dtype=np.int64)}},
                      config={"server-round": 3, "run-name": "r", "mask": b"\x00\x01\xff", "weights": [0.5, 1.0]},
                      metrics={"train-loss": 0.25})
    back, header = payload_from_bytes(payload_to_bytes(payload, {"kind": "train", "node-config": {"hospital": "a"}}))
    assert header == {"kind": "train", "node-config": {"hospital": "a"}}
    assert back.config == payload.config and back.metrics == payload.metrics
    assert set(back.arrays) == {"model", "influence"}
    for group, arrays in payload.arrays.items():
        for name, value in arrays.items():
            assert back.arrays[group][name].dtype == value.dtype
            np.testing.assert_array_equal(back.arrays[group][name], value)


def worker_pids(path) -> list[int]:
    found = subprocess.run(["pgrep", "-f", f"client_app.worker {path}"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


@pytest.fixture
def superexec():
    """Stands in for the SuperExec whose lifetime bounds the worker's."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process
    process.kill()
    process.wait()


def test_worker_answers_like_the_process_itself_and_stops_with_its_superexec(tmp_path, superexec):
    node = {"partition-id": 0, "num-partitions": 2, "state-dir": str(tmp_path / "state"),
            "hospital": f"h-{tmp_path.name}", "warm-worker": True}
    path = broken_path = socket_path(node)
    try:
        identity = ask_worker("query", Payload(), JOB, node, watch_pid=superexec.pid)
        assert identity.config == hospital.answer("query", Payload(), JOB, node).config
        (pid,) = worker_pids(path)

        cfg = load_job_config(JOB)
        info = HospitalInfo(node["hospital"], int(identity.config["num-examples"]))
        downlink = RoundEngine(cfg).downlink(1, info)
        reply = ask_worker("train", downlink, JOB, node, watch_pid=superexec.pid)
        assert {k: v.shape for k, v in reply.arrays["model"].items()} == \
            {k: v.shape for k, v in downlink.arrays["model"].items()}
        assert reply.metrics["num-examples"] == info.num_examples and reply.metrics["hospital-seconds"] > 0
        assert worker_pids(path) == [pid]  # the same warm process answered both messages

        broken = {"hospital": "broken", "data-dir": str(tmp_path), "state-dir": str(tmp_path / "state")}
        (tmp_path / "data.npz").write_bytes(b"PK\x03\x04 not a whole npz file")
        broken_path = socket_path(broken)
        with pytest.raises(WorkerFailed, match="data.npz"):
            ask_worker("query", Payload(), {**JOB, "dataset": "npz"}, broken, watch_pid=superexec.pid)
    finally:
        superexec.kill()
        superexec.wait()
    deadline = time.time() + 30
    while (worker_pids(path) or worker_pids(broken_path)) and time.time() < deadline:
        time.sleep(0.2)
    assert worker_pids(path) == worker_pids(broken_path) == [] and not path.exists()
    assert "listening" in (tmp_path / "state" / "worker.log").read_text()


def test_a_reply_to_another_request_is_refused_not_passed_on(tmp_path):
    """Whatever answers on the worker's socket, a reply whose request id is not this message's is refused."""
    import socket
    import threading

    from client_app.worker import _receive, _send

    node = {"hospital": f"stale-{tmp_path.name}", "state-dir": str(tmp_path / "state"), "warm-worker": True}
    path = socket_path(node)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()

    def stale_worker(request_ids: list[str | None]) -> None:
        for request_id in request_ids:
            connection, _ = listener.accept()
            with connection:
                _, header = payload_from_bytes(_receive(connection))
                answer = Payload(config={"name": "stale"})
                _send(connection, payload_to_bytes(answer, {"error": None, "request": request_id or header["request"]}))

    server = threading.Thread(target=stale_worker, args=(["an-earlier-request", None],))
    server.start()
    try:
        with pytest.raises(WorkerFailed, match="answered request 'an-earlier-request'"):
            ask_worker("query", Payload(), JOB, node)
        assert ask_worker("query", Payload(), JOB, node).config == {"name": "stale"}  # its own id: taken
    finally:
        server.join(timeout=10)
        listener.close()
        path.unlink(missing_ok=True)
