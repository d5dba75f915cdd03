"""The audit log (common/trust/audit.py): a SHA-256 chain of JSON lines that a new process extends after checking its
last line, that concurrent writers share without interleaving, and whose verification names every edited, inserted,
removed, reordered or cut-short line; both ends of a federation log the same content hashes."""

from __future__ import annotations

import hashlib
import json
import multiprocessing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli.audit import main as audit_main
from common.trust.audit import GENESIS, AuditError, AuditLog, FollowedLog, cross_check, line_hash, verify


def written(path, count=5) -> list[dict]:
    log = AuditLog(path, "test")
    return [log.append("message", direction="sent", round=i, sha256="ab" * 32, bytes=10 * i) for i in range(count)]


def lines_of(path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def problem_lines(path, **kw) -> list[int]:
    return [number for number, _ in verify(path, **kw).problems]


def test_each_line_holds_the_previous_hash_and_its_own(tmp_path):
    path = tmp_path / "audit.jsonl"
    records = written(path)
    assert records[0]["prev"] == GENESIS and records[0]["seq"] == 1
    for before, after in zip(records, records[1:]):
        assert after["prev"] == before["hash"] and after["seq"] == before["seq"] + 1
    for text, record in zip(lines_of(path), records):
        parsed = json.loads(text)
        assert parsed == record and parsed["hash"] == line_hash(parsed)
    result = verify(path)
    assert result.ok and result.lines == 5 and result.head == records[-1]["hash"]


def test_a_new_process_appends_to_the_same_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    first = written(path, 3)
    again = AuditLog(path, "restarted").append("policy", decision="refused", reason="x")  # a fresh object: a restart
    assert again["seq"] == 4 and again["prev"] == first[-1]["hash"]
    assert verify(path).ok


def test_an_edited_line_is_named(tmp_path):
    path = tmp_path / "audit.jsonl"
    written(path)
    lines = lines_of(path)
    lines[2] = lines[2].replace(b'"bytes":20', b'"bytes":21')
    path.write_bytes(b"".join(lines))
    result = verify(path)
    assert problem_lines(path) == [3] and "edited" in result.problems[0][1]


def test_a_line_rewritten_with_its_hash_recomputed_breaks_the_next_link(tmp_path):
    path = tmp_path / "audit.jsonl"
    written(path)
    lines = lines_of(path)
    record = json.loads(lines[1])
    record["bytes"] = 999
    record["hash"] = line_hash(record)
    lines[1] = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
    path.write_bytes(b"".join(lines))
    assert problem_lines(path) == [3]  # line 2 is self-consistent; line 3 no longer follows it


def test_a_reformatted_line_is_named(tmp_path):
    path = tmp_path / "audit.jsonl"
    written(path)
    lines = lines_of(path)
    lines[1] = json.dumps(json.loads(lines[1]), indent=None).encode() + b"\n"  # same content, spaces added
    path.write_bytes(b"".join(lines))
    assert problem_lines(path) == [2]


def test_a_reformatted_line_whose_hash_covers_its_new_text_is_named(tmp_path):
    """Verification hashes a line's text without its hash (one JSON dump a line, not two) and still accepts only
    the writer's canonical form: a line respaced and re-hashed over its own new text is named."""
    path = tmp_path / "audit.jsonl"
    written(path)
    lines = lines_of(path)
    record = json.loads(lines[1])
    body = json.dumps({k: v for k, v in record.items() if k != "hash"}, sort_keys=True)  # spaces after , and :
    record["hash"] = hashlib.sha256(body.encode()).hexdigest()
    lines[1] = (body[:-1] + f', "hash": "{record["hash"]}"}}\n').encode()
    path.write_bytes(b"".join(lines))
    assert 2 in problem_lines(path)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["hash", "a", "zz", "é", '"']) |
                                                                st.text(max_size=5), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.lists(st.dictionaries(st.sampled_from(["a", "detail", "hash-of", "zz", "event-x"]), JSON_VALUES,
                                       max_size=3), min_size=2, max_size=4),
       where=st.data())
def test_every_written_line_verifies_and_any_byte_changed_in_one_is_named(tmp_path_factory, fields, where):
    """Whatever an event holds (nested objects with a "hash" key, escapes, long numbers), the writer's lines
    verify, and changing any one byte of a line, or removing it, names that line."""
    path = tmp_path_factory.mktemp("log") / "audit.jsonl"
    log = AuditLog(path, "test")
    for number, extra in enumerate(fields):
        log.append("message", round=number, **extra)
    assert verify(path).ok
    lines = lines_of(path)
    line = where.draw(st.integers(0, len(lines) - 1))
    at = where.draw(st.integers(0, len(lines[line]) - 2))  # not its newline
    byte = where.draw(st.integers(0, 255).filter(lambda b: b != lines[line][at] and b != ord("\n")))
    changed = list(lines)
    changed[line] = lines[line][:at] + bytes([byte]) + lines[line][at + 1:]
    path.write_bytes(b"".join(changed))
    assert line + 1 in problem_lines(path)
    path.write_bytes(b"".join(lines[:line] + lines[line + 1:]))
    assert problem_lines(path)[:1] == ([line + 1] if line + 1 < len(lines) else [])


