"""FedProIn's options beyond the paper's defaults (docs/fedproin.md, "choices"): prototype initialisation
from the hospitals' features, re-seeding prototypes nobody uses, Adam moments kept across rounds, the
public code's epoch length, and a pretrained encoder for every classification method."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.arrays import model_arrays
from common.config import JobConfig
from common.data.containers import LabelledImages
from common.engine.inprocess import run_rounds, simulated_sites
from common.engine.round_engine import RoundEngine
from common.engine.wire import from_recorddict, to_recorddict
from common.methods.base import HospitalInfo, HospitalUpdate, Payload
from common.methods.site import HospitalStateStore, Site
from common.models.prototype_net import PrototypeNet
from common.models.resnet import build_resnet18_classifier
from common.tasks.base import images_to_tensor
from strategies.fedproin.hospital import FedProInHospital, initialise_prototypes, reseed_prototypes
from strategies.fedproin.messages import INFLUENCE, RESEED
from strategies.fedproin.optimizer_state import optimizer_arrays, restore_optimizer
from strategies.fedproin.task import PrototypeClassificationTask
from strategies.fedproto.hospital import FedProtoHospital

CPU = torch.device("cpu")


def one_pixel_data(levels: list[int], labels: list[int]) -> LabelledImages:
    """Images of a single grey pixel: with a Flatten encoder, a sample's feature is its normalised pixel."""
    pixels = np.repeat(np.array(levels, np.uint8)[:, None], 3, axis=1)
    return LabelledImages(pixels[:, None, None, :], np.array(labels), ("a", "b"))


def features_of(data: LabelledImages) -> torch.Tensor:
    return images_to_tensor(data.images, CPU).flatten(1)


def flat_model(prototypes_per_class: int = 2) -> tuple[PrototypeNet, PrototypeClassificationTask]:
    torch.manual_seed(0)
    cfg = JobConfig(fedproin={"num-prototypes": prototypes_per_class})
    model = PrototypeNet(torch.nn.Flatten(), num_classes=2, prototypes_per_class=prototypes_per_class, feature_dim=3)
    return model, PrototypeClassificationTask(cfg, {"num-classes": 2, "in-channels": 3})


# --- prototype initialisation ----------------------------------------------------------------------
def test_class_means_start_at_each_class_clusters_largest_first():
    data = one_pixel_data([10, 12, 240, 120, 122, 124], [0, 0, 0, 1, 1, 1])
    model, task = flat_model()
    set_classes = initialise_prototypes(model, task, data, "class-means", CPU, seed=0)
    features = features_of(data)
    assert set_classes == [0, 1]
    # class a: the dark pair (two samples) first, the bright one second; class b has three near-equal greys
    torch.testing.assert_close(model.prototypes[0, 0], features[:2].mean(0), atol=1e-5, rtol=0)
    torch.testing.assert_close(model.prototypes[0, 1], features[2], atol=1e-5, rtol=0)
    assert torch.all((model.prototypes[1] >= features[3:].min(0).values - 1e-5)
                     & (model.prototypes[1] <= features[3:].max(0).values + 1e-5))


def test_class_means_leave_a_class_the_hospital_lacks_as_received():
    data = one_pixel_data([10, 240], [0, 0])
    model, task = flat_model()
    received = model.prototypes.detach().clone()
    assert initialise_prototypes(model, task, data, "class-means", CPU, seed=0) == [0]
    torch.testing.assert_close(model.prototypes[1], received[1])
    assert not torch.allclose(model.prototypes[0, 0], model.prototypes[0, 1])  # one class, two distinct centres


def test_feature_moments_scale_the_shared_normal_draws_to_the_features():
    data = one_pixel_data([10, 60, 240, 120], [0, 0, 1, 1])
    model, task = flat_model()
    draws = model.prototypes.detach().clone()
    initialise_prototypes(model, task, data, "feature-moments", CPU, seed=0)
    features = features_of(data)
    torch.testing.assert_close(model.prototypes.detach(), features.mean(0) + features.std(0) * draws)


def test_hospitals_initialise_from_their_features_in_round_one_only():
    cfg = JobConfig(run_name="init", strategy="fedproin", synthetic_samples=120, image_size=16, batch_size=16,
                    min_partition_size=5, model="small-cnn", local_epochs=1,
                    fedproin={"prototype-init": "class-means"})
    site = simulated_sites(cfg, 2)[0]
    server = RoundEngine(cfg).method
    hospital = FedProInHospital(cfg, site)
    received = server.global_arrays["prototypes"]
    first = hospital.train(1, server.downlink(1, hospital.info()))
    plain = FedProInHospital(cfg.model_copy(update={"fedproin": cfg.fedproin.model_copy(
        update={"prototype_init": "normal"})}), site).train(1, server.downlink(1, hospital.info()))
    # N(0, 1) prototypes stay within a few training steps of N(0, 1); initialised ones sit at the features
    moved = np.abs(first.arrays["model"]["prototypes"] - received).mean()
    stayed = np.abs(plain.arrays["model"]["prototypes"] - received).mean()
    assert moved > 3 * stayed
    later = hospital.train(2, server.downlink(2, hospital.info()))  # round 2: trains from what it received
    assert np.abs(later.arrays["model"]["prototypes"] - received).mean() < moved


