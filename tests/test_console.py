"""``fedmed console`` (console/): what each view reads from the files a federation wrote, and the page that shows it.

The files come from a real federation in this process (fedmed's strategy and the hospitals' own ClientApp handlers
over a FakeGrid): three hospitals under secure aggregation, two with a local-DP policy whose budget runs out in
round 3, one whose policy allows one training per run. Each test checks the view against the files themselves (the
audit lines, the ledger, metrics.jsonl), and the damaged cases on copies: a tampered audit log, a missing ledger, a
log rewritten and rechained, a run still going.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from cli.main import main as fedmed
from console.app import CSP, Sources, create_app
from console.charts import Series, line_chart, nice_ticks
from console.coordinator_view import read_run, round_row, run_folders, trackers_of
from console.hospital_view import audit_chain, hospital_folders, read_hospital, refusal_words
from server_app.results import best_round, read_history, write_results, write_status

pytest.importorskip("dp_accounting")  # the hospitals' local DP (the privacy extra)

DP_POLICY = ('methods = ["fedavg"]\nmax-rounds-per-run = 5\n'
             "[local-dp]\nclip-norm = 0.5\nnoise-multiplier = 1.0\ndelta = 1e-5\nmax-epsilon = 20.0\n")
STRICT_POLICY = 'methods = ["fedavg"]\nmax-rounds-per-run = 1\nrelease-metrics = "validation"\n'


def secure_dp_federation(root: Path, rounds: int = 3, run: str = "t") -> Path:
    """A run ``run`` of three hospitals under secure aggregation: hospital-00 and -01 under DP_POLICY (its budget
    refuses round 3), hospital-02 under STRICT_POLICY (refuses from round 2). ``root``: state/, results/, policies."""
    from strategies import FedAvgStrategy

    from .fake_grid import FakeGrid, hospital_node
    from .test_strategies import SMALL_CLASSIFICATION

    (root / "dp.toml").write_text(DP_POLICY)
    (root / "strict.toml").write_text(STRICT_POLICY)
    config = {**SMALL_CLASSIFICATION, "run-name": run, "state-dir": str(root / "state"),
              "results-dir": str(root / "results"), "strategy": "fedavg", "secure-aggregation.enabled": True}
    nodes = {}
    for pid in range(3):
        policy = root / ("strict.toml" if pid == 2 else "dp.toml")
        nodes[101 + pid] = hospital_node(config, {"partition-id": pid, "num-partitions": 3,
                                                  "policy-file": str(policy)}, 101 + pid)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        strategy = FedAvgStrategy(min_train_nodes=2, run_config=config)
        strategy.start(FakeGrid(nodes), num_rounds=rounds)
    finally:
        torch.set_num_threads(threads)
    write_results(strategy.job.run_dir, strategy.job.to_flat(), strategy.engine.history, plots=False)
    write_status(strategy.job.run_dir, "completed", strategy.engine.history, rounds)
    return root


@pytest.fixture(scope="module")
def federation(tmp_path_factory) -> Path:
    return secure_dp_federation(tmp_path_factory.mktemp("federation"))


@pytest.fixture
def copy(federation, tmp_path) -> Path:
    """A copy of the federation's files to damage."""
    shutil.copytree(federation, tmp_path / "f")
    return tmp_path / "f"


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def sources(root: Path, **extra) -> Sources:
    return Sources(state=root / "state", results=root / "results",
                   policies=(("hospital-00", root / "dp.toml"), ("hospital-01", root / "dp.toml"),
                             ("hospital-02", root / "strict.toml")), **extra)