def test_an_inserted_line_is_named(tmp_path):
    path = tmp_path / "audit.jsonl"
    written(path)
    lines = lines_of(path)
    path.write_bytes(b"".join(lines[:2] + [lines[1]] + lines[2:]))  # a copy of line 2, hash and all
    assert problem_lines(path)[0] == 3


def test_a_removed_line_is_named(tmp_path):
    path = tmp_path / "audit.jsonl"
    written(path)
    lines = lines_of(path)
    path.write_bytes(b"".join(lines[:2] + lines[3:]))
    result = verify(path)
    assert problem_lines(path) == [3, 3] and "removed" in result.problems[0][1]


def test_reordered_lines_are_named(tmp_path):
    path = tmp_path / "audit.jsonl"
    written(path)
    lines = lines_of(path)
    path.write_bytes(b"".join([lines[0], lines[2], lines[1], *lines[3:]]))
    assert set(problem_lines(path)) == {2, 3, 4}


def test_a_cut_short_last_line_is_named_and_not_extended(tmp_path):
    path = tmp_path / "audit.jsonl"
    written(path)
    path.write_bytes(path.read_bytes()[:-20])
    result = verify(path)
    assert problem_lines(path) == [5] and "cut short" in result.problems[0][1]
    with pytest.raises(AuditError, match="cut short"):
        AuditLog(path).append("message")
    assert len(lines_of(path)) == 5  # nothing appended past the damage


def test_a_writer_refuses_to_extend_an_edited_last_line(tmp_path):
    path = tmp_path / "audit.jsonl"
    written(path)
    path.write_bytes(path.read_bytes().replace(b'"round":4', b'"round":5'))
    with pytest.raises(AuditError, match="edited"):
        AuditLog(path).append("message")


def test_lines_removed_from_the_end_are_found_by_a_recorded_head(tmp_path):
    path = tmp_path / "audit.jsonl"
    records = written(path)
    path.write_bytes(b"".join(lines_of(path)[:3]))
    assert verify(path).ok  # a shorter chain is still a chain
    assert problem_lines(path, head=records[-1]["hash"]) == [3]
    assert verify(path, head=records[2]["hash"]).ok


def _append_many(path: str, writer: str, count: int) -> None:
    log = AuditLog(path, writer)
    for i in range(count):
        log.append("message", direction="sent", round=i, reason="x" * 3000)  # long lines: more chance to interleave


def test_a_followed_log_is_verified_in_the_lines_added_since_its_last_read(tmp_path):
    """What the replay memory and the privacy ledger read at every secure stage: the whole log once, then only the
    new lines, each chained to the last one verified; the same verdict as verify()."""
    path = tmp_path / "audit.jsonl"
    records = written(path, 3)
    follower = FollowedLog(path)
    result, seen, whole = follower.read()
    assert whole and result.ok and seen == records and (result.lines, result.head) == (3, records[-1]["hash"])
    assert follower.read()[1:] == ([], False)  # nothing new
    more = [AuditLog(path).append("message", round=9), AuditLog(path).append("message", round=10)]
    result, seen, whole = follower.read()
    assert not whole and seen == more and (result.lines, result.head) == (5, verify(path).head) and result.ok

    # a line appended that does not chain to the last verified one: named by its number, as verify() names it
    forged = {**more[-1], "seq": 6, "prev": "f" * 64}
    forged["hash"] = line_hash(forged)
    with path.open("a") as handle:
        handle.write(json.dumps(forged, sort_keys=True, separators=(",", ":")) + "\n")
    result, _, _ = follower.read()
    assert [n for n, _ in result.problems] == problem_lines(path) == [6]
    assert follower.read()[0].problems == result.problems  # after a problem it reads the whole log again

    # cut back to 4 lines: a shorter valid chain, read whole (its reader sees lines it counted are gone)
    path.write_bytes(b"".join(lines_of(path)[:4]))
    result, seen, whole = follower.read()
    assert whole and result.ok and [r["seq"] for r in seen] == [1, 2, 3, 4]
    # the last verified line edited in place: read whole, the edit named
    edited = lines_of(path)
    edited[3] = edited[3].replace(b'"round":9', b'"round":8')
    path.write_bytes(b"".join(edited))
    assert [n for n, _ in follower.read()[0].problems] == [4]
    # an edit further back is for verify() and for every new reader (a new process) to find
    path.unlink()
    written(path, 3)
    follower = FollowedLog(path)
    follower.read()
    edited = lines_of(path)
    edited[0] = edited[0].replace(b'"round":0', b'"round":7')
    path.write_bytes(b"".join(edited))
    assert follower.read()[1:] == ([], False) and problem_lines(path) == [1]
    assert [n for n, _ in FollowedLog(path).read()[0].problems] == [1]


