"""A hospital's own policy (common/trust/policy.py, node config ``policy-file``): read from its file only, enforced in
the hospital-side API whatever the message says; each refusal an error reply whose reason reaches the server's record
and metrics.jsonl's ``refused``; k on FedProIn's counts and prototypes and FedProto's class means; local DP's clipping
and noise, and its epsilon kept across restarts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from common.config import ConfigError, load_job_config
from common.engine.inprocess import simulated_sites
from common.engine.round_engine import RoundEngine
from common.methods.registry import hospital_class
from common.trust.enforcer import Enforcer
from common.trust.ledger import PrivacyLedger
from common.trust.local_dp import clip_and_noise, effective_noise_multiplier, epsilon_of
from common.trust.policy import PolicyRefusal, read_policy
from server_app.results import read_history, write_results
from strategies import FedAvgStrategy, FedProtoStrategy

from .fake_grid import FakeGrid, simulated_hospitals
from .test_strategies import SMALL_CLASSIFICATION, run_config

pytestmark = pytest.mark.usefixtures("one_thread")
dp_accounting = pytest.importorskip("dp_accounting")

DP = "[local-dp]\nclip-norm = 0.5\nnoise-multiplier = 1.0\ndelta = 1e-5\n"


def policy_file(tmp_path, text: str, name: str = "policy.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def federation(tmp_path, policy: str, strategy=FedAvgStrategy, rounds: int = 1, hospitals: int = 2, **extra):
    """A FakeGrid run whose hospitals all hold ``policy``; the strategy, and metrics.jsonl as the ServerApp writes
    it."""
    config = run_config(tmp_path, SMALL_CLASSIFICATION, **extra)
    nodes = simulated_hospitals(config, hospitals, **{"policy-file": policy_file(tmp_path, policy)})
    chosen = strategy(min_train_nodes=1, min_available_nodes=hospitals, run_config=config)
    try:
        chosen.start(FakeGrid(nodes), num_rounds=rounds)
    except RuntimeError:  # a ConfigError before round 1 (every hospital refused the job)
        pass
    write_results(chosen.job.run_dir, chosen.job.to_flat(), chosen.engine.history, plots=False)
    return chosen, read_history(chosen.job.run_dir)


# --- the file -----------------------------------------------------------------------------------------------
def test_policy_is_read_from_toml_and_json(tmp_path):
    toml, digest = read_policy(policy_file(tmp_path, 'methods = ["fedavg"]\nmin-samples = 5\n' + DP))
    same, _ = read_policy(policy_file(tmp_path, json.dumps(
        {"methods": ["fedavg"], "min-samples": 5,
         "local-dp": {"clip-norm": 0.5, "noise-multiplier": 1.0, "delta": 1e-5}}), "policy.json"))
    assert toml == same and len(digest) == 64
    assert toml.metrics_released == "none"  # under local DP nothing but the model and its counts leaves by default


@pytest.mark.parametrize("text,named", [
    ("min-sample = 5\n", "min-sample"),
    ('methods = ["fedavgg"]\n', "fedavgg"),
    ('methods = ["fedproto"]\n' + DP, "FedProto"),
    ("min-samples = 0\n", "min-samples"),
    ("[local-dp]\nclip-norm = -1\nnoise-multiplier = 1.0\n", "clip-norm"),
    ("methods = ", "TOML"),
])
def test_a_bad_policy_is_refused_naming_the_key(tmp_path, text, named):
    with pytest.raises(ConfigError, match=named):
        read_policy(policy_file(tmp_path, text))


def test_a_missing_policy_file_stops_the_node_config(tmp_path):
    from client_app.node_config import load_node_config

    with pytest.raises(ConfigError, match="policy-file"):
        load_node_config({"partition-id": 0, "num-partitions": 2, "policy-file": str(tmp_path / "absent.toml")})


# --- refusals reach the server's records ---------------------------------------------------------------------
def test_a_method_the_policy_does_not_allow_is_refused_in_metrics_jsonl(tmp_path):
    strategy, history = federation(tmp_path, 'methods = ["fedprox"]\n')
    refused = history[0]["refused"]
    assert sorted(refused) == ["hospital-00", "hospital-01"]
    assert "refused by its policy" in refused["hospital-00"] and "'fedavg'" in refused["hospital-00"]


def test_the_server_cannot_override_the_policy(tmp_path, monkeypatch):
    """Keys a message might carry to loosen it (a policy file, k, methods) change nothing: the file is the node
    config's, read at the hospital."""
    original = FedAvgStrategy.hospital_config

    def loosened(self, server_round):
        return {**original(self, server_round), "policy-file": "", "min-samples": 1, "methods": "fedavg",
                "node-config.policy-file": ""}

    monkeypatch.setattr(FedAvgStrategy, "hospital_config", loosened)
    _, history = federation(tmp_path, 'methods = ["fedprox"]\n')
    assert sorted(history[0]["refused"]) == ["hospital-00", "hospital-01"]