# --- the hospital's view ---------------------------------------------------------------------------------------------
def test_the_hospital_view_holds_what_its_files_hold(federation):
    folder = federation / "state" / "hospital-00"
    view = read_hospital(folder, policy_file=federation / "dp.toml",
                         server_logs={"t": federation / "results" / "t" / "audit.jsonl"})
    log = lines(folder / "audit.jsonl")
    assert view.name == "hospital-00" and view.chain.ok and view.chain.headline == "Chain intact"
    assert str(len(log)) in view.chain.detail and log[-1]["hash"] in view.chain.detail
    assert [c.ok for c in view.peer_checks] == [True, True]  # both ways: verify --peer
    # epsilon: one point per ledger entry, each what the hospital wrote in its audit log after that training
    ledger = json.loads((folder / "privacy-ledger.json").read_text())["releases"]
    logged = [r["epsilon"] for r in log if r.get("decision") == "epsilon"]
    assert [(t.run, t.round) for t in view.privacy.trainings] == [(r["run"], r["round"]) for r in ledger]
    assert [t.epsilon_after for t in view.privacy.trainings] == pytest.approx(logged)
    assert view.privacy.epsilon == pytest.approx(logged[-1]) and view.privacy.max_epsilon == 20.0
    assert view.privacy.left == pytest.approx(20.0 - logged[-1]) and view.privacy.ledger_ok
    assert [(d.trainings, d.epsilon_after) for d in view.privacy.days] == [(2, pytest.approx(logged[-1]))]
    # the run, round by round: bytes, masked, the metrics that left and those withheld, the refusal
    (run,) = view.runs
    sent = [r for r in log if r.get("event") == "message" and r["direction"] == "sent"]
    assert run.name == "t" and run.bytes_out == sum(r["bytes"] for r in sent) and run.trainings == 2
    assert run.limit == 5 and run.epsilon == pytest.approx(logged[-1])
    assert [r.round for r in run.rounds] == [0, 1, 2, 3]  # 0: the identity query before round 1
    rounds = {r.round: r for r in run.rounds}
    assert [rounds[n].trained for n in (0, 1, 2, 3)] == [False, True, True, False]
    assert [rounds[n].masked for n in (1, 2)] == [True, True]
    masked = next(r for r in sent if r.get("stage") == "collect_masked_vectors")
    assert masked["masked"] is True and rounds[1].released == sorted(masked["metrics"])
    assert "train-loss" in rounds[1].withheld and "train-loss" not in rounds[1].released
    for number, at in rounds.items():  # every message of the round, the end-of-run query included
        assert at.sent_bytes == sum(r["bytes"] for r in sent if r["round"] == number)
    (refusal,) = view.refusals
    assert refusal.round == 3 and refusal.by_policy and refusal.reason.startswith("refused by its policy (dp.toml)")
    assert "privacy budget spent" in rounds[3].refused and "[audit-head" not in refusal.reason
    # the secure-aggregation memory and the policy
    memory = lines(folder / "secure-aggregation.jsonl")
    assert len(view.memory.rounds) == len([e for e in memory if e["memory"] == "rounds"]) == 2  # round 3 refused
    assert [r["revealed"] for r in view.memory.rounds] == [True, True]  # before it added: claimed at collect
    rows = dict(view.policy.rows[1:])
    assert rows["max-rounds-per-run"] == "5" and rows["methods"] == "fedavg" and "clip-norm" in rows["local-dp"]
    assert view.policy.matches_log is True


def test_the_strict_hospital_released_its_validation_metrics_and_no_epsilon(federation):
    view = read_hospital(federation / "state" / "hospital-02", policy_file=federation / "strict.toml")
    (run,) = view.runs
    assert run.rounds[1].released == ["num-examples", "server-round", "val-accuracy", "val-loss"]
    assert run.limit == 1 and run.trainings == 1 and len(view.refusals) == 2
    assert all("max-rounds-per-run=1" in r.reason for r in view.refusals)
    assert view.privacy.delta is None and view.privacy.max_epsilon is None  # no local DP: no budget to show
    assert math.isinf(view.privacy.trainings[0].epsilon_after)  # a release without noise: no guarantee
    assert view.privacy.max_per_day == 0


def test_a_tampered_audit_log_is_broken_at_its_first_bad_line(copy):
    log = copy / "state" / "hospital-00" / "audit.jsonl"
    text = log.read_text().splitlines(keepends=True)
    record = json.loads(text[4])
    record["bytes"] += 1  # line 5 says less left than did
    text[4] = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
    log.write_text("".join(text))
    view = read_hospital(log.parent)
    assert not view.chain.ok and view.chain.first_bad_line == 5
    assert view.chain.headline == "BROKEN at line 5" and "edited" in view.chain.detail
    assert not view.privacy.ledger_ok and "does not verify" in view.privacy.ledger_state
    assert any(not m.verified and m.line == 5 for m in view.runs[0].messages)
    assert audit_chain(log).problems == view.chain.problems


def test_a_missing_ledger_is_named_and_epsilon_is_counted_from_the_log(copy, federation):
    folder = copy / "state" / "hospital-01"
    (folder / "privacy-ledger.json").unlink()
    view = read_hospital(folder, policy_file=copy / "dp.toml")
    whole = read_hospital(federation / "state" / "hospital-01", policy_file=federation / "dp.toml")
    assert not view.privacy.ledger_ok and view.privacy.ledger_state.startswith("missing")
    assert "rebuild-ledger" in view.privacy.ledger_state and view.privacy.source == "audit log"
    assert [t.epsilon_after for t in view.privacy.trainings] == pytest.approx(
        [t.epsilon_after for t in whole.privacy.trainings])


