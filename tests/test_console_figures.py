"""``fedmed console``'s figures against the files, case by case (issue 68): two runs of one deployment (the second
after two hospitals' budgets are spent), the cross-check per run both in the console and in ``fedmed audit verify
--peer``, the budget said as the hospital decides it, refused secure rounds, a skipped round, a run in which nothing
trained, a failed run's reason, a run's messages paged, the log read once per change, the report to file, and the
Host names and cookie of a console served beyond loopback.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from cli.main import main as fedmed
from client_app.api import SUPERLINK_ENV
from common.trust.audit import AuditLog
from common.trust.ledger import EpsilonCounter, releases_epsilon
from console import app as console_app
from console.app import Sources, create_app
from console.coordinator_view import read_run, round_row
from console.hospital_view import LogReader, read_hospital
from server_app.results import best_round, describe_run, read_history, render_runs, summary_table, write_status

from .test_console import lines, secure_dp_federation, sources

pytest.importorskip("dp_accounting")

SUPERLINK = "superlink.consortium.example:9092"  #: the SuperLink the hospitals' SuperNodes were told to reach


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> Path:
    """Run ``t`` (3 rounds: hospital-00 and -01 spend their budget, -02 its one training) and then run ``t2`` on the
    same hospitals (2 rounds) from the same model: every hospital refuses (their replay memories), every round is
    skipped, nothing trains."""
    with pytest.MonkeyPatch.context() as env:  # the address fedmed-supernode gives its ClientApp (--superlink)
        env.setenv(SUPERLINK_ENV, SUPERLINK)
        root = secure_dp_federation(tmp_path_factory.mktemp("two"))
        return secure_dp_federation(root, rounds=2, run="t2")


@pytest.fixture
def copy(two_runs, tmp_path) -> Path:
    shutil.copytree(two_runs, tmp_path / "f")
    return tmp_path / "f"


def server_logs(root: Path) -> dict[str, Path]:
    return {run: root / "results" / run / "audit.jsonl" for run in ("t", "t2")}


# --- the cross-check, per run -----------------------------------------------------------------------------------------
def test_an_untouched_deployment_of_two_runs_reads_intact_both_ways(two_runs, capsys):
    for name in ("hospital-00", "hospital-01", "hospital-02"):
        view = read_hospital(two_runs / "state" / name, server_logs=server_logs(two_runs))
        assert [r.name for r in view.runs] == ["t", "t2"]
        assert len(view.peer_checks) == 4 and all(c.ok for c in view.peer_checks), view.peer_checks
    hospital = two_runs / "state" / "hospital-00" / "audit.jsonl"
    for run, log in server_logs(two_runs).items():  # verify --peer, each way, for each run's server log
        assert fedmed(["audit", "verify", str(hospital), "--peer", str(log), "--name", "hospital-00"]) == 0
        assert fedmed(["audit", "verify", str(log), "--peer", str(hospital), "--name", "server"]) == 0
    client = TestClient(create_app(sources(two_runs)))
    page = client.get("/hospital/hospital-00").text
    assert "BROKEN" not in page and "Chain intact" in page
    assert client.get("/").text.count("consistent, 2 run(s)") == 3


def test_each_run_names_the_policy_in_force_and_whom_it_answered(two_runs):
    import hashlib

    view = read_hospital(two_runs / "state" / "hospital-02", policy_file=two_runs / "strict.toml")
    digest = hashlib.sha256((two_runs / "strict.toml").read_bytes()).hexdigest()
    log = lines(two_runs / "state" / "hospital-02" / "audit.jsonl")
    for run in view.runs:
        recorded = {r["policy-sha256"] for r in log if r.get("run") == run.name and "policy-sha256" in r}
        assert run.policies == [digest] and recorded == {digest}  # its identity reply's line names it
        ids = {r["flower-run"] for r in log if r.get("run") == run.name and r.get("flower-run") is not None}
        assert run.peers.startswith(f"the server (Flower run {', '.join(map(str, sorted(ids)))}")
        assert run.peers.endswith(f"; SuperLink {SUPERLINK})")  # to whom: the address its SuperNode reached
    query = next(r for r in log if r.get("run") == "t2" and r.get("direction") == "sent")  # t2 refused before any
    assert query["kind"] == "query" and query["policy-sha256"] == digest  # policy decision: its start names it
    assert all(r["superlink"] == SUPERLINK for r in log if r["event"] == "message")
    client = TestClient(create_app(sources(two_runs)))
    page = client.get("/hospital/hospital-02").text
    assert page.count(f"{digest[:16]}… (strict.toml)") == 2 and page.count(f"SuperLink {SUPERLINK}") == 2
    detail = client.get("/hospital/hospital-02/run/1").text  # the run's page, and each of its messages
    assert detail.count(f"SuperLink {SUPERLINK}") == 1 + sum(1 for r in log if r.get("run") == "t"
                                                              and r["event"] == "message")


def test_a_server_log_cut_within_a_run_is_named_with_its_run_and_line(copy, capsys):
    log = copy / "results" / "t2" / "audit.jsonl"
    kept = log.read_text().splitlines(keepends=True)
    log.write_text("".join(kept[:len(kept) // 2]))  # the second half of run t2 removed from the server's log
    view = read_hospital(copy / "state" / "hospital-02", server_logs=server_logs(copy))
    assert all(c.ok for c in view.peer_checks if c.what.startswith("run t: "))
    broken = [c for c in view.peer_checks if not c.ok]
    assert broken and all(c.what.startswith("run t2: ") for c in broken)
    overview = TestClient(create_app(sources(copy))).get("/").text  # the overview says so too
    assert overview.count("<div>run t2: BROKEN at") >= 3 and "<div>run t: " not in overview
    hospital_log = copy / "state" / "hospital-02" / "audit.jsonl"
    records = lines(hospital_log)
    first = next(n for n, r in enumerate(records, 1) if r.get("run") == "t2" and r.get("peer-audit-head")
                 and r["peer-audit-head"] not in {x["hash"] for x in lines(log)})
    assert broken[0].problems[0][0] == first and "run 't2'" in broken[0].problems[0][1]
    capsys.readouterr()
    assert fedmed(["audit", "verify", str(log), "--peer", str(hospital_log), "--name", "server"]) == 1
    out = capsys.readouterr().out
    assert f"line {first}: run 't2'" in out


# --- the budget, refusals, secure rounds --------------------------------------------------------------------------
def test_a_spent_budget_reads_spent_with_what_one_more_round_would_make_it(two_runs):
    folder = two_runs / "state" / "hospital-00"
    view = read_hospital(folder, policy_file=two_runs / "dp.toml")
    refusal = next(r for r in view.refusals if "privacy budget spent" in r.reason)
    said = float(refusal.reason.split("would make it ")[1].split(",")[0])  # as the hospital said it
    assert view.privacy.spent and view.privacy.left > 0  # what is left is not enough for one more training
    assert view.privacy.next_epsilon == pytest.approx(said, rel=1e-2) and view.privacy.next_epsilon > 20.0
    page = TestClient(create_app(sources(two_runs))).get("/hospital/hospital-00").text
    assert 'data-spent="true"' in page and f"would make it {view.privacy.next_epsilon:.2f}" in page


def test_secure_rounds_it_refused_are_not_counted_as_taken_part_in(two_runs, tmp_path):
    """A round is claimed where the hospital first adds to it (its collect stage), so the rounds its policy refused
    before training are not in its memory; in a memory written when rounds were claimed at share keys, a round set up
    and then refused is not counted as taken part in."""
    import json

    folder = two_runs / "state" / "hospital-00"
    view = read_hospital(folder)
    memory = [e for e in lines(folder / "secure-aggregation.jsonl") if e["memory"] == "rounds"]
    refused = {(r.run, r.round) for r in view.refusals}
    assert refused and len(view.memory.rounds) == len(memory)
    assert not refused & {(e["run"], e["round"]) for e in memory}
    assert view.memory.taken_part == len(memory) and view.memory.state.startswith(f"{len(memory)} secure round(s)")
    older = tmp_path / "older"
    shutil.copytree(folder, older)
    run, rnd = sorted(refused)[0]
    with open(older / "secure-aggregation.jsonl", "a") as file:
        file.write(json.dumps({"memory": "rounds", "run": run, "round": rnd, "session": "s", "time": "t"}) + "\n")
    view = read_hospital(older)
    assert len(view.memory.rounds) == len(memory) + 1 and view.memory.taken_part == len(memory)
    assert view.memory.state.startswith(f"{len(memory)} secure round(s) taken part in (1 more set up, then refused)")


def test_epsilon_charged_for_a_masked_update_never_unmasked_is_marked(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl", "hospital:h")
    for rnd, stages in ((1, ["setup", "share_keys", "collect_masked_vectors", "unmask"]),
                        (2, ["setup", "share_keys", "collect_masked_vectors"]), (3, ["setup"])):
        for stage in stages:
            log.append("message", direction="received", kind="train", run="r", round=rnd, stage=stage)
            if stage == "collect_masked_vectors":
                log.append("privacy-release", run="r", round=rnd, method="fedavg", **{"noise-multiplier": 1.0})
            log.append("message", direction="sent", kind="train", run="r", round=rnd, stage=stage,
                       masked=stage == "collect_masked_vectors", metrics=[])
    reader = LogReader(tmp_path / "audit.jsonl").read()
    (run,) = reader.site.site_runs()
    assert [(r.round, r.trained, r.never_unmasked) for r in run.rounds] == [(1, True, False), (2, True, True),
                                                                           (3, False, False)]


# --- the coordinator's figures, shared with fedmed runs --------------------------------------------------------------
def test_a_skipped_round_aggregated_nobody_and_names_whom_it_discarded():
    record = {"round": 4, "chosen": ["a", "b"], "aggregated": ["a"], "missing": ["b"], "refused": {},
              "skipped": "1 accepted update(s), fewer than min-train-hospitals=2", "bytes_up": 0, "bytes_down": 0,
              "seconds": 1.0}
    row = round_row(record)
    assert row.aggregated == [] and row.discarded == ["a"]
    assert "| 4 | 0/2 |" in summary_table([record])


def test_a_run_in_which_nothing_trained_has_no_best_round(copy):
    folder = copy / "results" / "t2"
    history = read_history(folder)
    skipped = [r for r in history if r.get("skipped")]
    assert skipped == history  # every round of t2 skipped (its hospitals refused): nothing trained
    assert all(round_row(r).aggregated == [] for r in skipped)
    assert all(r["test"]["accuracy"] is not None for r in history)  # the scores of the model it started from
    assert best_round(history, "max:test.accuracy") is None
    row = describe_run(folder)
    assert row["best"] is None and row["trained-rounds"] == 0 and "no round aggregated" in row["missing"]
    assert read_run(folder).best.round is None and "no model was trained" in read_run(folder).best.note
    untrained = [dict(r, aggregated=["a"], skipped="gave up") for r in read_history(copy / "results" / "t")]
    assert best_round(untrained, "max:test.accuracy") is None  # its test scores are the initial model's


def test_a_failed_runs_reason_is_on_its_page_and_in_fedmed_runs(copy):
    folder = copy / "results" / "t2"
    write_status(folder, "failed", read_history(folder), 2, error="RuntimeError: the <b>SuperLink</b> went away")
    row = describe_run(folder)
    assert row["status"] == "failed" and row["error"] == "RuntimeError: the <b>SuperLink</b> went away"
    assert "- t2: failed: RuntimeError: the <b>SuperLink</b> went away" in render_runs([row])
    client = TestClient(create_app(sources(copy)))
    page = client.get("/runs/t2").text
    assert 'id="run-error"' in page and "the &lt;b&gt;SuperLink&lt;/b&gt; went away" in page
    assert "the &lt;b&gt;SuperLink&lt;/b&gt; went away" in client.get("/runs").text


def test_each_round_names_the_hospitals_aggregated_and_its_numbers_are_a_table(two_runs):
    page = TestClient(create_app(sources(two_runs))).get("/runs/t").text
    for record in read_history(two_runs / "results" / "t"):
        names = ", ".join(record["aggregated"]) if not record.get("skipped") else "none"
        assert f'data-aggregated="{0 if record.get("skipped") else len(record["aggregated"])}"' in page
        assert names in page
        accuracy = record.get("test", {}).get("accuracy")
        if accuracy is not None:
            assert f'<tr data-round="{record["round"]}"><td class="num">{record["round"]}</td><td class="num">' \
                   f'{accuracy:.4f}</td>' in page


# --- scale: read once per change, paged -------------------------------------------------------------------------------
@pytest.mark.parametrize("noises,delta", [([1.0] * 12, 1e-5), ([0.6, 3.0, 1.0, 0.6, 30.0], 1e-6),
                                          ([1.0, None, 2.0], 1e-5), ([None], 1e-5), ([400.0, 400.0], 1e-5)])
def test_epsilon_counted_in_one_pass_is_the_ledgers_at_every_entry(noises, delta):
    entries = [{"noise-multiplier": z, "distributed-dp": None} for z in noises]
    counter = EpsilonCounter(delta)
    for number, entry in enumerate(entries, start=1):
        assert counter.after(entry) == pytest.approx(releases_epsilon(entries[:number], delta), rel=1e-9)
        assert counter.add(entry) == pytest.approx(releases_epsilon(entries[:number], delta), rel=1e-9)


def test_epsilon_with_a_secure_sum_counted_in_one_pass_is_the_ledgers():
    entries = [{"noise-multiplier": 1.0, "distributed-dp": None},
               {"noise-multiplier": None, "distributed-dp": {"mechanism": "skellam", "variance": 4e6, "l1": 900.0,
                                                             "l2": 30.0}},
               {"noise-multiplier": 2.0, "distributed-dp": None},
               {"noise-multiplier": None, "distributed-dp": None,  # patient-level DP-SGD: composed as the sums are
                "patient-dp": {"mechanism": "poisson-gaussian", "noise-multiplier": 1.1, "sample-rate": 0.01,
                               "steps": 100, "unit": "patient", "adjacency": "add-remove"}}]
    counter = EpsilonCounter(1e-5)
    for number, entry in enumerate(entries, start=1):
        assert counter.add(entry) == pytest.approx(releases_epsilon(entries[:number], 1e-5), rel=1e-9)


def test_a_hospital_and_its_policy_are_read_without_torch(two_runs):
    """The console's first page pays for no deep-learning import (torch: about 1 CPU s and 180 MB, which the first
    page of a year of log once spent in reading the policy's rules)."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from console.app import create_app; "
            "from console.hospital_view import read_hospital; "
            f"view = read_hospital(Path({str(two_runs / 'state' / 'hospital-00')!r}), "
            f"policy_file=Path({str(two_runs / 'dp.toml')!r})); "
            "assert view.policy.rows and not view.policy.problem, view.policy; print(sorted({'torch', 'monai'} & "
            "set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_log_that_grew_is_read_in_its_new_lines_and_one_edited_is_read_whole(copy):
    path = copy / "state" / "hospital-01" / "audit.jsonl"
    reader = LogReader(path).read()
    before, offset = len(reader.site.refusals), reader.offset
    AuditLog(path, "hospital:hospital-01").append("message", direction="sent", kind="train", run="t3", round=1,
                                                   error="refused by its policy (dp.toml): test")
    site = reader.site
    reader.read()
    assert reader.site is site and reader.offset > offset and len(site.refusals) == before + 1  # only the new line
    assert reader.verification.ok
    text = path.read_text().splitlines(keepends=True)
    text[-1] = text[-1].replace("test", "edited")
    path.write_text("".join(text))
    reader.read()
    assert reader.site is not site and not reader.verification.ok  # read whole again: the edit is found
    assert reader.verification.problems[0][0] == len(text)


