"""A careless user's input to ``fedmed`` is one line on stderr naming the argument or key, and exit status 2, never
a traceback: paths the file system cannot take (a name too long, a symbolic link loop), hospital counts below 1, a
data set that does not fit the run, a run-config value Flower's ``--run-config`` cannot carry. All run in this
process (``cli.main``) with the Flower processes forbidden to start."""

from __future__ import annotations

import shlex

import pytest

from cli import launch
from cli import main as cli
from common.config import load_job_config
from common.data.export import write_site
from common.data.sources import generate
from common.engine.round_engine import RoundEngine
from server_app.checkpoint import save_checkpoint

TINY = {"synthetic-samples": 40, "image-size": 8, "model": "small-cnn", "min-partition-size": 5}
TOO_LONG = "a" * 300  # one path component over the 255 bytes of Linux file systems (ENAMETOOLONG)


@pytest.fixture
def nothing_starts(monkeypatch):
    monkeypatch.setattr(launch, "start_superlink", lambda *a, **k: pytest.fail("nothing may start"))
    monkeypatch.setattr(launch, "start_process", lambda *a, **k: pytest.fail("nothing may start"))


def refused(capsys, argv: list[str]) -> str:
    """Run ``fedmed argv``; it must exit 2 with one line on stderr and no traceback; returns that line."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def symlink_loop(tmp_path):
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    return tmp_path / "loop-a"


def bad_path(tmp_path, kind: str):
    return tmp_path / TOO_LONG if kind == "too-long" else symlink_loop(tmp_path) / "data"


@pytest.mark.parametrize("kind", ["too-long", "symlink-loop"])
@pytest.mark.parametrize("key", ["data-dir", "test-dir", "resume-from", "results-dir", "hospital-keys"])
def test_a_run_config_path_the_file_system_cannot_take_is_refused_naming_the_key(tmp_path, capsys, nothing_starts,
                                                                                 kind, key):
    path = bad_path(tmp_path, kind)
    home = tmp_path / "home"
    err = refused(capsys, ["simulate", "--hospitals", "2", "--home", str(home), "--run-config",
                           f"{key}='{path}' results-dir='{tmp_path / 'results'}'" if key != "results-dir" else
                           f"{key}='{path}'"])
    assert err.startswith(f"fedmed: {key}: ") and "cannot be used as a path" in err
    assert ("too long" if kind == "too-long" else "symbolic link") in err
    assert not home.exists()


@pytest.mark.parametrize("kind", ["too-long", "symlink-loop"])
def test_partition_with_such_a_data_dir_is_refused_naming_the_key(tmp_path, capsys, kind):
    out = tmp_path / "sites"
    err = refused(capsys, ["partition", "--hospitals", "2", "--out", str(out), "--run-config",
                           f"dataset='npz' data-dir='{bad_path(tmp_path, kind)}'"])
    assert "fedmed: data-dir: " in err and not out.exists()


@pytest.mark.parametrize(("argv", "option"), [
    (["simulate", "--hospitals", "2", "--home", "{bad}"], "--home"),
    (["partition", "--hospitals", "2", "--out", "{bad}"], "--out"),
    (["evaluate", "--run", "{bad}", "--data", "{tmp}"], "--run"),
    (["evaluate", "--run", "{tmp}", "--data", "{bad}"], "--data"),
    (["segment", "--model", "{tmp}/m.pt", "--images", "{bad}", "--out", "{tmp}/masks"], "--images"),
])
@pytest.mark.parametrize("kind", ["too-long", "symlink-loop"])
def test_a_command_line_path_the_file_system_cannot_take_is_refused_naming_the_option(tmp_path, capsys,
                                                                                      nothing_starts, argv, option,
                                                                                      kind):
    bad = bad_path(tmp_path, kind)
    err = refused(capsys, [a.format(bad=bad, tmp=tmp_path) for a in argv])
    assert err.startswith(f"fedmed: {option}: ") and "cannot be used as a path" in err


@pytest.mark.parametrize("hospitals", ["0", "-2"])
def test_partition_into_fewer_than_one_hospital_is_refused_and_writes_nothing(tmp_path, capsys, hospitals):
    out = tmp_path / "sites"
    err = refused(capsys, ["partition", "--hospitals", hospitals, "--out", str(out), "--run-config",
                           "synthetic-samples=40 image-size=8"])
    assert f"--hospitals {hospitals}: a partition needs at least 1 hospital" in err
    assert not out.exists()


def test_a_partition_refused_half_way_leaves_no_folder_a_retry_would_find_not_empty(tmp_path, capsys):
    out = tmp_path / "sites"
    err = refused(capsys, ["partition", "--hospitals", "100", "--out", str(out), "--run-config",
                           "synthetic-samples=40 image-size=8"])
    assert "cannot be split across 100 hospitals" in err
    assert not out.exists()  # (the server's test folder was written before the split was refused)


@pytest.mark.parametrize("simulate", ["simulate", "demo"])
def test_simulate_with_fewer_than_one_hospital_is_refused(tmp_path, capsys, nothing_starts, simulate):
    extra = ["--run-config", f"results-dir='{tmp_path}'"] if simulate == "simulate" else []
    err = refused(capsys, [simulate, "--hospitals", "-1", "--home", str(tmp_path / "h"), *extra])
    assert "--hospitals -1" in err


# --- a data set that does not fit the run ------------------------------------------------------------------
@pytest.fixture
def classification_run(tmp_path):
    """A classification run folder with a checkpoint (the initial model: enough for what these tests refuse)."""
    cfg = load_job_config({**TINY, "results-dir": str(tmp_path / "results"), "run-name": "done"})
    save_checkpoint(cfg.run_dir, 1, RoundEngine(cfg).state_dict())
    return cfg


@pytest.fixture
def polyp_folder(tmp_path):
    cfg = load_job_config({"task": "polyp-segmentation", "image-size": 16})
    folder = tmp_path / "polyps"
    write_site(cfg, generate("polyp-segmentation", 6, 16, seed=3), folder, "test")
    return folder


@pytest.mark.parametrize("dataset", ["image-mask", "brats", "synthetic"])
def test_evaluate_with_a_dataset_of_another_task_is_refused_naming_it(tmp_path, capsys, classification_run,
                                                                      polyp_folder, dataset):
    err = refused(capsys, ["evaluate", "--run", str(classification_run.run_dir), "--data", str(polyp_folder),
                           "--dataset", dataset, "--out", str(tmp_path / "scores")])
    assert f"--dataset {dataset!r} does not fit the run's task 'classification'" in err
    assert "'npz'" in err and "'ham10000'" in err
    assert not (tmp_path / "scores.json").exists()


def masks_loader(request):
    """A loader of the user's own that gives segmentation data (for a classification run)."""
    return generate("polyp-segmentation", 6, 16, seed=4)


