"""``fedmed console`` in a real browser, after a real deployment on loopback (long tier).

One SuperLink and three hospital SuperNodes (``fedmed-supernode``), each with its own data folder and its own policy
file, run three runs: ``console``, three rounds of FedAvg under secure aggregation (hospital-00 and hospital-01 with
local DP, hospital-01's budget refusing its third round, hospital-02 allowed one training per run); ``spent``, the
same from another seed, which hospital-01 refuses whole (its budget is spent); and ``failed``, a method no policy
allows, which every hospital refuses, so the run fails with its reason. Each policy approves the app's hash in its
``apps``. Then ``fedmed console`` serves both views, headless Chromium (Debian's package, driven by Playwright's Python
package, no browser download) opens them, and the numbers on the page must be the files' numbers: epsilon, the
budget left or spent, trainings, refusals, rounds, bytes, who aggregated, the cross-check per run, the failed run's
reason. An audit log tampered with afterwards must show as broken at its line. Screenshots go to the test's folder
(docs/console-*.png are copies of them).

Skips, saying why, where Playwright or Chromium is missing (``.ci/run`` installs Chromium where it can).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cli.launch import FlowerHome, free_port, start_superlink, start_supernode, submit_run, wait_for_run
from cli.main import main as fedmed
from cli.site import app_hash
from server_app.results import read_history

from .conftest import ROOT
from .flower_processes import run_to_completion, stopped_at_exit

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROUNDS = 3
DP = "[local-dp]\nclip-norm = 0.5\nnoise-multiplier = 1.0\ndelta = 1e-5\n"


def chromium() -> str:
    """The system's Chromium, or skip saying how to get it."""
    pytest.importorskip("playwright.sync_api", reason="Playwright's Python package is not installed (it is in the "
                        "test extra: pip install -e '.[test]')")
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no Chromium on this machine: apt-get install -y --no-install-recommends chromium (.ci/run does "
                "where it runs as root)")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def deployment(tmp_path: Path) -> dict:
    """The run's folders after three rounds on loopback: results, state, and each hospital's policy file."""
    sites = tmp_path / "sites"
    assert fedmed(["partition", "--hospitals", "3", "--out", str(sites), "--run-config",
                   "synthetic-samples=240 image-size=16 min-partition-size=5"]) == 0
    digest, _ = app_hash(ROOT)
    policies = {"hospital-00": f'methods = ["fedavg"]\napps = ["{digest}"]\n{DP}max-epsilon = 25.0\n',
                "hospital-01": f'methods = ["fedavg"]\napps = ["{digest}"]\nmax-rounds-per-run = 10\n'
                               f'{DP}max-epsilon = 20.0\n',
                "hospital-02": f'methods = ["fedavg"]\napps = ["{digest}"]\nmax-rounds-per-run = 1\n'
                               'release-metrics = "validation"\n'}
    for name, text in policies.items():
        (tmp_path / f"{name}.toml").write_text(text)
    home = FlowerHome(tmp_path / "flwr-home")
    port = free_port()
    superlink = start_superlink(home, port, simulation=False, connection="site")
    nodes = [start_supernode(home, f"127.0.0.1:{port}", free_port(),
                             {"hospital": name, "data-dir": str(sites / name), "device": "cpu",
                              "state-dir": str(tmp_path / "state" / name),
                              "policy-file": str(tmp_path / f"{name}.toml")})
             for name in policies]
    job = {"run-name": "console", "strategy": "fedavg", "model": "small-cnn", "dataset": "npz",
           "test-dir": str(sites / "test"), "image-size": 16, "batch-size": 16, "num-server-rounds": ROUNDS,
           "min-train-hospitals": 2, "min-available-hospitals": 3, "round-timeout": 300.0,
           "secure-aggregation.enabled": True, "results-dir": str(tmp_path / "results")}
    with stopped_at_exit(superlink, *nodes):
        run_to_completion(home, job, connection="site", timeout=900)
        run_to_completion(home, {**job, "run-name": "spent", "seed": 7}, connection="site", timeout=900)
        failed = submit_run(home, "site", {**job, "run-name": "failed", "strategy": "fedprox", "seed": 8,
                                           "num-server-rounds": 1})
        assert wait_for_run(home, "site", failed, 600) != "finished:completed"
    return {"results": tmp_path / "results", "state": tmp_path / "state", "run": tmp_path / "results" / "console",
            "policies": {name: tmp_path / f"{name}.toml" for name in policies}}