# --- re-seeding prototypes nobody uses ---------------------------------------------------------------
def test_reseeding_puts_a_prototype_at_the_worst_served_sample_of_its_class():
    data = one_pixel_data([10, 20, 200, 120], [0, 0, 0, 1])
    model, task = flat_model()
    features = features_of(data)
    with torch.no_grad():
        model.prototypes.copy_(torch.stack([torch.stack([features[0], features[0] + 50.0]),
                                            torch.stack([features[3], features[3] + 50.0])]))
    done = reseed_prototypes(model, task, data, [1, 3], CPU)  # class a #1 and class b #1
    assert done == [1, 3]
    torch.testing.assert_close(model.prototypes[0, 1], features[2])  # 200 is farthest from class a's prototypes
    torch.testing.assert_close(model.prototypes[1, 1], features[3])  # class b has one sample
    torch.testing.assert_close(model.prototypes[0, 0], features[0])  # others untouched
    assert reseed_prototypes(model, task, one_pixel_data([10], [0]), [3], CPU) == []  # no class-b sample here


def reply(server, name: str, influence: list[list[int]]) -> HospitalUpdate:
    model = {k: v.copy() for k, v in server.global_arrays.items()}
    count = int(np.sum(influence))
    payload = Payload(arrays={"model": model},
                      metrics={"num-examples": count, INFLUENCE: np.ravel(influence).tolist()})
    return HospitalUpdate(HospitalInfo(name, count, {}), payload)


def test_server_splits_the_busiest_prototype_into_one_nobody_used():
    cfg = JobConfig(run_name="split", strategy="fedproin", synthetic_samples=120, image_size=16,
                    model="small-cnn", fedproin={"reseed-after": 2})
    server = RoundEngine(cfg).method
    classes = server.global_arrays["prototypes"].shape[0]
    usage = [[3, 0], [0, 0]] + [[2, 1]] * (classes - 2)  # 0#1 nobody's nearest; class 1 held by nobody
    assert "reseeded-prototypes" not in server.aggregate(1, [reply(server, "h0", usage)])
    before = server.global_arrays["prototypes"].copy()
    names = server.aggregate(2, [reply(server, "h0", usage)])["reseeded-prototypes"]
    after = server.global_arrays["prototypes"]
    assert names == [names[0]] and names[0].endswith("#1")  # class 1's prototypes are not split: nobody has it
    np.testing.assert_allclose(after[0, 1], before[0, 0], atol=0.05 * before[0, 0].std())
    assert not np.array_equal(after[0, 1], after[0, 0])
    np.testing.assert_array_equal(after[1:], before[1:])
    assert RESEED not in server.round_config(3)  # the server did it: nothing for the hospitals to do
    assert "reseeded-prototypes" not in server.aggregate(3, [reply(server, "h0", usage)])  # counting starts over


def test_server_asks_for_reseeding_after_the_configured_unused_rounds_and_remembers_across_a_resume():
    cfg = JobConfig(run_name="reseed", strategy="fedproin", synthetic_samples=120, image_size=16,
                    model="small-cnn", fedproin={"reseed-after": 2, "reseed-rule": "far-sample"})
    server = RoundEngine(cfg).method
    classes = server.global_arrays["prototypes"].shape[0]
    usage = [[3, 0]] + [[2, 1]] * (classes - 1)  # prototype 0#1 nobody's nearest
    for rnd in (1, 2):
        assert RESEED not in server.round_config(rnd)
        metrics = server.aggregate(rnd, [reply(server, "h0", usage)])
        assert "reseeded-prototypes" not in metrics
    assert server.round_config(3)[RESEED] == [1]
    resumed = RoundEngine(cfg).method
    resumed.load_state_dict(server.state_dict())
    assert resumed.round_config(3)[RESEED] == [1]
    names = server.aggregate(3, [reply(server, "h0", [[2, 1]] * classes)])["reseeded-prototypes"]
    assert len(names) == 1 and names[0].endswith("#1")
    assert RESEED not in server.round_config(4)  # used again: the count starts over
    sent = from_recorddict(to_recorddict(Payload(arrays={}, config=resumed.round_config(3))))
    assert sent.config[RESEED] == [1]  # a list of ints travels in Flower's ConfigRecord


def test_a_federation_with_reseeding_runs_and_records_it():
    cfg = JobConfig(run_name="reseed-run", strategy="fedproin", num_server_rounds=3, synthetic_samples=120,
                    image_size=16, batch_size=16, min_partition_size=5, model="small-cnn",
                    fedproin={"reseed-after": 1, "num-prototypes": 4, "reseed-rule": "far-sample"})
    engine = run_rounds(cfg, simulated_sites(cfg, 2))
    unused_after_1 = engine.history[0]["method"]["unused-prototypes"]
    assert unused_after_1  # four prototypes per class on a few dozen samples: some go unused
    assert engine.history[1]["method"].get("reseeded-prototypes") == unused_after_1