def test_the_view_is_read_once_per_change_of_its_files(copy, monkeypatch):
    calls = []
    real = console_app.read_hospital
    monkeypatch.setattr(console_app, "read_hospital", lambda *a, **k: calls.append(1) or real(*a, **k))
    app = create_app(sources(copy))
    app.state.views.warm()  # fedmed console reads every hospital before it serves
    assert len(calls) == 3
    client = TestClient(app)
    client.get("/hospital/hospital-02")
    client.get("/hospital/hospital-02/run/1")
    client.get("/")
    assert len(calls) == 3
    AuditLog(copy / "state" / "hospital-02" / "audit.jsonl", "hospital:hospital-02").append("note", what="x")
    client.get("/hospital/hospital-02")
    assert len(calls) == 4


def test_a_live_page_refreshes_no_faster_than_it_is_read_and_rendered(copy):
    app = create_app(sources(copy))
    client = TestClient(app)
    assert 'content="5"' in client.get("/hospital/hospital-02").text  # the log was written just now: live
    app.state.views.seconds = 4.2  # a hospital whose files take 4.2 s to read
    assert 'http-equiv="refresh" content="13"' in client.get("/hospital/hospital-02").text


def test_a_runs_messages_are_paged_one_click_away(two_runs, monkeypatch):
    monkeypatch.setattr(console_app, "MESSAGES_PER_PAGE", 5)
    client = TestClient(create_app(sources(two_runs)))
    view = read_hospital(two_runs / "state" / "hospital-00")
    messages = view.runs[0].messages
    main = client.get("/hospital/hospital-00").text
    assert 'class="messages"' not in main  # the hospital's page holds no message; each run's page does
    page = client.get("/hospital/hospital-00/run/1?page=2").text
    shown = [int(part.split("<")[0]) for part in page.split('<tr><td class="num">')[1:]]
    assert shown == [m.line for m in messages[5:10]]
    assert client.get("/hospital/hospital-00/run/9").status_code == 404
    monkeypatch.setattr(console_app, "RUNS_PER_PAGE", 1)  # the runs themselves, the latest first
    assert '<tr data-run="t2"' in client.get("/hospital/hospital-00").text
    second = client.get("/hospital/hospital-00?page=2").text
    assert '<tr data-run="t"' in second and '<tr data-run="t2"' not in second


