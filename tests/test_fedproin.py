"""FedProIn: losses, influence counts, normalised influence aggregation, hospital memory, refused
replies, class balancing, and short in-process federations (with the ablations)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from common.config import JobConfig
from common.data.containers import LabelledImages
from common.engine.inprocess import run_rounds, simulated_sites
from common.engine.round_engine import RoundEngine, RoundReply
from common.methods.base import HospitalInfo, Payload
from common.methods.site import HospitalStateStore, Site
from common.models.prototype_net import PrototypeNet
from common.tasks.base import images_to_tensor
from strategies.fedproin.class_balance import augment_by_class, augmentation_probabilities, balanced_draws
from strategies.fedproin.hospital import (
    FedProInHospital,
    fedproin_regulariser,
    influence_counts,
    prototype_contrastive_loss,
)
from strategies.fedproin.server import normalised_influence_aggregation
from strategies.fedproin.task import (
    PrototypeClassificationTask,
    distance_cross_entropy,
    margin_classification,
    minimum_classification_error,
)


@pytest.fixture
def cfg():
    # the method's own arithmetic: plain sample weights, replies of the model unchanged accepted (the screening
    # defaults that change both are tested in tests/test_hostile_numbers.py)
    return JobConfig(run_name="test", strategy="fedproin", num_server_rounds=2, synthetic_samples=120, image_size=16,
                     batch_size=16, min_partition_size=5, model="small-cnn",
                     screening={"max-hospital-weight": 1.0, "refuse-unchanged": False})


# --- aggregation ----------------------------------------------------------------------------------
def test_nia_weights_each_prototype_by_its_influence_and_keeps_unused_ones():
    rng = np.random.default_rng(0)
    p1, p2, previous = (rng.normal(size=(2, 2, 3)).astype(np.float32) for _ in range(3))
    i1 = np.array([[3, 0], [1, 1]])
    i2 = np.array([[1, 0], [0, 3]])
    result = normalised_influence_aggregation([p1, p2], [i1, i2], previous)
    np.testing.assert_allclose(result[0, 0], (3 * p1[0, 0] + 1 * p2[0, 0]) / 4, rtol=1e-6)
    np.testing.assert_array_equal(result[0, 1], previous[0, 1])  # nobody used it: the previous global value
    np.testing.assert_allclose(result[1, 0], p1[1, 0], rtol=1e-6)  # only hospital 1 used it
    np.testing.assert_allclose(result[1, 1], (p1[1, 1] + 3 * p2[1, 1]) / 4, rtol=1e-6)
    assert result.dtype == np.float32


def honest_reply(engine, name, n=20, scale=1.0, influence=None):
    arrays = {k: (v * scale if v.dtype.kind == "f" else v.copy()) for k, v in engine.method.global_arrays.items()}
    shape = arrays["prototypes"].shape[:2]
    counts = np.zeros(shape, dtype=np.int64) if influence is None else np.asarray(influence)
    if influence is None:
        counts[:, 0] = 1
    return RoundReply(HospitalInfo(name, n), Payload(arrays={"model": arrays},
                                                     metrics={"num-examples": n, "server-round": 1,
                                                              "influence": counts.ravel().tolist()}))


def test_server_averages_the_encoder_by_samples_and_records_prototype_usage(cfg):
    engine = RoundEngine(cfg)
    before = {k: v.copy() for k, v in engine.method.global_arrays.items()}
    classes, per_class = before["prototypes"].shape[:2]
    first = np.zeros((classes, per_class), dtype=np.int64)
    first[:, 0] = 2
    second = np.zeros_like(first)
    second[:, 0] = 1
    replies = [honest_reply(engine, "h1", n=10, scale=2.0, influence=first),
               honest_reply(engine, "h2", n=30, scale=4.0, influence=second)]
    record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    after = engine.method.global_arrays
    weight = next(k for k, v in before.items() if k != "prototypes" and v.dtype.kind == "f" and np.abs(v).sum() > 0)
    np.testing.assert_allclose(after[weight], before[weight] * (2.0 * 10 + 4.0 * 30) / 40, rtol=1e-5)  # FedAvg
    np.testing.assert_allclose(after["prototypes"][:, 0], before["prototypes"][:, 0] * (2.0 * 2 + 4.0 * 1) / 3,
                               rtol=1e-5)  # NIA: weights 2 and 1, not 10 and 30
    np.testing.assert_array_equal(after["prototypes"][:, 1], before["prototypes"][:, 1])  # unused: kept
    method = record["method"]
    assert method["influence"]["h1"] == first.tolist() and method["prototype-usage"] == (first + second).tolist()
    assert method["unused-prototypes"] == [f"{name}#1" for name in ("solid", "ring", "striped", "dotted")]


def test_without_nia_prototypes_are_averaged_by_sample_counts(cfg):
    engine = RoundEngine(cfg.model_copy(update={"fedproin": cfg.fedproin.model_copy(update={"aggregation": "fedavg"})}))
    before = engine.method.global_arrays["prototypes"].copy()
    replies = [honest_reply(engine, "h1", n=10, scale=2.0), honest_reply(engine, "h2", n=30, scale=4.0)]
    engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    np.testing.assert_allclose(engine.method.global_arrays["prototypes"], before * 3.5, rtol=1e-5)


def test_malformed_replies_are_refused_with_a_reason_and_the_round_goes_on(cfg, caplog):
    engine = RoundEngine(cfg)
    shape = engine.method.global_arrays["prototypes"].shape[:2]
    wrong_shape = honest_reply(engine, "h-shape", influence=np.ones((shape[0], shape[1] + 1), np.int64))
    negative = honest_reply(engine, "h-negative", influence=-np.ones(shape, np.int64))
    not_finite = honest_reply(engine, "h-inf", influence=np.full(shape, np.inf))
    too_many = honest_reply(engine, "h-inflated", n=5, influence=np.full(shape, 100, np.int64))
    missing = honest_reply(engine, "h-missing")
    del missing.payload.metrics["influence"]
    nan_prototypes = honest_reply(engine, "h-nan")
    nan_prototypes.payload.arrays["model"]["prototypes"][0, 0, 0] = np.nan
    good = [honest_reply(engine, "h-good-1"), honest_reply(engine, "h-good-2")]
    replies = [wrong_shape, negative, not_finite, too_many, missing, nan_prototypes, *good]
    with caplog.at_level(logging.WARNING, logger="fedmed"):
        record = engine.complete_round(1, [r.hospital for r in replies], replies, 0.0)
    refused = record["refused"]
    assert record["aggregated"] == ["h-good-1", "h-good-2"]
    assert "shape" in refused["h-shape"] and "negative" in refused["h-negative"]
    assert "NaN or Inf" in refused["h-inf"] and "more than the 5" in refused["h-inflated"]
    assert "no influence matrix" in refused["h-missing"] and "prototypes holds NaN" in refused["h-nan"]
    assert "refused the update of h-negative" in caplog.text
    assert np.isfinite(engine.method.global_arrays["prototypes"]).all()


# --- hospital side ---------------------------------------------------------------------------------
def test_mcel_and_mcl_compare_the_true_class_with_the_nearest_rival():
    scores = torch.tensor([[-1.0, -4.0, -9.0], [-2.0, -3.0, -6.0]])  # minus squared distances
    target = torch.tensor([0, 2])  # d_y - d_c: 1 - 4 = -3 and 6 - 2 = 4
    expected = (torch.sigmoid(torch.tensor(-3.0 * 0.5)) + torch.sigmoid(torch.tensor(4.0 * 0.5))) / 2
    assert torch.isclose(minimum_classification_error(scores, target, xi=0.5), expected)
    assert torch.isclose(margin_classification(scores, target, margin=0.5), torch.tensor((0.0 + 4.5) / 2))


def test_dce_is_cross_entropy_on_scaled_distances_and_reaches_every_rival():
    scores = torch.tensor([[-1.0, -4.0, -9.0]], requires_grad=True)
    target = torch.tensor([0])
    logits = torch.tensor([-0.5, -2.0, -4.5])
    expected = -(logits[0] - torch.logsumexp(logits, 0))
    loss = distance_cross_entropy(scores, target, gamma=0.5)
    assert torch.isclose(loss, expected)
    loss.backward()
    assert scores.grad[0, 2] > 0  # the far rival (class 2) is pushed away too
    mcel_scores = scores.detach().clone().requires_grad_(True)
    minimum_classification_error(mcel_scores, target, xi=0.5).backward()
    assert mcel_scores.grad[0, 2] == 0  # MCEL sees only the nearest rival


def test_pcl_value_and_sign():
    global_, previous = torch.zeros(1, 1, 2), torch.tensor([[[2.0, 0.0]]])
    halfway = torch.tensor([[[1.0, 0.0]]])
    assert torch.isclose(prototype_contrastive_loss(halfway, global_, previous, 0.5), torch.tensor(0.5))
    assert prototype_contrastive_loss(global_.clone(), global_, previous, 0.5) == 0  # at the global prototype
    assert torch.isclose(prototype_contrastive_loss(previous.clone(), global_, previous, 0.5), torch.tensor(1.5))

    local = torch.tensor([[[1.5, 0.3]]], requires_grad=True)  # nearer the previous prototype than the global one
    prototype_contrastive_loss(local, global_, previous, 0.5).backward()
    stepped = local.detach() - 0.1 * local.grad
    assert torch.linalg.norm(stepped - global_) < torch.linalg.norm(local.detach() - global_)  # pulled to global
    assert torch.linalg.norm(stepped - previous) > torch.linalg.norm(local.detach() - previous)  # pushed from previous

    at_global = global_.clone().requires_grad_(True)  # where local training starts: d_glob = 0
    prototype_contrastive_loss(at_global, global_, previous, 0.9).backward()
    assert torch.isfinite(at_global.grad).all()


def test_influence_counts_each_sample_for_its_own_class_nearest_prototype():
    # Images of one pixel; the encoder flattens them, so features are the normalised pixel values.
    pixels = np.array([[10, 10, 10], [20, 20, 20], [240, 240, 240], [120, 120, 120], [250, 250, 250]], np.uint8)
    labels = np.array([0, 0, 0, 1, 1])
    data = LabelledImages(pixels[:, None, None, :], labels, ("a", "b"))
    features = images_to_tensor(data.images, torch.device("cpu")).flatten(1)
    model = PrototypeNet(torch.nn.Flatten(), num_classes=2, prototypes_per_class=2, feature_dim=3)
    with torch.no_grad():  # class a: dark and bright prototypes; class b: mid grey and (unused) bright
        model.prototypes.copy_(torch.stack([torch.stack([features[0], features[2]]),
                                            torch.stack([features[3], features[2] + 5.0])]))
    cfg = JobConfig(fedproin={"num-prototypes": 2})
    task = PrototypeClassificationTask(cfg, {"num-classes": 2, "in-channels": 3})
    counts = influence_counts(model, task, data, torch.device("cpu"))
    # The bright class-b sample (250) is nearest to class a's bright prototype overall, but counts for
    # its own class's nearest prototype, so each row sums to the class's sample count.
    np.testing.assert_array_equal(counts, [[2, 1], [2, 0]])
    assert counts.dtype == np.int64


def site_with_state(cfg, folder, name="hospital-00"):
    reference = simulated_sites(cfg, 2)[0]
    return Site(name, reference.train, reference.val, torch.device("cpu"), state=HospitalStateStore(folder))


def test_prototypes_persist_across_rounds_and_a_restart(cfg, tmp_path):
    engine = RoundEngine(cfg)
    hospital = FedProInHospital(cfg, site_with_state(cfg, tmp_path / "state"))
    fresh = hospital.task.model_from_payload(engine.downlink(1, hospital.info()))
    assert hospital.previous_prototypes(1, fresh) is None  # first participation: no PCL
    first = hospital.train(1, engine.downlink(1, hospital.info()))
    assert np.sum(first.metrics["influence"]) == len(hospital.site.train)

    restarted = FedProInHospital(cfg, site_with_state(cfg, tmp_path / "state"))  # new process, same folder
    np.testing.assert_array_equal(restarted.previous_prototypes(3, fresh), first.arrays["model"]["prototypes"])
    third = restarted.train(3, engine.downlink(3, restarted.info()))
    again = FedProInHospital(cfg, site_with_state(cfg, tmp_path / "state"))
    np.testing.assert_array_equal(again.previous_prototypes(4, fresh), third.arrays["model"]["prototypes"])
    np.testing.assert_array_equal(again.previous_prototypes(3, fresh), first.arrays["model"]["prototypes"])  # replay
    assert not np.array_equal(first.arrays["model"]["prototypes"], third.arrays["model"]["prototypes"])


def test_regulariser_measures_drift_from_what_was_received(cfg):
    task = PrototypeClassificationTask(cfg, {"num-classes": 4, "in-channels": 3})
    torch.manual_seed(0)
    model = task.build_model()
    x = torch.randn(8, 3, 16, 16)
    y = torch.zeros(8, dtype=torch.long)
    previous = model.prototypes.detach().numpy() + 1.0
    term, tap = fedproin_regulariser(model, cfg.fedproin, previous, torch.device("cpu"))
    assert term(model, x, y, model(x)).item() == pytest.approx(0.0, abs=1e-6)  # unchanged: no drift, PCL inactive
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    assert term(model, x, y, model(x)).item() > 0.01
    tap.remove()
    none_term, none_tap = fedproin_regulariser(model, cfg.fedproin.model_copy(update={"fdl_weight": 0.0}), None,
                                               torch.device("cpu"))
    assert none_term is None and none_tap is None  # no FDL, first participation: nothing to add


def test_class_balanced_draws_and_per_class_augmentation():
    labels = np.array([0] * 90 + [1] * 9 + [2] * 1)
    draws = balanced_draws(labels, 30_000, np.random.default_rng(0))
    shares = np.bincount(labels[draws], minlength=3) / len(draws)
    np.testing.assert_allclose(shares, [1 / 3] * 3, atol=0.02)
    np.testing.assert_allclose(augmentation_probabilities(np.array([90, 9, 1, 0])), [0.0, 0.9, 1 - 1 / 90, 1.0])

    rng = np.random.default_rng(1)
    x = images_to_tensor(rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8), torch.device("cpu"))
    out = augment_by_class(x, np.array([0, 0, 0, 1, 1, 1]), np.array([0.0, 1.0]), rng)
    assert out.shape == x.shape
    assert torch.equal(out[:3], x[:3])  # the largest class is left as it is
    assert all(not torch.allclose(out[i], x[i]) for i in range(3, 6))  # the rare class always augmented


# --- whole federations -----------------------------------------------------------------------------
@pytest.mark.parametrize("ablation", [{}, {"fdl_weight": 0.0, "pcl_weight": 0.0, "aggregation": "fedavg"},
                                      {"task_loss": "mcl", "class_balanced": False, "class_augmentation": False},
                                      {"task_loss": "dce"}, {"class_balanced": True, "class_augmentation": True}])
def test_two_round_in_process_federation(cfg, ablation):
    cfg = cfg.model_copy(update={"fraction_train": 0.7, "fedproin": cfg.fedproin.model_copy(update=ablation)})
    engine = run_rounds(cfg, simulated_sites(cfg, 3))
    assert [r["round"] for r in engine.history] == [1, 2]
    for record in engine.history:
        assert len(record["aggregated"]) == 2 and not record["refused"]
        assert set(record["method"]["influence"]) == set(record["aggregated"])
        assert 0.0 <= record["test"]["accuracy"] <= 1.0 and np.isfinite(record["train"]["train-loss"])
    assert engine.method.global_arrays["prototypes"].shape[:2] == (4, 2)