def test_lines_longer_than_one_read_from_the_end_extend_the_chain(tmp_path):
    """A writer finds the last line by reading the file's end a few KB at a time: a line of many of them (a long
    list of hospitals, say) is found whole."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    long = log.append("round", hospitals=[f"hospital-{i:05d}" for i in range(2000)])  # ~34 KB
    assert len(lines_of(path)[0]) > 30_000
    after = log.append("message", round=1)
    assert after["prev"] == long["hash"] and log.head() == after["hash"] and verify(path).ok


def test_concurrent_writers_extend_one_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_append_many, args=(str(path), f"w{i}", 40)) for i in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    result = verify(path)
    assert result.ok and result.lines == 160, result.report()


def test_audit_verify_command(tmp_path, capsys):
    path = tmp_path / "audit.jsonl"
    records = written(path)
    assert audit_main(["audit", "verify", str(path)]) == 0
    assert records[-1]["hash"] in capsys.readouterr().out
    path.write_bytes(path.read_bytes().replace(b'"round":2', b'"round":7'))
    assert audit_main(["verify", str(path)]) == 1
    assert "line 3:" in capsys.readouterr().out
    assert audit_main(["verify", str(tmp_path / "absent.jsonl")]) == 2


def test_both_ends_log_the_same_content_hashes(tmp_path):
    """A FakeGrid run: each message the server logs as sent, the hospital logs as received with the same SHA-256 and
    size, and the other way round; the server's log holds the hospital's audit heads, each a line of its log."""
    from strategies import FedAvgStrategy

    from .fake_grid import FakeGrid, simulated_hospitals
    from .test_strategies import SMALL_CLASSIFICATION, run_config

    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    FedAvgStrategy(run_config=config).start(FakeGrid(simulated_hospitals(config, 2)), num_rounds=2)
    server_log = tmp_path / "results" / "t" / "audit.jsonl"
    hospital_log = tmp_path / "state" / "hospital-00" / "audit.jsonl"
    assert verify(server_log).ok and verify(hospital_log).ok
    server = [json.loads(line) for line in lines_of(server_log)]
    hospital = [json.loads(line) for line in lines_of(hospital_log)]
    at_hospital = {(r["direction"], r["kind"], r["round"]): r for r in hospital if r["event"] == "message"}
    mine = [r for r in server if r.get("peer") == "hospital-00" and r["kind"] == "train"]
    assert len(mine) == 4  # 2 rounds, each sent and received
    for record in mine:
        other = at_hospital["received" if record["direction"] == "sent" else "sent", "train", record["round"]]
        assert record["sha256"] == other["sha256"]  # the content, byte for byte
        assert abs(record["bytes"] - other["bytes"]) < 300  # the whole message: its metadata differs a little
        assert record["run"] == other["run"] == "t" and record["method"] == other["method"] == "fedavg"
    assert all(r.get("peer-audit-head") for r in mine if r["direction"] == "received")
    assert cross_check(hospital_log, server_log, "hospital-00") == []
    hospital_log.write_bytes(b"".join(lines_of(hospital_log)[:-5]))  # its last reply and the run's end cut away
    assert cross_check(hospital_log, server_log, "hospital-00")


def rechained(lines: list[dict]) -> bytes:
    """Lines rewritten as their log's operator could: each line's prev and hash made afresh, so the chain verifies."""
    from common.trust.audit import GENESIS, canonical, line_hash

    out, previous = [], GENESIS
    for seq, record in enumerate(lines, start=1):
        record = {**record, "seq": seq, "prev": previous}
        record["hash"] = previous = line_hash(record)
        out.append((canonical(record) + "\n").encode())
    return b"".join(out)


def audited_federation(tmp_path, policy_text: str = ""):
    """A FakeGrid run of two hospitals (the first refusing under ``policy_text`` when given); both logs' paths."""
    from strategies import FedAvgStrategy

    from .fake_grid import FakeGrid, hospital_node
    from .test_strategies import SMALL_CLASSIFICATION, run_config

    config = run_config(tmp_path, SMALL_CLASSIFICATION)
    nodes = {}
    for pid in range(2):
        node = {"partition-id": pid, "num-partitions": 2}
        if policy_text and pid == 0:
            (tmp_path / "policy.toml").write_text(policy_text)
            node["policy-file"] = str(tmp_path / "policy.toml")
        nodes[101 + pid] = hospital_node(config, node, 101 + pid)
    FedAvgStrategy(min_train_nodes=1, run_config=config).start(FakeGrid(nodes), num_rounds=2)
    return tmp_path / "results" / "t" / "audit.jsonl", tmp_path / "state" / "hospital-00" / "audit.jsonl"