def test_a_hospital_with_fewer_than_k_samples_refuses_to_train(tmp_path):
    _, history = federation(tmp_path, "min-samples = 1000\n")
    assert "fewer training samples than min-samples=1000" in history[0]["refused"]["hospital-00"]


def test_rounds_per_run_are_limited_and_counted_across_restarts(tmp_path):
    strategy, history = federation(tmp_path, "max-rounds-per-run = 1\n", rounds=2)
    assert history[0]["aggregated"] == ["hospital-00", "hospital-01"]
    assert "max-rounds-per-run=1" in history[1]["refused"]["hospital-00"]
    ledger = PrivacyLedger(tmp_path / "state" / "hospital-00")  # the hospital's own folder: survives restarts
    assert ledger.trainings_in("t") == 1


def test_local_dp_is_refused_for_a_method_whose_reply_is_not_the_model(tmp_path):
    _, history = federation(tmp_path, DP, strategy=FedProtoStrategy)
    assert "local-dp" in history[0]["refused"]["hospital-00"] and "FedProto" in history[0]["refused"]["hospital-00"]


def test_the_privacy_budget_stops_training_with_its_reason_and_survives_a_restart(tmp_path):
    z = effective_noise_multiplier("fedavg", 1.0)
    one, two = epsilon_of([z], 1e-5), epsilon_of([z, z], 1e-5)
    budget = f"max-epsilon = {(one + two) / 2}\n"
    _, history = federation(tmp_path, DP + budget, rounds=2)
    assert history[0]["aggregated"] == ["hospital-00", "hospital-01"]
    reason = history[1]["refused"]["hospital-00"]
    assert "privacy budget spent" in reason and f"{one:.3g}" in reason
    ledger = PrivacyLedger(tmp_path / "state" / "hospital-00")
    assert ledger.epsilon(1e-5) == pytest.approx(one)
    # a new run on the same hospital (a restart, a new process) is refused too: the ledger is in its state folder
    _, again = federation(tmp_path, DP + budget, rounds=1, **{"run-name": "t2"})
    assert "privacy budget spent" in again[0]["refused"]["hospital-01"]


def test_epsilon_is_the_maintained_accountants(tmp_path):
    from dp_accounting import GaussianDpEvent, rdp

    accountant = rdp.RdpAccountant()
    accountant.compose(GaussianDpEvent(0.5), 3)
    assert epsilon_of([0.5] * 3, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5))
    assert effective_noise_multiplier("fedavg", 1.0) == 0.5  # the clipped update moves by 2C when a sample changes
    assert effective_noise_multiplier("fedproin", 1.0) < 0.5  # its noised influence counts cost a little more
    assert epsilon_of([0.5, None], 1e-5) == math.inf  # a round without noise: no finite guarantee
    assert epsilon_of([], 1e-5) == 0.0


# --- what a reply carries --------------------------------------------------------------------------------------
def in_process(tmp_path, method: str, policy: str, **extra):
    """A hospital's method, its round-1 payload and an enforcer of ``policy`` (no Flower)."""
    cfg = load_job_config({**SMALL_CLASSIFICATION, "run-name": "t", "strategy": method, **extra})
    site = simulated_sites(cfg, 2)[0]
    engine = RoundEngine(cfg)
    hospital = hospital_class(method)(cfg, site)
    payload = engine.downlink(1, hospital.info())
    parsed, digest = read_policy(policy_file(tmp_path, policy))
    notes = []
    enforcer = Enforcer(parsed, PrivacyLedger(None), "policy.toml", digest,
                        lambda event, **fields: notes.append(fields))
    return hospital, payload, enforcer, notes