def test_a_log_rewritten_and_rechained_passes_alone_and_fails_against_the_servers(copy):
    from .test_audit import rechained

    log = copy / "state" / "hospital-00" / "audit.jsonl"
    kept = [r for r in lines(log) if "privacy budget spent" not in json.dumps(r)]  # the refusal removed
    log.write_bytes(rechained(kept))
    view = read_hospital(log.parent, server_logs={"t": copy / "results" / "t" / "audit.jsonl"})
    assert view.chain.ok and not view.refusals
    mine, theirs = view.peer_checks
    assert not mine.ok and mine.headline.startswith("BROKEN") and "no line of" in mine.detail
    assert theirs.ok


def test_a_state_folder_without_an_audit_log_says_so(tmp_path):
    folder = tmp_path / "h"
    folder.mkdir()
    (folder / "privacy-ledger.json").write_text('{"releases": [{"run": "r", "round": 1, "method": "fedavg", '
                                                '"noise-multiplier": null, "time": "2026-01-01T00:00:00Z"}]}')
    view = read_hospital(folder)
    assert view.chain.headline == "Missing" and "no audit log" in view.problems[0]
    assert [t.run for t in view.privacy.trainings] == ["r"] and math.isinf(view.privacy.trainings[0].epsilon_after)
    (folder / "secure-aggregation.jsonl").write_text("{not json\n")
    assert "cannot be read" in read_hospital(folder).memory.state


def test_hospital_folders_are_found_inside_the_folder_given_only(federation):
    found = hospital_folders(federation / "state")
    assert sorted(found) == ["hospital-00", "hospital-01", "hospital-02"]
    assert all(folder.parent == federation / "state" for folder in found.values())
    assert hospital_folders(federation / "state" / "hospital-01") == {
        "hospital-01": federation / "state" / "hospital-01"}


def test_refusal_words_drop_who_said_it_and_the_audit_head():
    reason = ("hospital reported an error: hospital partition 2: PolicyRefusal: refused by its policy (p.toml): it "
              "has trained 1 times [audit-head " + "a" * 64 + "]")
    assert refusal_words(reason) == "refused by its policy (p.toml): it has trained 1 times"
    assert refusal_words("hospital h: ValueError: bad") == "ValueError: bad"


# --- the coordinator's view ------------------------------------------------------------------------------------------
def test_the_run_view_holds_what_metrics_jsonl_holds(federation):
    folder = federation / "results" / "t"
    view = read_run(folder)
    history = read_history(folder)
    assert view.status == "completed" and not view.live and view.secure and view.chain.ok
    assert [r.round for r in view.rounds] == [1, 2, 3]
    for row, record in zip(view.rounds, history):
        assert row.asked == record["chosen"] and row.aggregated == record["aggregated"]
        assert sorted(row.refused) == sorted(record["refused"]) and row.bytes_up == record["bytes_up"]
        assert row.bytes_down == record["bytes_down"]
    assert [len(r.refused) for r in view.rounds] == [0, 1, 3] and view.rounds[2].skipped
    assert view.rounds[1].refused["hospital-02"].startswith("refused by its policy (strict.toml)")
    found = best_round(history, "max:test.accuracy")
    assert (view.best.round, view.best.value) == found and view.best.metric == "max:test.accuracy"
    assert view.curves["accuracy"] == [(r["round"], r["test"]["accuracy"]) for r in history]


def test_a_run_still_going_is_live_and_a_cut_record_is_named(copy):
    folder = copy / "results" / "t"
    history = read_history(folder)
    write_status(folder, "running", history[:2], 3)  # this process: alive
    with (folder / "metrics.jsonl").open("a") as handle:
        handle.write('{"round": 4, "chosen": ["hosp')  # a round record being written
    view = read_run(folder)
    assert view.status == "running" and view.live
    assert [r.round for r in view.rounds] == [1, 2, 3]
    assert any("line 4 is not JSON" in p for p in view.problems)
    page = TestClient(create_app(Sources(results=copy / "results"))).get("/runs/t").text
    assert 'http-equiv="refresh"' in page and "line 4 is not JSON" in page


