"""Run and node config validation: every problem named by its key before round 1."""

from __future__ import annotations

import pytest
import tomllib

from client_app.node_config import load_node_config
from common.config import ConfigError, JobConfig, fedmed_keys_of, flatten, load_job_config, one_edit_apart

from .conftest import ROOT


def pyproject_run_config() -> dict:
    with (ROOT / "pyproject.toml").open("rb") as handle:
        return flatten(tomllib.load(handle)["tool"]["flwr"]["app"]["config"])


def test_pyproject_lists_every_key_with_the_model_default():
    # Flower only lets users override keys present in pyproject.toml, so both must agree.
    assert pyproject_run_config() == JobConfig().to_flat()


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="'num-server-round'.*unknown key"):
        load_job_config({"num-server-round": 3})


def test_unknown_nested_key_is_named_with_its_table():
    with pytest.raises(ConfigError, match="'fedprox.nu'"):
        load_job_config({"fedprox.nu": 0.1})


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match="'num-server-rounds'"):
        load_job_config({"num-server-rounds": "five"})
    with pytest.raises(ConfigError, match="'local-epochs'"):
        load_job_config({"local-epochs": 1.5})


def test_impossible_values_are_named():
    with pytest.raises(ConfigError, match="'fraction-train'"):
        load_job_config({"fraction-train": -0.1})  # 0 is Flower's: min-train-hospitals of them
    with pytest.raises(ConfigError, match="'fedprox.mu'"):
        load_job_config({"fedprox.mu": -1.0})


def test_unknown_strategy_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown strategy 'fedfoo'.*fedavg"):
        load_job_config({"strategy": "fedfoo"})


def test_dataset_must_fit_the_task():
    with pytest.raises(ConfigError, match="does not fit task"):
        load_job_config({"task": "polyp-segmentation", "dataset": "ham10000"})


def test_missing_data_directory_is_named(tmp_path):
    with pytest.raises(ConfigError, match="data-dir.*does not exist"):
        load_job_config({"dataset": "ham10000", "data-dir": str(tmp_path / "nowhere")}, check_paths=True)
    with pytest.raises(ConfigError, match="data-dir"):
        load_job_config({"dataset": "ham10000"}, check_paths=True)


def test_valid_overrides_are_typed():
    cfg = load_job_config({"num-server-rounds": 7, "fedprox.mu": 0.1, "strategy": "fedprox"})
    assert cfg.num_server_rounds == 7 and cfg.fedprox.mu == 0.1 and cfg.strategy == "fedprox"


def test_node_config_needs_data_and_names_bad_keys(tmp_path):
    with pytest.raises(ConfigError, match="data-dir.*partition-id"):
        load_node_config({"hospital": "st-olav"})
    with pytest.raises(ConfigError, match="node config of st-olav key 'data-dri'"):
        load_node_config({"hospital": "st-olav", "data-dri": str(tmp_path)})
    with pytest.raises(ConfigError, match="st-olav key 'data-dir'.*does not exist"):
        load_node_config({"hospital": "st-olav", "data-dir": str(tmp_path / "missing")})
    node = load_node_config({"hospital": "st-olav", "data-dir": str(tmp_path), "device": "cpu"})
    assert node.name == "st-olav"
    assert load_node_config({"partition-id": 3, "num-partitions": 5}).name == "hospital-03"


def test_node_config_validated_once_still_checks_its_folders_at_every_read(tmp_path):
    """A hospital reads its node config at every message (validated once per content): a folder it names that is
    gone is refused at the next read, and a value of another type is validated as itself, not as the one seen."""
    data = tmp_path / "data"
    data.mkdir()
    raw = {"hospital": "st-olav", "data-dir": str(data)}
    assert load_node_config(raw) is load_node_config(dict(raw))
    data.rmdir()
    with pytest.raises(ConfigError, match="st-olav key 'data-dir'.*does not exist"):
        load_node_config(raw)
    assert load_node_config({"partition-id": 1, "num-partitions": 2}).partition_id == 1
    with pytest.raises(ConfigError, match="partition-id"):  # strict: True is no partition number, though True == 1
        load_node_config({"partition-id": True, "num-partitions": 2})


def test_a_path_the_file_system_cannot_take_is_named_by_its_key(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ConfigError, match="data-dir: .*loop"):
        load_job_config({"dataset": "npz", "data-dir": str(loop / "x.npz")}, check_paths=True)
    with pytest.raises(ConfigError, match="test-dir: .*(File name too long|does not exist)"):
        load_job_config({"dataset": "npz", "test-dir": "/tmp/" + "a" * 5000}, check_paths=True)


@pytest.mark.parametrize("key", ["mode", "seeds", "lr", "result-file", "rounds", "myapp.seed", "app.models",
                                 "tsak", "threshold", "learning-rate-decay"])
def test_an_apps_own_keys_are_left_to_it(key, caplog):
    with caplog.at_level("INFO", logger="fedmed"):
        ours = fedmed_keys_of({"seed": 3, "fedprox.mu": 0.5, key: "x"})
    assert ours == {"seed": 3, "fedprox.mu": 0.5}  # fedmed's keys, and no other
    assert f"left to the app: {key}" in caplog.text


@pytest.mark.parametrize("key,meant", [
    ("num-server-round", "num-server-rounds"),  # one letter missing
    ("learning_rate", "learning-rate"),  # '_' for '-'
    ("Seed", "seed"),  # case
    ("devise", "device"),  # one letter replaced
    ("stratgey", "strategy"),  # two letters swapped
    ("fedprox.muu", "fedprox.mu"),  # an unknown key in one of our tables
    ("fedproin.num_prototypes", "fedproin.num-prototypes"),
    ("scrrening.max-reply-mb", "screening.max-reply-mb"),  # a table one letter from ours
    ("secure-aggregation.enable", "secure-aggregation.enabled"),
])
def test_a_near_miss_of_a_fedmed_key_is_refused_naming_the_key_meant(key, meant):
    with pytest.raises(ConfigError, match=f"run config key '{key}'.*did you mean '{meant}'"):
        fedmed_keys_of({key: 1})


def test_a_key_in_our_tables_with_nothing_close_lists_the_tables_keys_and_a_table_is_not_a_key():
    with pytest.raises(ConfigError, match="'fedprox.nu'.*table 'fedprox'; did you mean 'fedprox.mu'"):
        fedmed_keys_of({"fedprox.nu": 0.1})
    with pytest.raises(ConfigError, match="'fedproin.zzz'.*its keys are .*num-prototypes"):
        fedmed_keys_of({"fedproin.zzz": 1})
    with pytest.raises(ConfigError, match="'screening' is a table of fedmed's"):
        fedmed_keys_of({"screening": 1})


def test_a_short_near_miss_passes_to_the_app_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="fedmed"):
        assert fedmed_keys_of({"mode": "fast"}) == {}
    assert "'mode' is not fedmed's and is left to the app; if you meant fedmed's 'model'" in caplog.text


@pytest.mark.parametrize("a,b,one", [("model", "mode", True), ("seed", "seeds", True), ("task", "tsak", True),
                                     ("device", "devise", True), ("seed", "seed", False), ("seed", "sede", True),
                                     ("model", "mod", False), ("strategy", "stratgye", False), ("ab", "ba", True),
                                     ("abc", "cba", False)])
def test_one_edit_is_an_insertion_deletion_substitution_or_swap(a, b, one):
    assert one_edit_apart(a, b) is one and one_edit_apart(b, a) is one