def test_fedproin_sends_no_count_or_prototype_of_fewer_than_k_samples(tmp_path):
    hospital, payload, enforcer, notes = in_process(tmp_path, "fedproin", "min-samples = 12\n",
                                                    **{"fedproin.num-prototypes": 3})
    raw = hospital.timed_train(1, payload)  # the same training without the policy
    counts = np.asarray(raw.metrics["influence"]).reshape(payload.arrays["model"]["prototypes"].shape[:2])
    assert ((counts > 0) & (counts < 12)).any() and (counts >= 12).any()  # the case this test is about
    reply = enforcer.train(hospital, 1, payload, "t", {})
    sent = np.asarray(reply.metrics["influence"]).reshape(counts.shape)
    assert ((sent == 0) | (sent >= 12)).all()
    np.testing.assert_array_equal(sent, np.where(counts < 12, 0, counts))
    small = counts < 12
    np.testing.assert_array_equal(reply.arrays["model"]["prototypes"][small],
                                  payload.arrays["model"]["prototypes"][small])
    kept = reply.arrays["model"]["prototypes"][~small]
    assert not np.array_equal(kept, payload.arrays["model"]["prototypes"][~small])
    assert any(n.get("decision") == "min-samples" for n in notes)


def test_fedproto_sends_no_class_mean_of_fewer_than_k_samples(tmp_path):
    hospital, payload, enforcer, _ = in_process(tmp_path, "fedproto", "min-samples = 12\n")
    per_class = np.bincount(hospital.site.train.labels, minlength=len(payload.arrays["prototypes"]["mean"]))
    assert (per_class < 12).any() and (per_class >= 12).any()
    reply = enforcer.train(hospital, 1, payload, "t", {})
    group = reply.arrays["prototypes"]
    assert (group["count"][per_class < 12] == 0).all() and (group["count"][per_class >= 12] > 0).all()
    np.testing.assert_array_equal(group["mean"][per_class < 12], payload.arrays["prototypes"]["mean"][per_class < 12])


def test_local_dp_clips_the_update_and_adds_noise_the_server_cannot_reproduce(tmp_path):
    hospital, payload, enforcer, notes = in_process(tmp_path, "fedavg", DP.replace("1.0", "1e-6"))
    received = payload.arrays["model"]
    reply = enforcer.train(hospital, 1, payload, "t", {})
    update = np.sqrt(sum(float(np.sum((reply.arrays["model"][k].astype(np.float64) - v) ** 2))
                         for k, v in received.items()))
    assert update == pytest.approx(0.5, rel=1e-3)  # clipped to C (the noise is negligible at this sigma)
    assert set(reply.metrics) <= {"num-examples", "server-round", "hospital-seconds", "state-from-round"}
    assert [n["decision"] for n in notes] == ["local-dp", "metrics-withheld", "epsilon"]
    trained = {k: v + 0.01 for k, v in received.items()}
    a, _ = clip_and_noise(received, trained, 0.5, 1.0, np.random.default_rng(1))
    b, _ = clip_and_noise(received, trained, 0.5, 1.0, np.random.default_rng(2))
    name = next(iter(received))
    assert np.std(a[name] - b[name]) == pytest.approx(0.5 * np.sqrt(2), rel=0.2)  # sigma * C per coordinate


def test_local_dp_keeps_batchnorm_variances_positive():
    received = {"bn.running_var": np.ones(1000, np.float32), "w": np.zeros(1000, np.float32)}
    noised, _ = clip_and_noise(received, received, 1.0, 5.0, np.random.default_rng(0))
    assert noised["bn.running_var"].min() > 0 and noised["w"].min() < 0
    with pytest.raises(PolicyRefusal, match="cannot be bounded"):
        clip_and_noise(received, {"other": np.zeros(3, np.float32)}, 1.0, 1.0, np.random.default_rng(0))


