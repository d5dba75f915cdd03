"""Patient-level DP-SGD under a hospital policy's ``[patient-dp]`` (common/trust/patient_dp.py): its epsilon is the
Poisson-subsampled Gaussian's as an independent accountant counts it, a patient's images are clipped as one, the
budget stops training before a round would pass it, the ledger keeps it across restarts and deletion, and what it
cannot serve is refused with its reason."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import load_job_config
from common.data.containers import LabelledImages
from common.trust.ledger import LEDGER_FILE, PrivacyLedger, rebuild_ledger, releases_epsilon
from common.trust.patient_dp import (
    DATA_FREE,
    DPSGD,
    PER_SAMPLE,
    Release,
    loss_term,
    plan_epsilon,
    plan_release,
    unit_ids,
)
from common.trust.policy import PatientDP, PolicyRefusal, read_policy

from .test_policy import federation, policy_file
from .test_strategies import SMALL_CLASSIFICATION

pytestmark = pytest.mark.usefixtures("one_thread")
dp_accounting = pytest.importorskip("dp_accounting")
pytest.importorskip("opacus")

PATIENT_DP = "[patient-dp]\nnoise-multiplier = 1.0\nmax-grad-norm = 1.0\ndelta = 1e-5\n"
GROUP_NORM = {"patient-dp.group-norm": True, "patient-dp.batch-size": 16, "patient-dp.steps": 2}


@pytest.mark.parametrize("q,sigma,steps", [(0.01, 1.1, 1000), (0.2, 0.8, 50), (1.0, 4.0, 10)])
def test_epsilon_is_the_independent_accountants_for_the_poisson_subsampled_gaussian(q, sigma, steps):
    from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent, pld, rdp

    from common.trust.secure_aggregation.distributed_dp import ORDERS

    event = SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)
    google = rdp.RdpAccountant(orders=[float(a) for a in ORDERS])
    google.compose(event)
    entry = Release(sigma, q, steps, "patient", 100).entry()
    ours = releases_epsilon([{"noise-multiplier": None, "patient-dp": entry}], 1e-5)
    assert ours == pytest.approx(google.get_epsilon(1e-5), rel=1e-6)
    assert ours == pytest.approx(plan_epsilon(q, sigma, steps, 1e-5))
    tight = pld.PLDAccountant()  # RDP is an upper bound of the exact privacy-loss distribution's epsilon
    tight.compose(event)
    assert tight.get_epsilon(1e-5) <= ours <= 1.5 * tight.get_epsilon(1e-5)


def test_target_epsilon_sets_the_noise_the_whole_plan_stays_within():
    cfg = load_job_config({**SMALL_CLASSIFICATION, "num-server-rounds": 10, "patient-dp.batch-size": 8})
    data = LabelledImages(np.zeros((40, 4, 4, 3), np.uint8), np.zeros(40, np.int64), ("a", "b"),
                          groups=np.repeat(np.arange(20), 2))
    release = plan_release(PatientDP(target_epsilon=3.0, max_grad_norm=1.0), cfg, data)
    assert release.units == 20 and release.sample_rate == pytest.approx(8 / 20) and release.steps == 3
    spent = plan_epsilon(release.sample_rate, release.noise_multiplier, 10 * release.steps, 1e-5)
    assert 2.95 < spent <= 3.0
    assert plan_epsilon(release.sample_rate, release.noise_multiplier * 0.99, 30, 1e-5) > 3.0


@settings(max_examples=20, deadline=None)
@given(owners=st.lists(st.integers(0, 3), min_size=1, max_size=8), clip=st.sampled_from([0.01, 0.3, 100.0]),
       physical=st.integers(1, 8), unit=st.sampled_from(["patient", "image"]), term=st.booleans())
def test_a_patients_images_are_clipped_together(owners, clip, physical, unit, term):
    """One patient's gradient is the sum of its images' gradients, clipped as one (each image alone under 'image'),
    whatever the grouping and however the physical batches split the patients; a method's per-sample loss term
    (MOON's) is in each image's gradient before the clip."""
    from opacus import GradSampleModule

    from common.tasks.base import images_to_tensor
    from common.trust.patient_dp import _whole_units

    cfg = load_job_config({**SMALL_CLASSIFICATION, "num-classes": 2})
    rng = np.random.default_rng(len(owners))
    n = len(owners)
    data = LabelledImages(rng.integers(0, 255, (n, 2, 2, 1), dtype=np.uint8), rng.integers(0, 2, n), ("a", "b"),
                          groups=np.array([f"p{o}" for o in owners]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    task = type("Task", (), {"cfg": cfg, "loss": staticmethod(torch.nn.functional.cross_entropy)})()

    want = [torch.zeros_like(p) for p in model.parameters()]
    patients = sorted(set(owners)) if unit == "patient" else list(range(n))
    for patient in patients:
        members = [i for i in range(n) if (owners[i] if unit == "patient" else i) == patient]
        model.zero_grad()
        x = images_to_tensor(data.images[members], torch.device("cpu"))
        output = model(x)
        loss = torch.nn.functional.cross_entropy(output, torch.from_numpy(data.labels[members]), reduction="sum")
        (loss + (output.pow(2).sum() if term else 0)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        for total, g in zip(want, grads):
            total += g * min(1.0, clip / norm)

    units = unit_ids(data, unit)
    members = np.argsort(units, kind="stable")
    starts = np.searchsorted(units[members], np.arange(units.max() + 2))
    sampled = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    params = list(model.parameters())
    got = [torch.zeros_like(p) for p in params]
    no_flips = type("NoFlips", (), {"random": lambda self, k: np.ones(k)})()  # the sums above see no flip
    dp_sgd = DPSGD(PatientDP(noise_multiplier=1.0, max_grad_norm=clip, unit=unit),
                   Release(1.0, 1.0, 1, unit, len(patients)))
    squares = loss_term(lambda _model, _x, _y, output: output.pow(2).sum(1).mean(), PER_SAMPLE) if term else None
    for chunk in _whole_units(np.arange(len(patients)), starts, physical):
        dp_sgd._clipped_sum(task, sampled, params, data, members, starts, chunk, torch.device("cpu"), no_flips, got,
                            clip, squares)
    sampled._close()
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5)


def test_a_hospital_trains_with_dp_sgd_and_counts_it_per_patient(tmp_path):
    strategy, history = federation(tmp_path, PATIENT_DP, rounds=1, **GROUP_NORM)
    assert history[0]["aggregated"] == ["hospital-00", "hospital-01"]
    releases = PrivacyLedger(tmp_path / "state" / "hospital-00").releases()
    entry = releases[0]["patient-dp"]
    assert entry["mechanism"] == "poisson-gaussian" and entry["unit"] == "patient" and entry["steps"] == 2
    assert entry["adjacency"] == "add-remove" and releases[0]["noise-multiplier"] is None
    assert PrivacyLedger(tmp_path / "state" / "hospital-00").epsilon(1e-5) == pytest.approx(
        plan_epsilon(entry["sample-rate"], 1.0, 2, 1e-5))
    audit = [json.loads(line) for line in (tmp_path / "state" / "hospital-00" / "audit.jsonl").read_text().splitlines()]
    assert any(line.get("mechanism") == "dp-sgd" and line.get("unit") == "patient" for line in audit)
    modules = list(strategy.engine.method.evaluation_model().modules())
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in modules)
    norms = [m for m in modules if isinstance(m, torch.nn.GroupNorm)]
    assert norms and all(m.num_channels // m.num_groups == min(16, m.num_channels) for m in norms)  # not 1 a group


def test_the_budget_stops_a_round_before_it_would_pass_it_and_survives_restart_and_deletion(tmp_path):
    one = federation(tmp_path, PATIENT_DP, rounds=1, **GROUP_NORM, **{"run-name": "probe"})
    folder = tmp_path / "state" / "hospital-00"
    spent = PrivacyLedger(folder).epsilon(1e-5)
    assert one[1][0]["aggregated"] and spent > 0
    budget = f"max-epsilon = {spent * 1.5:.6g}\n"  # room for one more round, not for two
    _, history = federation(tmp_path, PATIENT_DP + budget, rounds=2, **GROUP_NORM, **{"run-name": "budget"})
    assert history[0]["aggregated"] == ["hospital-00", "hospital-01"]
    reason = history[1]["refused"]["hospital-00"]
    assert "privacy budget spent" in reason and f"max-epsilon={spent * 1.5:.6g}" in reason
    two = PrivacyLedger(folder).epsilon(1e-5)
    assert spent < two <= spent * 1.5
    # a restart (a new run, a new process) finds the same epsilon, and is refused too
    _, again = federation(tmp_path, PATIENT_DP + budget, rounds=1, **GROUP_NORM, **{"run-name": "restart"})
    assert "privacy budget spent" in again[0]["refused"]["hospital-00"]
    # a deleted ledger does not start the count afresh: training stops until the operator rebuilds it from the log
    (folder / LEDGER_FILE).unlink()
    _, deleted = federation(tmp_path, PATIENT_DP, rounds=1, **GROUP_NORM, **{"run-name": "deleted"})
    assert "rebuild-ledger" in deleted[0]["refused"]["hospital-00"]
    assert rebuild_ledger(folder / "audit.jsonl", folder) == 2
    assert PrivacyLedger(folder).epsilon(1e-5) == pytest.approx(two)


def test_local_dp_and_patient_dp_compose_in_one_ledger():
    """Local DP's release bounds any change of the hospital's data by 2C, so it holds per patient under add/remove
    with its multiplier as it is; the two compose by adding their RDP."""
    from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent, rdp

    from common.trust.secure_aggregation.distributed_dp import ORDERS

    entry = Release(1.0, 0.1, 20, "patient", 100).entry()
    mixed = releases_epsilon([{"noise-multiplier": 5.0}, {"noise-multiplier": None, "patient-dp": entry}], 1e-5)
    google = rdp.RdpAccountant(orders=[float(a) for a in ORDERS])
    google.compose(GaussianDpEvent(5.0))
    google.compose(SelfComposedDpEvent(PoissonSampledDpEvent(0.1, GaussianDpEvent(1.0)), 20))
    assert mixed == pytest.approx(google.get_epsilon(1e-5), rel=1e-6)
    assert releases_epsilon([{"noise-multiplier": None}, {"noise-multiplier": None, "patient-dp": entry}],
                            1e-5) == float("inf")  # a training without any noise still makes it infinite


@pytest.mark.parametrize("method,kind", [("fedprox", DATA_FREE), ("moon", PER_SAMPLE)])
def test_fedprox_and_moon_train_under_dp_sgd_with_their_terms_and_are_charged(tmp_path, monkeypatch, method, kind):
    """FedProx's proximal term (data-free: its gradient after the noise) and MOON's contrastive term (per sample:
    clipped with the task loss) go through DP-SGD; every round is charged per patient."""
    from common.methods.registry import strategy_class

    seen = []
    fit = DPSGD.fit
    monkeypatch.setattr(DPSGD, "fit", lambda self, task, *a, extra_loss=None, **k: (
        seen.append(getattr(extra_loss, "patient_dp", None)), fit(self, task, *a, extra_loss=extra_loss, **k))[1])
    _, history = federation(tmp_path, PATIENT_DP, rounds=2, strategy=strategy_class(method), **GROUP_NORM)
    assert [r["aggregated"] for r in history] == [["hospital-00", "hospital-01"]] * 2
    assert kind in seen  # MOON's term starts in round 2, once a hospital has its previous model
    releases = PrivacyLedger(tmp_path / "state" / "hospital-00").releases()
    assert [r["patient-dp"]["unit"] for r in releases] == ["patient", "patient"]


@pytest.mark.parametrize("layers", ["all", "head"])
def test_a_group_norm_resnet_trains_under_dp_sgd_whole_or_head_only(tmp_path, layers):
    """The built-in ResNet-18 (MONAI's blocks add their residual in place, which Opacus's hooks refuse) trains under
    DP-SGD; with train-layers = head only its last linear layer moves (the frozen pretrained encoder's start)."""
    strategy, history = federation(tmp_path, PATIENT_DP, model="resnet18", **{
        "resnet-width": 0.125, **GROUP_NORM, "patient-dp.train-layers": layers})
    assert history[0]["aggregated"] == ["hospital-00", "hospital-01"]
    trained = strategy.engine.method.evaluation_model().state_dict()
    start = type(strategy)(min_train_nodes=1, min_available_nodes=2, run_config=strategy.job.to_flat())
    moved = {k for k, v in start.engine.method.evaluation_model().state_dict().items()
             if not torch.equal(v, trained[k])}
    assert moved == {"fc.weight", "fc.bias"} if layers == "head" else len(moved) > 2


def test_an_extra_loss_that_declares_no_kind_is_refused():
    dp_sgd = DPSGD(PatientDP(noise_multiplier=1.0, max_grad_norm=1.0), Release(1.0, 1.0, 1, "patient", 1))
    cfg = load_job_config({**SMALL_CLASSIFICATION, **GROUP_NORM})
    with pytest.raises(PolicyRefusal, match="declares neither per-sample nor data-free"):
        dp_sgd.fit(type("Task", (), {"cfg": cfg})(), torch.nn.Linear(2, 2), None, "cpu", 0,
                   extra_loss=lambda *_: torch.zeros(()))


def test_fedproin_trains_under_dp_sgd_without_its_counts_or_a_prototype_placed_on_a_patient(tmp_path, monkeypatch):
    """FedProIn under patient-level DP-SGD: encoder and prototypes train through per-patient gradients, FDL clipped
    with the task loss and PCL (from round 2) after the noise; its round-1 k-means start and the server's re-seeding
    never read the data, and its influence counts are its samples spread evenly (no count of any patient's); every
    round is charged per patient."""
    from common.methods.registry import strategy_class
    from strategies.fedproin import hospital

    seen, placed = [], []
    fit = DPSGD.fit
    monkeypatch.setattr(DPSGD, "fit", lambda self, task, *a, extra_loss=None, **k: (
        seen.append((extra_loss.per_sample_part is not None, extra_loss.data_free_part is not None)),
        fit(self, task, *a, extra_loss=extra_loss, **k))[1])
    for name in ("initialise_prototypes", "reseed_prototypes", "influence_counts"):
        monkeypatch.setattr(hospital, name, lambda *a, name=name, **k: placed.append(name))
    strategy, history = federation(tmp_path, PATIENT_DP, rounds=2, strategy=strategy_class("fedproin"),
                                   **GROUP_NORM, **{"fedproin.prototype-init": "class-means",
                                                    "fedproin.reseed-after": 1})
    assert [r["aggregated"] for r in history] == [["hospital-00", "hospital-01"]] * 2
    assert placed == [] and (True, True) in seen and seen[0] == (True, False)  # PCL once a round was trained
    start = type(strategy)(min_train_nodes=1, min_available_nodes=2, run_config=strategy.job.to_flat())
    before = start.engine.method.evaluation_model().prototypes.detach()
    assert not torch.equal(strategy.engine.method.evaluation_model().prototypes.detach(), before)
    releases = PrivacyLedger(tmp_path / "state" / "hospital-00").releases()
    assert [r["patient-dp"]["unit"] for r in releases] == ["patient", "patient"]


def test_the_prototypes_per_patient_gradients_are_each_patients_own_with_the_feature_term():
    """Through ``PrototypeNet.per_sample_view`` a patient's clipped gradient is the sum of its images' gradients of
    the task loss and a term read from the encoder's features (FDL's path, which reaches the encoder other than
    through the scores), prototypes included, clipped as one."""
    from opacus import GradSampleModule

    from common.models.prototype_net import PrototypeNet
    from common.models.representations import FeatureTap
    from common.tasks.base import images_to_tensor
    from common.trust.patient_dp import _whole_units

    cfg = load_job_config({**SMALL_CLASSIFICATION, "num-classes": 2})
    rng = np.random.default_rng(3)
    owners = [0, 0, 1, 2, 2, 2]
    n = len(owners)
    data = LabelledImages(rng.integers(0, 255, (n, 2, 2, 1), dtype=np.uint8), rng.integers(0, 2, n), ("a", "b"),
                          groups=np.array([f"p{o}" for o in owners]))
    torch.manual_seed(0)
    model = PrototypeNet(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3)), 2, 2, 3)
    tap = FeatureTap(model.encoder)
    task = type("Task", (), {"cfg": cfg, "loss": staticmethod(torch.nn.functional.cross_entropy)})()
    clip = 0.5

    want = [torch.zeros_like(p) for p in model.parameters()]
    for patient in sorted(set(owners)):
        members = [i for i in range(n) if owners[i] == patient]
        model.zero_grad()
        output = model(images_to_tensor(data.images[members], torch.device("cpu")))
        loss = torch.nn.functional.cross_entropy(output, torch.from_numpy(data.labels[members]), reduction="sum")
        (loss + tap.value.pow(2).sum()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        for total, g in zip(want, grads):
            total += g * min(1.0, clip / norm)

    units = unit_ids(data, "patient")
    members = np.argsort(units, kind="stable")
    starts = np.searchsorted(units[members], np.arange(units.max() + 2))
    sampled = GradSampleModule(model.per_sample_view(), batch_first=True, loss_reduction="sum")
    params = list(model.parameters())
    got = [torch.zeros_like(p) for p in params]
    no_flips = type("NoFlips", (), {"random": lambda self, k: np.ones(k)})()
    dp_sgd = DPSGD(PatientDP(noise_multiplier=1.0, max_grad_norm=clip), Release(1.0, 1.0, 1, "patient", 3))
    features = loss_term(lambda _model, _x, _y, _output: tap.value.pow(2).sum(1).mean(), PER_SAMPLE)
    for chunk in _whole_units(np.arange(3), starts, 4):
        dp_sgd._clipped_sum(task, sampled, params, data, members, starts, chunk, torch.device("cpu"), no_flips, got,
                            clip, features)
    sampled._close()
    assert torch.count_nonzero(next(g for g, p in zip(got, params) if p is model.prototypes))  # they do move
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5)