def test_cross_site_table_and_tracker_links_come_from_the_run_folder(copy):
    from server_app.evaluation import write_cross_site

    folder = copy / "results" / "t"
    record = {"after-round": 3, "scores": {"hospital-00": {"global": {"accuracy": 0.5}},
                                           "hospital-01": {"global": {"accuracy": 0.75}}},
              "failed": {"hospital-02": "refused"}, "missing": []}
    write_cross_site(folder, record, "classification")
    (folder / "tensorboard").mkdir()
    run_id = "0123abcd"
    (folder / "mlruns" / "42" / run_id).mkdir(parents=True)
    (folder / "tracking.json").write_text(json.dumps({"mlflow": {"uri": f"file://{folder / 'mlruns'}",
                                                                 "run-id": run_id, "last-round": 3}}))
    view = read_run(folder)
    assert view.cross_site.models == ["global"] and view.cross_site.failed == {"hospital-02": "refused"}
    assert view.cross_site.rows == [("hospital-00", [0.5]), ("hospital-01", [0.75])]
    board, mlflow = view.trackers
    assert board.command == f"tensorboard --logdir {folder / 'tensorboard'}"
    assert mlflow.href.endswith(f"/#/experiments/42/runs/{run_id}") and "MLFLOW_ALLOW_FILE_STORE" in mlflow.command
    (folder / "tracking.json").write_text(json.dumps({"mlflow": {"uri": "http://mlflow.site:5000", "run-id": "x"}}))
    assert trackers_of(folder, {"tracking": "mlflow"})[-1].href == "http://mlflow.site:5000/"


def test_a_round_record_reads_answered_as_asked_less_missing():
    row = round_row({"round": 2, "chosen": ["a", "b", "c"], "missing": ["c"], "refused": {"b": "no [audit-head x]"},
                     "aggregated": ["a"], "bytes_up": 10, "bytes_down": 20})
    assert row.answered == ["a", "b"] and row.refused == {"b": "no"} and row.bytes_down == 20


def test_run_folders_are_found_inside_the_folder_given_only(federation):
    assert run_folders(federation / "results") == {"t": federation / "results" / "t"}
    assert run_folders(federation / "results" / "t") == {"t": federation / "results" / "t"}


