"""Bookkeeping of the FedMEPD and overhead benchmarks: the generated preset gives every hospital kind cases of its
own and unseen test cases, and a py-spy profile is attributed to the process each sample was taken in."""

from __future__ import annotations

from common.config import load_job_config
from common.data.brain_sources import hospital_cases, simulation_split


def test_generated_fedmepd_preset_gives_the_papers_8_hospital_kinds_three_cases_each_and_unseen_test_cases():
    from benchmarks.fedmepd.run import DEFAULT_METHODS, HOSPITALS, METHODS, PRESETS, PROTOCOL

    cfg = load_job_config({**PROTOCOL, **PRESETS["generated-cpu"], "strategy": "fedmepd", "seed": 1})
    split = simulation_split(cfg)
    hospitals = HOSPITALS["generated-cpu"]
    shares = [hospital_cases(cfg, i, hospitals) for i in range(hospitals)]
    assert (len(split.test), len(split.server), [len(s) for s in shares]) == (8, 4, [3] * 8)
    every = [c for s in shares for c in s] + list(split.test) + list(split.server)
    assert len(every) == len(set(every)) == 36  # nobody is scored on a case anyone trained on
    assert len(cfg.brain.hospital_modalities.split(";")) == hospitals
    assert METHODS["FedMEPD without LACCA"][1] == {"strategy": "fedmepd", "fedmepd.lacca": False}
    assert DEFAULT_METHODS["generated-cpu"] == list(METHODS)


def test_profile_samples_count_for_the_innermost_process_of_each_stack(tmp_path):
    from benchmarks.overhead.profile import summarise_profile

    raw = tmp_path / "profile.txt"
    raw.write_text(
        'process 1:"python flwr-simulation --x";run (flwr/vce_api.py:10);get_message_ins (flwr/state.py:5) 30\n'
        'process 1:"python flwr-simulation --x";process 2:"raylet --y";process 3:"ray::ClientAppActor";'
        'train (client_app/hospital.py:3);fit (common/tasks/base.py:7);conv (torch/conv.py:9) 60\n'
        'process 1:"python flwr-simulation --x";process 2:"raylet --y";process 3:"ray::ClientAppActor";'
        'train (client_app/hospital.py:3);evaluate (common/tasks/base.py:20) 10\n')
    summary = summarise_profile(raw)
    kinds = {p["process"]: p for p in summary["processes"]}
    assert summary["samples"] == 100 and set(kinds) == {"ray actor", "simulation"}
    assert kinds["ray actor"]["share"] == 0.7 and kinds["simulation"]["share"] == 0.3
    on_stack = dict(kinds["ray actor"]["top"])  # hospital.train is on every stack: left out
    assert on_stack == {"base.fit": 60 / 70, "conv.conv": 60 / 70, "base.evaluate": 10 / 70}
    assert kinds["ray actor"]["self"][0] == ("conv.conv", 60 / 70)