@pytest.mark.parametrize("method,named", [("fedbn", "BatchNorm"), ("fedproto", "class means")])
def test_a_method_dp_sgd_cannot_serve_is_refused_with_its_reason(tmp_path, method, named):
    from common.methods.registry import strategy_class

    _, history = federation(tmp_path, PATIENT_DP, strategy=strategy_class(method))
    reason = history[0]["refused"]["hospital-00"]
    assert "patient-dp" in reason and named in reason


def test_a_batchnorm_network_is_refused_with_the_fix(tmp_path):
    _, history = federation(tmp_path, PATIENT_DP, **{"patient-dp.steps": 1})
    reason = history[0]["refused"]["hospital-00"]
    assert "per-patient gradients" in reason and "patient-dp.group-norm = true" in reason


def test_the_policy_table_needs_exactly_one_noise(tmp_path):
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="exactly one of target-epsilon and noise-multiplier"):
        read_policy(policy_file(tmp_path, "[patient-dp]\nmax-grad-norm = 1.0\n"))
    policy, _ = read_policy(policy_file(tmp_path, "[patient-dp]\ntarget-epsilon = 8\nmax-grad-norm = 1.0\n"))
    assert policy.patient_dp.unit == "patient" and policy.metrics_released == "none"


def test_dp_sgd_under_secure_aggregation_and_the_console_shows_the_budget_per_patient(tmp_path):
    """The two protect different things (the patient against everyone, the update against the server): a secure
    round of DP-SGD hospitals aggregates, each ledger counts it per patient, and the hospital's page says so."""
    from console.hospital_view import read_hospital
    from strategies import FedAvgStrategy

    from .fake_grid import FakeGrid, hospital_node

    (tmp_path / "dp.toml").write_text(PATIENT_DP + "max-epsilon = 50\n")
    config = {**SMALL_CLASSIFICATION, **GROUP_NORM, "run-name": "t", "state-dir": str(tmp_path / "state"),
              "results-dir": str(tmp_path / "results"), "strategy": "fedavg", "secure-aggregation.enabled": True}
    nodes = {100 + pid: hospital_node(config, {"partition-id": pid, "num-partitions": 3,
                                               "policy-file": str(tmp_path / "dp.toml")}, 100 + pid)
             for pid in range(3)}
    strategy = FedAvgStrategy(min_train_nodes=3, min_available_nodes=3, run_config=config)
    strategy.start(FakeGrid(nodes), num_rounds=1)
    assert sorted(strategy.engine.history[0]["aggregated"]) == ["hospital-00", "hospital-01", "hospital-02"]
    folder = tmp_path / "state" / "hospital-00"
    spent = PrivacyLedger(folder).epsilon(1e-5)
    view = read_hospital(folder, policy_file=tmp_path / "dp.toml")
    assert view.privacy.unit == "patient" and view.privacy.max_epsilon == 50
    assert view.privacy.epsilon == pytest.approx(spent) and 0 < spent < 50


def test_a_training_that_bypasses_dp_sgd_is_not_sent(tmp_path, monkeypatch):
    """Fail closed: a method declared fit for DP-SGD whose training does not go through it has its reply refused."""
    from common.methods.base import Payload
    from common.methods.local_training import LocalTraining

    monkeypatch.setattr(LocalTraining, "train", lambda self, rnd, payload: Payload(
        arrays={"model": dict(payload.arrays["model"])}, metrics={"num-examples": len(self.site.train)}))
    _, history = federation(tmp_path, PATIENT_DP, **GROUP_NORM)
    assert "did not run through DP-SGD" in history[0]["refused"]["hospital-00"]
    assert not history[0]["aggregated"]
