"""Every hospital on the device it was given, with several GPUs faked (patched ``torch.cuda``): Ray's assignment in
simulation, spread by partition where Ray gave none, ``cuda:N`` in a node config, the run config's ``cpu`` honoured
everywhere; the server on its GPU; mixed precision as a setting; each round records each hospital's device."""

from __future__ import annotations

import pytest
import torch

from client_app.node_config import load_node_config
from common import devices
from common.config import ConfigError, load_job_config


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def test_simulated_hospitals_use_the_gpu_ray_gave_them_or_are_spread(four_gpus):
    # Ray made the assigned GPU(s) the only visible ones: index 0 is the actor's own, fractions share it
    assert devices.hospital_device("auto", partition_id=3, assigned=[2]) == torch.device("cuda:0")
    # no GPU from Ray, but GPUs visible: spread by partition, never all on cuda:0
    chosen = [devices.hospital_device("auto", partition_id=p, assigned=[]) for p in range(8)]
    assert [d.index for d in chosen] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert devices.hospital_device("auto", partition_id=None, assigned=[]) == torch.device("cuda:0")  # deployed


def test_a_named_gpu_cpu_and_a_gpu_that_is_not_there(four_gpus):
    assert devices.hospital_device("cuda:3") == torch.device("cuda:3")
    assert devices.hospital_device("cpu", partition_id=1, assigned=[0]) == torch.device("cpu")
    with pytest.raises(ValueError, match="sees 4 GPU\\(s\\): cuda:0..cuda:3"):
        devices.hospital_device("cuda:7")
    assert devices.server_device("auto") == torch.device("cuda:0")
    assert devices.server_device("cpu") == torch.device("cpu")


def test_without_a_gpu_auto_is_the_cpu_and_cuda_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert devices.hospital_device("auto", partition_id=2) == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        devices.hospital_device("cuda")


def test_device_settings_are_checked_and_the_node_config_wins(tmp_path):
    with pytest.raises(ConfigError, match="'device'"):
        load_job_config({"device": "gpu"})
    with pytest.raises(ConfigError, match="device"):
        load_node_config({"hospital": "h", "data-dir": str(tmp_path), "device": "cuda:x"})
    node = load_node_config({"hospital": "h", "data-dir": str(tmp_path), "device": "cuda:1"})
    assert node.device == "cuda:1"
    assert load_node_config({"hospital": "h", "data-dir": str(tmp_path)}).device == ""  # the run config's then


def test_precision_picks_autocast_and_scaling(four_gpus):
    cuda, cpu = torch.device("cuda:0"), torch.device("cpu")
    assert devices.autocast_dtype(cpu, "auto") is None and devices.autocast_dtype(cuda, "auto") == torch.bfloat16
    assert devices.autocast_dtype(cpu, "bf16") == torch.bfloat16
    assert devices.autocast_dtype(cuda, "fp16") == torch.float16
    assert devices.grad_scaler(cuda, torch.float16) is not None and devices.grad_scaler(cuda, torch.bfloat16) is None


def test_bf16_training_on_the_cpu_trains_and_each_round_records_the_devices(one_thread):
    from common.engine.inprocess import run_rounds, simulated_sites

    cfg = load_job_config({"model": "small-cnn", "image-size": 16, "synthetic-samples": 60, "batch-size": 16,
                           "min-partition-size": 5, "num-server-rounds": 1, "precision": "bf16", "device": "cpu"})
    engine = run_rounds(cfg, simulated_sites(cfg, 2))
    record = engine.history[0]
    assert record["aggregated"] == ["hospital-00", "hospital-01"]
    assert record["devices"] == {"hospital-00": "cpu", "hospital-01": "cpu"}
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in engine.method.global_arrays.values())


def test_fedmed_simulate_shares_the_visible_gpus_among_the_hospitals_unless_told():
    from pathlib import Path

    from cli.launch import flower_env, simulation_resources

    assert simulation_resources(4, {}, gpus=1) == {"num-supernodes": 4, "client-resources-num-gpus": 0.25}
    assert simulation_resources(8, {}, gpus=4)["client-resources-num-gpus"] == 0.5
    assert simulation_resources(2, {}, gpus=4)["client-resources-num-gpus"] == 1.0  # a whole GPU at most
    given = {"client-resources-num-gpus": 0.0}
    assert simulation_resources(4, given, gpus=2)["client-resources-num-gpus"] == 0.0  # the user's word
    assert "client-resources-num-gpus" not in simulation_resources(4, {}, gpus=0)
    # a hospital Ray gives no GPU sees none, so it cannot pile onto GPU 0 with the others
    assert flower_env(Path("/tmp/home"))["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == "1"


def test_the_server_warns_once_when_it_has_gpus_and_hospitals_trained_on_the_cpu(four_gpus, caplog):
    from strategies import FedAvgStrategy

    strategy = FedAvgStrategy(run_config={"model": "small-cnn", "image-size": 8, "synthetic-samples": 40})
    with caplog.at_level("WARNING", logger="fedmed"):
        strategy.warn_of_idle_gpus({"devices": {"hospital-00": "cpu", "hospital-01": "cuda:0 (X)"}})
        strategy.warn_of_idle_gpus({"devices": {"hospital-00": "cpu"}})
    assert caplog.text.count("but hospital-00 trained on the CPU") == 1