# --- Adam moments across rounds ----------------------------------------------------------------------
def test_optimizer_state_round_trips_through_named_arrays():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
    saved = optimizer_arrays(optimizer)
    assert saved["optimizer/0/step"] == 3
    fresh = torch.optim.Adam(model.parameters(), lr=0.1)
    assert restore_optimizer(fresh, saved, "hospital-x")
    torch.testing.assert_close(fresh.state_dict()["state"][0]["exp_avg_sq"],
                               optimizer.state_dict()["state"][0]["exp_avg_sq"])
    other = torch.optim.Adam(torch.nn.Linear(5, 2).parameters())
    assert not restore_optimizer(other, saved, "hospital-x")  # shapes differ: fresh moments, a warning
    assert not restore_optimizer(fresh, {}, "hospital-x")


def test_hospital_keeps_its_adam_steps_across_its_rounds(tmp_path):
    cfg = JobConfig(run_name="adam", strategy="fedproin", synthetic_samples=120, image_size=16, batch_size=16,
                    min_partition_size=5, model="small-cnn", local_epochs=1,
                    fedproin={"keep-optimizer-state": True})
    reference = simulated_sites(cfg, 2)[0]
    site = Site("hospital-00", reference.train, reference.val, CPU, state=HospitalStateStore(tmp_path))
    server = RoundEngine(cfg).method
    FedProInHospital(cfg, site).train(1, server.downlink(1, HospitalInfo("hospital-00", 1, {})))
    steps = int(site.state.load(before_round=2)["optimizer/0/step"])
    assert steps > 0
    FedProInHospital(cfg, site).train(3, server.downlink(3, HospitalInfo("hospital-00", 1, {})))  # a new process
    assert int(site.state.load(before_round=4)["optimizer/0/step"]) == 2 * steps


# --- epoch length ------------------------------------------------------------------------------------
def test_public_codes_epoch_draws_max_class_size_per_class_present():
    labels = [0] * 30 + [1] * 6
    data = one_pixel_data([10] * 30 + [200] * 6, labels)
    for draws, batches in (("samples", 36 // 4), ("max-class", 60 // 4)):
        cfg = JobConfig(batch_size=4, fedproin={"epoch-draws": draws, "class-balanced": True})
        task = PrototypeClassificationTask(cfg, {"num-classes": 2, "in-channels": 3})
        assert sum(1 for _ in task.batches(data, 4, CPU, np.random.default_rng(0), train=True)) == batches


# --- a pretrained encoder for every method --------------------------------------------------------------
@pytest.fixture
def weights_file(tmp_path):
    torch.manual_seed(123)
    source = build_resnet18_classifier(num_classes=8, in_channels=3, image_size=16, width=0.25)  # other classes
    path = tmp_path / "encoder.pt"
    torch.save(source.state_dict(), path)
    return path, {k: v.numpy() for k, v in source.state_dict().items()}


def job(strategy: str, weights: str) -> JobConfig:
    return JobConfig(run_name="pre", strategy=strategy, synthetic_samples=120, image_size=16, resnet_width=0.25,
                     batch_size=16, min_partition_size=5, encoder_weights=weights)


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "moon", "fedproto", "fedproin"])
def test_every_method_starts_from_the_pretrained_encoder(weights_file, strategy):
    path, source = weights_file
    server = RoundEngine(job(strategy, str(path))).method
    prefix = "encoder." if strategy == "fedproin" else ""
    for name, value in source.items():
        if name.startswith("fc.") or "num_batches_tracked" in name:
            continue
        np.testing.assert_array_equal(server.global_arrays[prefix + name], value, err_msg=name)
    if strategy != "fedproin":
        assert server.global_arrays["fc.weight"].shape[0] == 4  # the job's own head, not the source's 8 classes


def test_fedproto_hospitals_build_the_same_pretrained_start(weights_file):
    path, _ = weights_file
    cfg = job("fedproto", str(path))
    server = RoundEngine(cfg).method
    hospital = FedProtoHospital(cfg, simulated_sites(cfg, 2)[0])
    own = hospital.own_model(1, server.downlink(1, hospital.info()))
    for name, value in model_arrays(own).items():
        np.testing.assert_array_equal(value, server.global_arrays[name], err_msg=name)


def test_bad_encoder_weights_fail_before_round_one_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="encoder-weights: .*missing.pt: file not found"):
        RoundEngine(job("fedavg", str(tmp_path / "missing.pt")))
    wrong = tmp_path / "wrong.pt"
    torch.save(build_resnet18_classifier(4, 3, 16, width=0.5).state_dict(), wrong)
    with pytest.raises(ValueError, match="encoder-weights: .*shape mismatch"):
        RoundEngine(job("fedavg", str(wrong)))
    with pytest.raises(ValueError, match="encoder-weights: .*task is polyp-segmentation"):
        JobConfig(strategy="qfedpolyp", task="polyp-segmentation", image_size=16, encoder_weights=str(wrong))