def test_evaluate_with_an_own_loader_whose_data_does_not_fit_the_task_is_one_line(tmp_path, capsys,
                                                                                    classification_run, polyp_folder):
    err = refused(capsys, ["evaluate", "--run", str(classification_run.run_dir), "--data", str(polyp_folder),
                           "--dataset", f"{__name__}:masks_loader", "--out", str(tmp_path / "scores")])
    assert f"--data {polyp_folder} ({__name__}:masks_loader) does not fit the run" in err


# --- values Flower's --run-config cannot carry -----------------------------------------------------------------
def toml_string(text: str) -> str:
    """``text`` as a TOML basic string, quoted for the shell-like split of --run-config."""
    return shlex.quote('"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"')


@pytest.mark.parametrize("value", ['{"note": "it\'s the apostrophe"}', '{"depth":\n 3}'])
def test_a_run_config_value_flower_cannot_carry_is_refused_naming_the_key(tmp_path, capsys, nothing_starts, value):
    home = tmp_path / "home"
    err = refused(capsys, ["simulate", "--hospitals", "2", "--home", str(home), "--run-config",
                           f"results-dir='{tmp_path}' dataset-args={toml_string(value)}"])
    assert err.startswith("fedmed: --run-config: run config key 'dataset-args': ") and "cannot carry" in err
    assert not home.exists()


def test_a_path_holding_both_quote_kinds_is_refused_naming_the_key(tmp_path, capsys, nothing_starts):
    results = tmp_path / """o'k "here\""""
    err = refused(capsys, ["simulate", "--hospitals", "2", "--home", str(tmp_path / "h"), "--run-config",
                           f"results-dir={toml_string(str(results))}"])
    assert "run config key 'results-dir'" in err and not results.exists()


def test_a_federation_config_value_flower_cannot_carry_is_refused_naming_the_option(tmp_path, capsys,
                                                                                     nothing_starts):
    err = refused(capsys, ["simulate", "--hospitals", "2", "--home", str(tmp_path / "h"), "--run-config",
                           f"results-dir='{tmp_path}'", "--federation-config",
                           f"note={toml_string(chr(39) + chr(34))}"])
    assert err.startswith("fedmed: --federation-config: run config key 'note'")


@pytest.mark.parametrize(("text", "problem"), [("num-server-rounds", "is not key=value"),
                                               ("run-name='unclosed", "cannot be split")])
def test_a_run_config_that_is_not_key_value_is_refused(tmp_path, capsys, nothing_starts, text, problem):
    err = refused(capsys, ["simulate", "--hospitals", "2", "--home", str(tmp_path / "h"), "--run-config", text])
    assert err.startswith("fedmed: --run-config: ") and problem in err