def test_fedbn_under_local_dp_sends_the_initial_normalisation_layers(tmp_path):
    hospital, payload, enforcer, _ = in_process(tmp_path, "fedbn", DP, model="resnet18", **{"resnet-width": 0.25})
    reply = enforcer.train(hospital, 1, payload, "t", {})
    from strategies.fedbn.norm_layers import NORM_GROUP

    own = hospital.timed_train(2, payload).arrays[NORM_GROUP]
    sent = reply.arrays[NORM_GROUP]
    assert set(sent) == set(own)
    assert all(np.all(sent[k] == (1 if k.endswith("running_var") else sent[k])) for k in sent)
    assert any(not np.array_equal(sent[k], own[k]) for k in sent)


def test_an_evaluation_is_refused_when_no_metrics_may_leave(tmp_path):
    strategy, history = federation(tmp_path, 'release-metrics = "none"\n' + DP, rounds=1,
                            **{"cross-site-evaluation": True})
    assert history[0]["aggregated"]  # training goes on under local DP
    assert "release-metrics='none'" in strategy.cross_site["failed"]["hospital-00"]
    log = (tmp_path / "state" / "hospital-00" / "audit.jsonl").read_text()
    assert "release-metrics='none'" in log


def test_every_decision_is_in_the_hospitals_audit_log(tmp_path):
    from common.trust.audit import verify

    federation(tmp_path, 'methods = ["fedprox"]\n')
    path = tmp_path / "state" / "hospital-00" / "audit.jsonl"
    assert verify(path).ok
    records = [json.loads(line) for line in path.read_text().splitlines()]
    refusal = next(r for r in records if r["event"] == "policy")
    assert refusal["decision"] == "refused" and len(refusal["policy-sha256"]) == 64
    sent = next(r for r in records if r["event"] == "message" and r["direction"] == "sent" and r["kind"] == "train")
    assert "refused by its policy" in sent["error"]


# --- a policy a hostile coordinator cannot talk around (issue 40) ------------------------------------------------
def test_a_round_sent_again_counts_again(tmp_path, monkeypatch):
    """The server repeats round 1: each training counts against max-rounds-per-run, whatever its round number."""
    original = FedAvgStrategy.hospital_config
    monkeypatch.setattr(FedAvgStrategy, "hospital_config",
                        lambda self, server_round: {**original(self, server_round), "server-round": 1})
    _, history = federation(tmp_path, "max-rounds-per-run = 1\n", rounds=3)
    assert "max-rounds-per-run=1" in history[1]["refused"]["hospital-00"]
    assert "max-rounds-per-run=1" in history[2]["refused"]["hospital-01"]
    assert PrivacyLedger(tmp_path / "state" / "hospital-00").trainings_in("t") == 1


def test_a_new_run_name_does_not_start_the_daily_count_afresh(tmp_path):
    federation(tmp_path, "max-trainings-per-day = 2\n", rounds=1, **{"run-name": "first"})
    _, history = federation(tmp_path, "max-trainings-per-day = 2\n", rounds=2, **{"run-name": "second"})
    assert history[0]["aggregated"] == ["hospital-00", "hospital-01"]
    assert "max-trainings-per-day=2" in history[1]["refused"]["hospital-00"]


@pytest.mark.parametrize("tamper", ["delete", "roll back", "edit"])
def test_a_deleted_or_rolled_back_ledger_stops_training_until_an_operator_restores_it(tmp_path, tamper):
    from common.trust.ledger import LEDGER_FILE, rebuild_ledger

    federation(tmp_path, DP, rounds=2, **{"run-name": "first"})
    folder = tmp_path / "state" / "hospital-00"
    ledger = folder / LEDGER_FILE
    spent = PrivacyLedger(folder).epsilon(1e-5)
    entries = json.loads(ledger.read_text())["releases"]
    assert len(entries) == 2 and spent > 0
    if tamper == "delete":
        ledger.unlink()
    elif tamper == "roll back":
        ledger.write_text(json.dumps({"releases": entries[:1]}))
    else:
        entries[1]["noise-multiplier"] = 1e6  # a round that spent almost nothing
        ledger.write_text(json.dumps({"releases": entries}))
    _, history = federation(tmp_path, DP, rounds=1, **{"run-name": "second"})
    reason = history[0]["refused"]["hospital-00"]
    assert "privacy ledger" in reason and "audit log" in reason and "rebuild-ledger" in reason
    assert history[0]["aggregated"] == ["hospital-01"]  # the untouched hospital trains on
    assert rebuild_ledger(folder / "audit.jsonl", folder) == 2  # the operator acts: the ledger from the log
    assert PrivacyLedger(folder).epsilon(1e-5) == pytest.approx(spent)
    _, history = federation(tmp_path, DP, rounds=1, **{"run-name": "third"})
    assert "hospital-00" in history[0]["aggregated"]