# --- the page --------------------------------------------------------------------------------------------------------
def tree(root: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_pages_show_the_files_numbers_and_write_nothing(federation):
    before = tree(federation)
    client = TestClient(create_app(sources(federation)))
    index = client.get("/")
    assert index.status_code == 200 and index.headers["content-security-policy"] == CSP
    assert all(f"/hospital/hospital-0{i}" in index.text for i in range(3)) and "/runs/t" in index.text
    page = client.get("/hospital/hospital-00")
    logged = [r["epsilon"] for r in lines(federation / "state" / "hospital-00" / "audit.jsonl")
              if r.get("decision") == "epsilon"]
    assert f">{logged[-1]:.2f}<" in page.text and "Chain intact" in page.text
    assert "privacy budget spent" in page.text and "/hospital/hospital-00/run/1" in page.text
    detail = client.get("/hospital/hospital-00/run/1").text  # the run's rounds and messages, one click away
    assert "yes (secure aggregation)" in detail and "privacy budget spent" in detail
    sent = [r for r in lines(federation / "state" / "hospital-00" / "audit.jsonl") if r.get("direction") == "sent"]
    assert f"Flower run {sent[0]['flower-run']}" in detail and f"node {sent[0]['peer-node']}" in detail
    assert "superlink" not in sent[0] and "SuperLink address not recorded" in detail  # no fedmed-supernode here
    assert f'data-y="{logged[0]!r}"' in page.text or f'data-y="{float(logged[0])!r}"' in page.text
    assert 'class="limit" data-limit="20.0"' in page.text
    run = client.get("/runs/t")
    history = read_history(federation / "results" / "t")
    for record in history:
        assert f'data-round="{record["round"]}" data-bytes-up="{record["bytes_up"]}"' in run.text
    assert "hospital-02</b> refused: refused by its policy (strict.toml)" in run.text
    assert client.get("/runs").status_code == 200
    for text in (index.text, page.text, run.text, detail):  # nothing to fetch: no script, no source, no link out
        assert "<script" not in text and " src=" not in text and "<link" not in text
    assert tree(federation) == before  # nothing written, nothing touched


@pytest.mark.parametrize("url", ["/hospital/%2e%2e", "/hospital/..%2f..%2fetc%2fpasswd", "/runs/..%2fstate",
                                 "/runs/%2e%2e%2f%2e%2e%2fetc", "/hospital/nobody", "/runs/t%2f..%2f..%2fdp.toml",
                                 "/hospital/hospital-00%2f..%2f..%2fdp.toml", "/dp.toml",
                                 "/state/hospital-00/audit.jsonl"])
def test_no_url_reaches_outside_the_folders_given(federation, url):
    response = TestClient(create_app(sources(federation))).get(url)
    assert response.status_code == 404
    assert "local-dp" not in response.text and "root:" not in response.text


def test_the_page_of_a_tampered_log_says_broken_at_its_line(copy):
    log = copy / "state" / "hospital-01" / "audit.jsonl"
    text = log.read_text().splitlines(keepends=True)
    del text[6]  # line 7 removed
    log.write_text("".join(text))
    client = TestClient(create_app(sources(copy)))
    page = client.get("/hospital/hospital-01").text
    assert 'data-ok="false" data-first-bad-line="7"' in page and "BROKEN at line 7" in page
    index = client.get("/").text
    assert "BROKEN at line 7" in index


def test_a_live_hospital_log_refreshes_the_page_and_an_old_one_does_not(copy):
    client = TestClient(create_app(sources(copy)))
    assert 'http-equiv="refresh"' in client.get("/hospital/hospital-00").text  # written just now
    old = time.time() - 3600
    for path in (copy / "state" / "hospital-00").iterdir():
        os.utime(path, (old, old))
    assert 'http-equiv="refresh"' not in client.get("/hospital/hospital-00").text


def test_the_token_is_required_when_set(federation):
    token = "s3cret-token-of-the-dpo"
    client = TestClient(create_app(sources(federation), token=token))
    assert client.get("/").status_code == 401
    assert client.get("/", headers={"Authorization": "Bearer wrong-token-wrong"}).status_code == 401
    assert client.get("/", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    first = client.get(f"/hospital/hospital-00?token={token}", follow_redirects=False)
    assert first.status_code == 303 and "token" not in first.headers["location"]
    assert client.get("/hospital/hospital-00").status_code == 200  # the cookie it set
    assert TestClient(create_app(sources(federation), token=token)).get("/?token=nope").status_code == 401


# --- the command -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,named", [
    ([], "--state"),
    (["--state", "/nonexistent/state"], "/nonexistent/state: not a folder"),
    (["--results", "{tmp}/file.txt"], "not a folder"),
    (["--state", "{tmp}", "--policy", "{tmp}/absent.toml"], "absent.toml: cannot be read"),
    (["--state", "{tmp}", "--host", "0.0.0.0"], "--token"),
    (["--state", "{tmp}", "--host", "0.0.0.0", "--token", "short"], "at least 16"),
    (["--state", "{tmp}", "--port", "70000"], "--port"),
    (["--state", "{tmp}", "--bogus"], "unrecognized arguments: --bogus"),
    (["--state", "{tmp}", "--port", "x"], "--port"),
    (["--state", "{tmp}", "--port", "{busy}"], "cannot serve on 127.0.0.1:"),
])
def test_a_bad_argument_is_one_line(tmp_path, capsys, args, named):
    (tmp_path / "file.txt").write_text("x")
    with socket.socket() as busy:  # a port something else serves on
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        words = [a.replace("{tmp}", str(tmp_path)).replace("{busy}", str(busy.getsockname()[1])) for a in args]
        try:
            assert fedmed(["console", *words]) == 2
        except SystemExit as exit:  # argparse's own refusals
            assert exit.code == 2
    err = capsys.readouterr().err
    assert err.startswith("fedmed console: ") and named in err and err.count("\n") == 1 and "Traceback" not in err


def test_policy_options_name_each_hospital():
    from cli.console import policies

    assert policies(["hospital-00=/etc/p.toml", "/etc/all.toml"]) == [("hospital-00", Path("/etc/p.toml")),
                                                                      ("", Path("/etc/all.toml"))]


# --- charts ----------------------------------------------------------------------------------------------------------
def test_ticks_cover_the_values():
    for low, high in [(-0.026, 0.25), (10.7, 20.0), (0.0, 16.5), (3.0, 3.0), (0.0, 1e-6), (-5.0, -1.0)]:
        ticks = nice_ticks(low, high)
        assert ticks[0] <= low and ticks[-1] >= high and ticks == sorted(ticks) and len(ticks) >= 2


def test_a_chart_carries_its_numbers_and_escapes_its_labels():
    svg = line_chart([Series("<b>x</b>", [(1, 0.5), (2, None), (3, 2.25)])], title="t & u", x_label="round",
                     y_label="v", limit=3.0, limit_label="budget")
    assert 'data-x="1" data-y="0.5"' in svg and 'data-x="3" data-y="2.25"' in svg and "data-x=\"2\"" not in svg
    assert "<b>" not in svg and "&lt;b&gt;" in svg and "t &amp; u" in svg and 'data-limit="3.0"' in svg
    assert "nothing recorded yet" in line_chart([Series("a", [])], title="t", x_label="x", y_label="y")