def test_a_refusal_is_anchored_in_the_servers_log_and_cannot_be_removed_unseen(tmp_path):
    """Error replies carry the hospital's audit head too: a refusal removed from the hospital's log and the log
    rechained no longer passes `audit verify --peer`."""
    server_log, hospital_log = audited_federation(tmp_path, "max-rounds-per-run = 1\n")
    server = [json.loads(line) for line in lines_of(server_log)]
    refused = [r for r in server if r.get("peer") == "hospital-00" and r["direction"] == "received"
               and "max-rounds-per-run" in (r.get("error") or "")]
    assert refused and all(r.get("peer-audit-head") for r in refused)
    assert audit_main(["verify", str(hospital_log), "--peer", str(server_log), "--name", "hospital-00"]) == 0
    hospital = [json.loads(line) for line in lines_of(hospital_log)]
    kept = [r for r in hospital if "max-rounds-per-run" not in json.dumps(r)]
    assert len(kept) < len(hospital)
    hospital_log.write_bytes(rechained(kept))
    assert verify(hospital_log).ok  # the rewritten log is a valid chain on its own
    assert audit_main(["verify", str(hospital_log), "--peer", str(server_log), "--name", "hospital-00"]) == 1


def test_the_servers_log_is_anchored_in_the_hospitals_logs(tmp_path):
    """Every message carries the server's audit head, which the hospital records: the server's operator cannot
    rewrite the server's log (and rechain it) unseen."""
    server_log, hospital_log = audited_federation(tmp_path)
    hospital = [json.loads(line) for line in lines_of(hospital_log)]
    received = [r for r in hospital if r.get("direction") == "received"]
    assert received and all(r.get("peer") == "server" and r.get("peer-audit-head") for r in received)
    assert audit_main(["verify", str(server_log), "--peer", str(hospital_log), "--name", "server"]) == 0
    server = [json.loads(line) for line in lines_of(server_log)]
    server[2]["bytes"] = 1  # the operator edits a line and rechains the whole log
    server_log.write_bytes(rechained(server))
    assert verify(server_log).ok
    assert audit_main(["verify", str(server_log), "--peer", str(hospital_log), "--name", "server"]) == 1


def test_verify_peer_fails_on_a_name_it_cannot_find(tmp_path, capsys):
    server_log, hospital_log = audited_federation(tmp_path)
    assert audit_main(["verify", str(hospital_log), "--peer", str(server_log), "--name", "hospital-0"]) == 1
    assert "no line" in capsys.readouterr().out


def test_rebuild_ledger_command(tmp_path, capsys):
    from common.trust.ledger import PrivacyLedger

    log = AuditLog(tmp_path / "audit.jsonl", "hospital:h")
    ledger = PrivacyLedger(tmp_path / "state", log)
    ledger.record("r", 1, "fedavg", 0.5)
    ledger.record("r", 2, "fedavg", 0.5)
    (tmp_path / "state" / "privacy-ledger.json").unlink()
    assert audit_main(["audit", "rebuild-ledger", str(log.path), str(tmp_path / "state")]) == 0
    assert "2 training(s)" in capsys.readouterr().out
    assert PrivacyLedger(tmp_path / "state", log).trainings_in("r") == 2


def test_under_secure_aggregation_both_ends_log_the_same_content_hashes(tmp_path):
    """A secure round's training message gains its collect stage's keys after it is built: the server logs it as it
    leaves, so every message of the stages has the same SHA-256 at both ends."""
    from strategies import FedAvgStrategy
    from strategies.secure_aggregation import with_secure_aggregation

    from .fake_grid import FakeGrid
    from .test_secure_aggregation import SMALL_CLASSIFICATION, config_of, secure_hospitals

    config = config_of(tmp_path, SMALL_CLASSIFICATION, "secure")
    with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config).start(
        FakeGrid(secure_hospitals(config, 3)), num_rounds=1)
    server = [json.loads(line) for line in lines_of(tmp_path / "secure" / "results" / "secure" / "audit.jsonl")]
    hospital = [json.loads(line) for line in lines_of(tmp_path / "secure" / "state" / "hospital-00" / "audit.jsonl")]
    sent = [r["sha256"] for r in server if r.get("peer") == "hospital-00" and r["kind"] == "train"
            and r["direction"] == "sent"]
    received = [r["sha256"] for r in hospital if r.get("kind") == "train" and r.get("direction") == "received"]
    assert len(sent) == 4 and sent == received  # setup, share keys, collect (training), unmask (no keys to sign)