def test_a_policy_counted_from_its_ledger_needs_the_audit_log(tmp_path):
    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    nodes = simulated_hospitals(config, 2, **{"policy-file": policy_file(tmp_path, DP), "audit-log": "none"})
    strategy = FedAvgStrategy(min_train_nodes=1, min_available_nodes=2, run_config=config)
    with pytest.raises(ConfigError, match="audit-log='none' cannot be used"):  # before round 1
        strategy.start(FakeGrid(nodes), num_rounds=1)


def test_yaml_policies_are_read_as_yaml(tmp_path):
    yaml_text = "methods: [fedavg]\nmin-samples: 5\nlocal-dp:\n  clip-norm: 0.5\n  noise-multiplier: 1.0\n"
    parsed, _ = read_policy(policy_file(tmp_path, yaml_text, "policy.yaml"))
    assert parsed.methods == ["fedavg"] and parsed.min_samples == 5 and parsed.local_dp.clip_norm == 0.5
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_policy(policy_file(tmp_path, "methods: [fedavg\n", "policy.yml"))
    with pytest.raises(ConfigError, match="not valid YAML"):  # no YAML tag builds an object or calls anything
        read_policy(policy_file(tmp_path, "methods: !!python/object/apply:os.system ['touch x']\n", "policy.yaml"))
    assert not (tmp_path / "x").exists()


def test_fedproin_influence_counts_have_the_sensitivity_the_accounting_assumes(tmp_path):
    """Under local DP FedProIn counts with the model it received: one training image replaced by another moves
    the counts by at most L2 sqrt(2), in every try (with the trained model it moved them by 2)."""
    hospital, payload, _, _ = in_process(tmp_path, "fedproin", "min-samples = 1\n", model="resnet18",
                                         **{"resnet-width": 0.25, "fedproin.num-prototypes": 3,
                                            "fedproin.prototype-init": "class-means"})
    images, labels = hospital.site.train.images, hospital.site.train.labels

    def largest_move(bounded: bool) -> float:
        hospital.privacy_bounded = bounded
        moved = []
        for attempt in range(4):
            before = np.asarray(hospital.timed_train(1, payload).metrics["influence"], np.float64)
            rng = np.random.default_rng(attempt)
            index, donor = rng.integers(len(labels), size=2)
            saved = images[index].copy(), labels[index]
            images[index], labels[index] = images[donor] + rng.normal(0, 0.2, images[donor].shape), labels[donor]
            after = np.asarray(hospital.timed_train(1, payload).metrics["influence"], np.float64)
            images[index], labels[index] = saved
            moved.append(np.linalg.norm(after - before))
        return max(moved)

    assert largest_move(bounded=True) <= math.sqrt(2) + 1e-9
    assert largest_move(bounded=False) > math.sqrt(2)  # the paper's counts, with the trained model, move more


@pytest.mark.parametrize("release", ["all", "validation", "none"])
def test_timing_and_the_device_leave_only_when_every_metric_may(tmp_path, release):
    """What a reply says of the hospital's machine follows release-metrics, as under secure aggregation."""
    hospital, payload, enforcer, _ = in_process(tmp_path, "fedavg", f'release-metrics = "{release}"\n')
    reply = enforcer.train(hospital, 1, payload, "t", {})
    assert ("hospital-seconds" in reply.metrics) is (release == "all")
    assert ("device" in reply.config) is (release == "all")
    assert any(k.startswith("val-") for k in reply.metrics) is (release != "none")
    assert {"num-examples", "server-round"} <= set(reply.metrics)