def serve(folders: dict, port: int) -> subprocess.Popen:
    """``fedmed console`` as a user starts it; returns once it answers."""
    args = [sys.executable, "-m", "cli.main", "console", "--state", str(folders["state"]), "--results",
            str(folders["results"]), "--port", str(port)]
    for name, path in folders["policies"].items():
        args += ["--policy", f"{name}={path}"]
    process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
            return process
        except OSError:
            assert process.poll() is None, process.stdout.read()
            assert time.time() < deadline, "fedmed console did not answer within 60 s"
            time.sleep(0.3)


def test_both_views_in_a_browser_show_the_files_numbers_and_a_tampered_log(tmp_path):
    browser_path = chromium()
    from playwright.sync_api import sync_playwright

    folders = deployment(tmp_path)
    history = read_history(folders["run"])
    assert [r["round"] for r in history] == list(range(1, ROUNDS + 1))
    port = free_port()
    console = serve(folders, port)
    shots = tmp_path / "screenshots"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1240, "height": 900})
            base = f"http://127.0.0.1:{port}"

            # --- the hospital whose budget refused a round, then a whole run ---------------------------------
            folder = folders["state"] / "hospital-01"
            log = lines(folder / "audit.jsonl")
            ledger = json.loads((folder / "privacy-ledger.json").read_text())["releases"]
            epsilons = [r["epsilon"] for r in log if r.get("decision") == "epsilon"]
            refusals = [r for r in log if r.get("direction") == "sent" and r.get("error")]
            assert len(ledger) == len(epsilons) == 2  # the third round of console, and then every round: refused
            assert {r["run"] for r in refusals} == {"console", "spent", "failed"}
            page.goto(f"{base}/hospital/hospital-01")
            page.wait_for_selector("#chain")
            assert page.get_attribute("#chain", "data-ok") == "true"
            assert "Chain intact" in page.inner_text("#chain")
            assert page.inner_text("#epsilon-total") == f"{epsilons[-1]:.2f}"
            assert page.inner_text("#epsilon-budget") == "20"
            assert page.get_attribute("#epsilon-left", "data-spent") == "true"  # as the hospital decides it
            said = next(r["error"] for r in refusals if "privacy budget spent" in r["error"])
            figures = page.inner_text(".figures")  # the page's next-round figure is the hospital's own
            shown = float(figures.split("would make it ")[1].split(",")[0])
            assert shown == pytest.approx(float(said.split("would make it ")[1].split(",")[0]), rel=1e-2)
            assert page.inner_text("#trainings-total") == str(len(ledger))
            assert page.locator("#refusals tr").count() - 1 == len(refusals)
            assert "privacy budget spent" in page.inner_text("#refusals")
            checks = page.inner_text("#peer-checks")  # both ways, per run: every run's server log is untouched
            assert page.locator("#peer-checks tr").count() - 1 == 6 and "BROKEN" not in checks
            assert all(f"run {run}:" in checks for run in ("console", "spent", "failed"))
            chart = [float(y) for y in page.locator("svg.chart circle.point").evaluate_all(
                "points => points.map(p => p.getAttribute('data-y'))")]
            assert chart == pytest.approx(epsilons)
            assert page.locator("#site-runs tr[data-run]").count() == 3
            page.screenshot(path=str(shots / "console-hospital.png"), full_page=True)
            page.goto(f"{base}/hospital/hospital-01/run/1")  # the run console's rounds and messages
            sent = [r for r in log if r.get("event") == "message" and r["direction"] == "sent"
                    and r["run"] == "console"]
            rows = page.locator("table.rounds tr[data-round]")
            assert rows.count() == len({r["round"] for r in sent})  # 0: who it is, then every round
            for index in range(rows.count()):
                number = int(rows.nth(index).get_attribute("data-round"))
                cell = rows.nth(index).locator("[data-sent-bytes]").get_attribute("data-sent-bytes")
                assert int(cell) == sum(r["bytes"] for r in sent if r.get("round") == number)
            assert "yes (secure aggregation)" in page.inner_text("table.rounds")
            received = next(r for r in log if r.get("direction") == "received" and r["run"] == "console")
            assert f"Flower run {received['flower-run']}" in page.inner_text("#messages")
            assert page.locator("#messages tr").count() - 1 == len([r for r in log if r.get("event") == "message"
                                                                     and r["run"] == "console"])
            page.screenshot(path=str(shots / "console-hospital-run.png"), full_page=True)

            # --- secure rounds: those refused are not counted -----------------------------------------------------
            memory = [e for e in lines(folder / "secure-aggregation.jsonl") if e["memory"] == "rounds"]
            refused = {(r["run"], r["round"]) for r in refusals}
            taken = sum(1 for e in memory if (e["run"], e["round"]) not in refused)
            page.goto(f"{base}/hospital/hospital-01")
            assert page.inner_text("#secure-state").startswith(f"{taken} secure round(s) taken part in")

            # --- the coordinator -------------------------------------------------------------------------------
            page.goto(f"{base}/runs/console")
            rows = page.locator("#rounds tr[data-round]")
            assert rows.count() == len(history) == ROUNDS
            assert page.inner_text("#run-status") == "completed"
            assert page.get_attribute("#server-chain", "data-ok") == "true"
            for index, record in enumerate(history):
                row = rows.nth(index)
                assert int(row.get_attribute("data-bytes-up")) == record["bytes_up"]
                assert int(row.get_attribute("data-bytes-down")) == record["bytes_down"]
                cells = row.locator("td").all_inner_texts()
                aggregated = [] if record.get("skipped") else record["aggregated"]
                assert cells[:6] == [str(record["round"]), str(len(record["chosen"])),
                                     str(len(record["chosen"]) - len(record["missing"])), str(len(record["refused"])),
                                     str(len(aggregated)), ", ".join(aggregated) or "none"]
            assert history[1]["refused"] and "hospital-02" in history[1]["refused"]
            assert "refused by its policy (hospital-02.toml)" in page.inner_text("#rounds")
            assert page.locator("#curve-numbers tr[data-round]").count() >= ROUNDS
            page.screenshot(path=str(shots / "console-coordinator.png"), full_page=True)
            status = json.loads((folders["results"] / "failed" / "status.json").read_text())
            page.goto(f"{base}/runs/failed")
            assert page.inner_text("#run-status") == "failed" and status["status"] == "failed"
            assert status["error"][:60] in page.inner_text("#run-error")
            assert "n/a" in page.inner_text("#best") or "no model was trained" in page.inner_text("#best")
            page.goto(f"{base}/runs")
            assert status["error"][:60] in page.inner_text("#runs")

            # --- a tampered log ----------------------------------------------------------------------------------
            path = folders["state"] / "hospital-00" / "audit.jsonl"
            text = path.read_text().splitlines(keepends=True)
            record = json.loads(text[4])
            record["bytes"] = 1  # line 5 now says almost nothing left
            text[4] = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
            path.write_text("".join(text))
            page.goto(f"{base}/hospital/hospital-00")
            assert page.get_attribute("#chain", "data-ok") == "false"
            assert page.get_attribute("#chain", "data-first-bad-line") == "5"
            assert "BROKEN at line 5" in page.inner_text("#chain")
            assert page.get_attribute("#ledger", "data-ok") == "false"  # its ledger can no longer be checked
            page.goto(base + "/")
            assert "BROKEN at line 5" in page.inner_text("body")
            page.goto(f"{base}/hospital/hospital-00")
            page.screenshot(path=str(shots / "console-hospital-broken.png"), full_page=True)
            browser.close()
    finally:
        console.terminate()
        console.wait(10)
    assert all((shots / name).stat().st_size > 10_000 for name in
               ("console-hospital.png", "console-coordinator.png", "console-hospital-broken.png"))