# --- the report to file -----------------------------------------------------------------------------------------------
def test_the_report_is_one_static_page_of_the_period_with_the_chains_head(two_runs, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert fedmed(["console", "--state", str(two_runs / "state"), "--results", str(two_runs / "results"),
                   "--policy", f"hospital-00={two_runs / 'dp.toml'}", "--report", str(out),
                   "--hospital", "hospital-00"]) == 0
    page = out.read_text()
    log = lines(two_runs / "state" / "hospital-00" / "audit.jsonl")
    view = read_hospital(two_runs / "state" / "hospital-00", policy_file=two_runs / "dp.toml")
    assert log[-1]["hash"] in page and "Chain intact" in page
    assert f'id="epsilon-total">{view.privacy.epsilon:.2f}<' in page and "spent (one more training" in page
    assert page.count("<tr><td>t") == 2 and "privacy budget spent" in page
    assert page.count(f"SuperLink {SUPERLINK}") == 2  # to whom, run by run
    import hashlib

    assert hashlib.sha256((two_runs / "state" / "hospital-00" / "audit.jsonl").read_bytes()).hexdigest() in page
    assert "<script" not in page and " src=" not in page and "<link" not in page and "href=" not in page
    day = log[-1]["time"][:10]
    assert fedmed(["console", "--state", str(two_runs / "state"), "--report", str(out), "--hospital",
                   "hospital-00", "--until", "1999-01-01"]) == 0
    assert "<tr><td>t" not in out.read_text() and day not in out.read_text().split("Period:")[1][:60]
    assert fedmed(["console", "--state", str(two_runs / "state"), "--report", str(out)]) == 2
    assert "name one with --hospital" in capsys.readouterr().err


# --- served beyond loopback -------------------------------------------------------------------------------------------
def test_only_the_expected_host_names_are_served(two_runs):
    app = create_app(Sources(state=two_runs / "state"), allowed_hosts=["127.0.0.1", "localhost"])
    assert TestClient(app, base_url="http://127.0.0.1:8765").get("/").status_code == 200
    assert TestClient(app, base_url="http://rebound.example:8765").get("/").status_code == 400


def test_the_token_cookie_is_secure_off_loopback(two_runs):
    token = "s3cret-token-of-the-dpo"
    app = create_app(Sources(state=two_runs / "state"), token=token, secure_cookie=True)
    response = TestClient(app, base_url="https://testserver").get(f"/?token={token}", follow_redirects=False)
    cookie = response.headers["set-cookie"].lower()
    assert response.status_code == 303 and "secure" in cookie and "httponly" in cookie


def test_off_loopback_needs_tls(two_runs, tmp_path, capsys):
    args = ["console", "--state", str(two_runs / "state"), "--host", "0.0.0.0", "--token", "x" * 20]
    assert fedmed(args) == 2 and "--tls-cert" in capsys.readouterr().err
    assert fedmed(args + ["--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(tmp_path / "k")]) == 2
    assert "not a file" in capsys.readouterr().err


def test_the_console_serves_https_with_its_certificate_and_a_secure_cookie(two_runs, tmp_path):
    import datetime
    import socket
    import ssl
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = "s3cret-token-of-the-dpo"
    console = subprocess.Popen([sys.executable, "-m", "cli.main", "console", "--state", str(two_runs / "state"),
                                "--port", str(port), "--token", token, "--tls-cert", str(tmp_path / "cert.pem"),
                                "--tls-key", str(tmp_path / "key.pem")], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    context = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    context.check_hostname = False

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context), NoRedirect)
    try:
        deadline = time.time() + 60
        while True:
            try:
                opener.open(f"https://127.0.0.1:{port}/", timeout=2)
            except urllib.error.HTTPError as error:
                error.close()
                assert error.code == 401  # over TLS, and the token is still needed
                break
            except OSError:
                assert console.poll() is None and time.time() < deadline
                time.sleep(0.3)
        with pytest.raises(urllib.error.HTTPError) as redirect:
            opener.open(f"https://127.0.0.1:{port}/?token={token}", timeout=10)
        redirect.value.close()
        cookie = redirect.value.headers["set-cookie"].lower()
        assert redirect.value.code == 303 and "secure" in cookie and "httponly" in cookie
        rebound = urllib.request.Request(f"https://127.0.0.1:{port}/", headers={"Host": "rebound.example",
                                                                               "Authorization": f"Bearer {token}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            opener.open(rebound, timeout=10)
        refused.value.close()
        assert refused.value.code == 400
        ok = urllib.request.Request(f"https://127.0.0.1:{port}/", headers={"Authorization": f"Bearer {token}"})
        with opener.open(ok, timeout=10) as page:
            assert page.status == 200 and "hospital-00" in page.read().decode()
    finally:
        console.terminate()
        try:
            console.wait(10)
        except subprocess.TimeoutExpired:
            console.kill()
            console.wait(10)
