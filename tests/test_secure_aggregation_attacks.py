"""Secure aggregation against a lying server, replays and hostile hospitals (issue 41, docs/secure-aggregation.md
"Threat model"): each attack the issue names, shown to fail. Either a hospital refuses (with its reason, logged at
both ends), or what the server obtains reveals nothing beyond the sum. The protocol-level attacks play the server
with ``InProcess`` (the real hospital side, in this process); the rest run rounds over FakeGrid with fedmed's
ClientApp, hospitals with the default policy unless a test gives one."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import MessageType
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

from client_app.secure_aggregation import stage_of
from common.engine.wire import from_recorddict
from common.trust.identity import sign_statement, statement_problem
from common.trust.secure_aggregation import SecureAggregationSettings
from common.trust.secure_aggregation.hospital import HospitalRules, SecureAggregationRefusal, setup_ahead
from common.trust.secure_aggregation.keys import MASK_PURPOSE, new_key_pair, shared_key
from common.trust.secure_aggregation.masks import expand_mask
from common.trust.secure_aggregation.messages import (
    COLLECT,
    CONSISTENCY,
    NAMES_KEY,
    NEIGHBOURS_KEY,
    PUBLIC_KEYS_KEY,
    SESSION_KEY,
    SETUP,
    SHARE_KEYS,
    SIGNATURES_KEY,
    SURVIVORS_KEY,
    UNMASK,
    keys_statement,
)
from common.trust.secure_aggregation.server import (
    add_masked_vector,
    collect_config,
    consistency_config,
    rebuild,
    receive_survivor_signatures,
    settle_survivors,
    setup_config,
    share_keys_config,
    unmask_config,
    unmask_sum,
)
from strategies import FedAvgStrategy
from strategies.records import arrays_of
from strategies.secure_aggregation import with_secure_aggregation

from .fake_grid import FakeGrid, simulated_hospitals
from .test_hostile_hospital import key_pair
from .test_secure_aggregation import (
    SMALL_CLASSIFICATION,
    STEP,
    InProcess,
    config_of,
    masked_replies,
    plain_hospitals,
    secure_hospitals,
    secure_node,
)

pytestmark = pytest.mark.usefixtures("one_thread")
MODULUS = 2**32
SIZE = 4000
#: |correlation| of two unrelated vectors of SIZE values stays below 5 standard errors (1/sqrt(SIZE)) but once in
#: about 1.7 million draws; the masks are fresh randomness every run
UNRELATED = 5 / SIZE**0.5


def vectors_for(nodes, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.integers(0, 2**22, SIZE) for n in nodes}


def correlation(a, b) -> float:
    return float(np.corrcoef(np.asarray(a, np.float64), np.asarray(b, np.float64))[0, 1])


def shares_of(answers, owner) -> dict[int, bytes]:
    """The shares of ``owner``'s secret in the unmask answers, by the hospital that sent each."""
    return {node: answer["secagg.shares"][answer["secagg.nids"].index(owner)]
            for node, answer in answers.items() if owner in answer["secagg.nids"]}


def lie(protocol, survivors, active, dead, signatures=None) -> dict:
    """An unmask request of the server's own making: each survivor named as the server knows it, with the signature
    ``signatures`` gives it (none: empty)."""
    survivors = sorted(survivors)
    return {"secagg.active_nids": sorted(active), "secagg.dead_nids": sorted(dead), SURVIVORS_KEY: survivors,
            SESSION_KEY: protocol.plan.session, NAMES_KEY: [protocol.plan.name(n) for n in survivors],
            SIGNATURES_KEY: [(signatures or {}).get(n, b"") for n in survivors]}


# --- masks from the whole secret -----------------------------------------------------------------------------------
def test_masks_use_the_whole_secret_not_a_32_bit_fold():
    """Flower's ``pseudo_rand_gen`` XORs the secret into one 32-bit seed: secrets with the same fold give the same
    mask, and 2^32 tries find any. Here the mask changes with every byte of the secret, and is not what the fold
    would give."""
    rng = np.random.default_rng(5)
    secret = rng.integers(0, 256, 32, dtype=np.uint8).tobytes()
    mask = expand_mask(secret, MODULUS, 1000)
    assert (mask != pseudo_rand_gen(secret, MODULUS, [(1000,)])[0]).mean() > 0.99
    delta = rng.integers(1, 256, 4, dtype=np.uint8).tobytes()
    twin = bytes(a ^ b for a, b in zip(secret, delta + delta + bytes(24)))  # the same 32-bit fold
    assert np.array_equal(pseudo_rand_gen(secret, MODULUS, [(1000,)])[0], pseudo_rand_gen(twin, MODULUS, [(1000,)])[0])
    assert (expand_mask(twin, MODULUS, 1000) != mask).mean() > 0.99
    for i in range(len(secret)):
        flipped = bytearray(secret)
        flipped[i] ^= 1
        assert (expand_mask(bytes(flipped), MODULUS, 1000) != mask).mean() > 0.99, f"byte {i}"
    assert mask.min() >= 0 and mask.max() < MODULUS and abs(mask.mean() / MODULUS - 0.5) < 0.03
    small = expand_mask(secret, 2**10, 10_000)  # any power of 2: uniform below it
    assert small.max() < 2**10 and np.allclose(np.bincount(small >> 8, minlength=4) / small.size, 0.25, atol=0.02)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        expand_mask(secret[:8], MODULUS, 10)


def test_a_two_hospital_round_leaves_the_server_a_mask_no_32_bit_search_finds():
    """After unmasking a sum of two, the server knows both private masks; one hospital's vector minus its private
    mask is its vector plus the one pairwise mask: expanded from the whole ECDH key, not from its 32-bit fold."""
    vectors = vectors_for([1, 2])
    protocol = InProcess([1, 2], SecureAggregationSettings(), SIZE)
    plan = protocol.plan
    protocol.keys()
    own = protocol.states[1].flower
    shared = shared_key(own.sk1, plan.public_keys[2][0], MASK_PURPOSE)
    masked = {n: protocol.mask(n, vectors[n]) for n in (1, 2)}
    for node, vector in masked.items():
        add_masked_vector(plan, node, vector)
    receive_survivor_signatures(plan, protocol.answers(CONSISTENCY, lambda n: consistency_config(plan, n), [1, 2]))
    answers = protocol.answers(UNMASK, lambda n: unmask_config(plan, n), [1, 2])
    np.testing.assert_array_equal(unmask_sum(plan, answers), (vectors[1] + vectors[2]) % MODULUS)

    seed = rebuild(plan, 1, shares_of(answers, 1))  # what the server knows: hospital 1's private mask
    leftover = (masked[1] - expand_mask(seed, MODULUS, SIZE)) % MODULUS
    pairwise = (vectors[1] - leftover) % MODULUS  # node 1 < node 2 subtracted it
    np.testing.assert_array_equal(pairwise, expand_mask(shared, MODULUS, SIZE, plan.plan_digest.encode()))
    assert (pairwise != pseudo_rand_gen(shared, MODULUS, [(SIZE,)])[0]).mean() > 0.99  # the 2^32 search's target
    assert abs(correlation(leftover, vectors[1])) < UNRELATED


def dropped_leftover(protocol, owner, answers, vector_masked):
    """What a server holding ``owner``'s masked vector gets once it rebuilt ``owner``'s key from the unmask answers:
    the vector minus every pairwise mask (``owner`` added those with lower node ids, subtracted the others)."""
    plan = protocol.plan
    key = rebuild(plan, owner, shares_of(answers, owner))  # shared as its 32 raw bytes
    leftover = vector_masked.copy()
    for other in sorted(plan.neighbours[owner] - {owner}):
        pairwise = expand_mask(shared_key(key, plan.public_keys[other][0], MASK_PURPOSE), MODULUS,
                               SIZE, plan.plan_digest.encode())
        leftover = leftover - pairwise if owner > other else leftover + pairwise
    return leftover % MODULUS


@pytest.mark.parametrize("count", [3, 4], ids=["late-vector", "consistent-lie"])
def test_a_hospital_declared_dropped_keeps_a_full_entropy_private_mask(count):
    """late-vector: hospital T's masked vector reached the relay after the collect timeout, and the protocol gave the
    server T's key. consistent-lie: T sent in time, and the server told every other hospital T dropped. Either way
    the server removes T's pairwise masks, and T's private mask, from its 256-bit seed, is all that is left: the
    server sees nothing of T's vector, and no hospital then gives it T's seed shares."""
    nodes = list(range(1, count + 1))
    target = nodes[-1]
    vectors = vectors_for(nodes, seed=count)
    protocol = InProcess(nodes, SecureAggregationSettings(), SIZE)
    plan = protocol.plan
    protocol.keys()
    masked = {n: protocol.mask(n, vectors[n]) for n in nodes}
    seed = protocol.states[target].flower.rd_seed  # T's: never leaves it
    others = nodes[:-1]
    for node in others:
        add_masked_vector(plan, node, masked[node])  # T's vector is held aside: "dropped"
    assert plan.dropped == {target}
    with pytest.raises(SecureAggregationRefusal, match="leaves out this hospital"):  # T itself is not fooled
        protocol.ask(target, CONSISTENCY, consistency_config(plan, target))
    receive_survivor_signatures(plan, protocol.answers(CONSISTENCY, lambda n: consistency_config(plan, n), others))
    answers = protocol.answers(UNMASK, lambda n: unmask_config(plan, n), others)
    np.testing.assert_array_equal(unmask_sum(plan, answers), sum(vectors[n] for n in others) % MODULUS)

    leftover = dropped_leftover(protocol, target, answers, masked[target])
    private = (leftover - vectors[target]) % MODULUS
    np.testing.assert_array_equal(private, expand_mask(seed, MODULUS, SIZE))
    assert (private != pseudo_rand_gen(seed, MODULUS, [(SIZE,)])[0]).mean() > 0.99
    assert abs(correlation(leftover, vectors[target])) < UNRELATED
    assert abs(leftover.mean() / MODULUS - 0.5) < 0.03
    for node in others:  # T's seed shares: every hospital answered its one unmask request and forgot the round
        with pytest.raises(SecureAggregationRefusal, match="expects stage 'setup'"):
            protocol.ask(node, UNMASK, lie(protocol, nodes, nodes, []))


def test_split_view_cannot_reach_the_threshold_twice():
    """Four hospitals. The plan split views need (threshold 2 of 4 shares) is refused by every hospital without any
    policy. With the default threshold (3 of 4) the server tells hospitals 1 and 2 (and T itself) that T survived and
    hospital 3 that T dropped: it gets T's seed, one share of T's key, and T's vector stays under its pairwise
    masks; nobody answers twice."""
    nodes, target = [1, 2, 3, 4], 4
    vectors = vectors_for(nodes, seed=7)
    protocol = InProcess(nodes, SecureAggregationSettings(), SIZE)
    weak = {**setup_config(protocol.plan), "secagg.threshold": 2}
    for node in nodes:
        with pytest.raises(SecureAggregationRefusal, match="threshold 2 is not more than 0.5 of its 4 shares"):
            protocol.ask(node, SETUP, weak)

    protocol = InProcess(nodes, SecureAggregationSettings(), SIZE)
    plan = protocol.plan
    assert plan.threshold == 3
    protocol.keys()
    masked = {n: protocol.mask(n, vectors[n]) for n in nodes}
    for node in nodes:
        add_masked_vector(plan, node, masked[node])
    told_alive, told_dead = [1, 2, 4], [3]
    for node in told_alive:
        protocol.ask(node, CONSISTENCY, {SURVIVORS_KEY: nodes, SESSION_KEY: plan.session})
    protocol.ask(3, CONSISTENCY, {SURVIVORS_KEY: [1, 2, 3], SESSION_KEY: plan.session})
    answers = {node: protocol.ask(node, UNMASK, lie(protocol, nodes, nodes, [])) for node in told_alive}
    answers.update({node: protocol.ask(node, UNMASK, lie(protocol, [1, 2, 3], [1, 2, 3], [target]))
                    for node in told_dead})
    seed = rebuild(plan, target, {n: s for n, s in shares_of(answers, target).items() if n in told_alive})
    key_shares = {n: share for n, share in shares_of(answers, target).items() if n in told_dead}
    assert len(key_shares) == 1 < plan.threshold
    plan.masked.discard(target)  # the server now treats T as dropped, to rebuild its key: too few shares
    with pytest.raises(ValueError, match="fewer than the reconstruction threshold 3"):
        rebuild(plan, target, key_shares)
    without_private = (masked[target] - expand_mask(seed, MODULUS, SIZE)) % MODULUS
    assert abs(correlation(without_private, vectors[target])) < UNRELATED  # its pairwise masks are still on it
    for node in nodes:  # and no hospital can be asked again for the other share of T
        with pytest.raises(SecureAggregationRefusal, match="expects stage 'setup'"):
            protocol.ask(node, UNMASK, lie(protocol, [1, 2, 3], [1, 2, 3], [target]))


# --- signatures: a server cannot substitute keys or invent hospitals -----------------------------------------------
def signed_protocol(tmp_path, nodes):
    """A protocol run whose hospitals sign with their identity keys and check each other's with the consortium's
    registered keys (``peer-keys``), and a key pair the server holds that nobody registered."""
    registered, own = tmp_path / "registered", tmp_path / "server"
    registered.mkdir()
    own.mkdir()
    keys = {n: key_pair(registered, f"node-{n}") for n in nodes}
    rules = {n: HospitalRules(f"node-{n}", str(keys[n]), str(registered)) for n in nodes}
    protocol = InProcess(nodes, SecureAggregationSettings(), SIZE, rules)
    return protocol, key_pair(own, "ghost"), registered


def test_bad_signatures_and_substituted_keys_are_refused(tmp_path):
    nodes = [1, 2, 3, 4]
    protocol, server_key, registered = signed_protocol(tmp_path, nodes)
    plan = protocol.plan
    from common.trust.secure_aggregation.server import receive_public_keys

    verify = lambda name, statement, signature: statement_problem(registered, name, statement, signature)  # noqa: E731
    answers = protocol.answers(SETUP, lambda n: setup_config(plan), nodes)
    forged = {node: dict(answer) for node, answer in answers.items()}
    forged[3]["secagg.signature"] = forged[2]["secagg.signature"]
    receive_public_keys(plan, forged, verify)  # the server checks them too, with hospital-keys
    assert "setup: its public keys are not signed by its registered key" in plan.lost[3] and 3 not in plan.setup_done
    plan.lost.clear()
    receive_public_keys(plan, answers, verify)
    assert plan.setup_done == set(nodes) and not plan.lost

    # the server swaps hospital 4's key for one of its own (it could then compute 4's pairwise masks)
    _, substitute = new_key_pair()
    swapped = share_keys_config(plan, 1)
    at = swapped[NEIGHBOURS_KEY].index(4)
    swapped[PUBLIC_KEYS_KEY] = [*swapped[PUBLIC_KEYS_KEY][:2 * at], substitute, *swapped[PUBLIC_KEYS_KEY][2 * at + 1:]]
    with pytest.raises(SecureAggregationRefusal, match="neighbour 'node-4' .* not signed by its registered key"):
        protocol.ask(1, SHARE_KEYS, swapped)
    # ...and signs them with a key nobody registered, in the name of a hospital it invents
    invented = share_keys_config(plan, 2)
    at = invented[NEIGHBOURS_KEY].index(4)
    invented[NAMES_KEY][at] = "ghost"
    invented[SIGNATURES_KEY][at] = sign_statement(server_key, keys_statement(
        plan.run, plan.rnd, plan.session, 4, "ghost", *plan.public_keys[4]))
    with pytest.raises(SecureAggregationRefusal, match="no key is registered for 'ghost'"):
        protocol.ask(2, SHARE_KEYS, invented)
    # a hospital that refused keeps nothing: the run is over for it
    assert protocol.states[1].stage == UNMASK and protocol.states[1].flower.sk1 == b""


def test_per_node_lists_that_do_not_line_up_are_refused():
    """Per-node values travel as lists beside a list of nodes: a list one short (or one long) is refused, not
    read shifted (a name or signature credited to the wrong hospital)."""
    from common.trust.secure_aggregation.server import receive_public_keys

    protocol = InProcess([1, 2, 3], SecureAggregationSettings(), 10)
    plan = protocol.plan
    receive_public_keys(plan, protocol.answers(SETUP, lambda n: setup_config(plan), plan.nodes))
    short = share_keys_config(plan, 1)
    short[NAMES_KEY] = short[NAMES_KEY][:-1]
    with pytest.raises(ValueError, match="is not a name per neighbour"):
        protocol.ask(1, SHARE_KEYS, short)
    protocol = InProcess([1, 2, 3], SecureAggregationSettings(), 10)
    protocol.keys()
    for node in (1, 2, 3):
        add_masked_vector(protocol.plan, node, protocol.mask(node, np.zeros(10, np.int64)))
    receive_survivor_signatures(protocol.plan, protocol.answers(
        CONSISTENCY, lambda n: consistency_config(protocol.plan, n), [1, 2, 3]))
    request = unmask_config(protocol.plan, 2)
    request[SIGNATURES_KEY] = request[SIGNATURES_KEY] + [b""]
    with pytest.raises(SecureAggregationRefusal, match="the unmask request: .* is not a signature per survivor"):
        protocol.ask(2, UNMASK, request)


def test_the_consistency_stage_is_skipped_only_where_nobody_compares_signatures(tmp_path):
    """Without the consortium's keys a hospital checks the unmask request's survivor set as the consistency stage
    would (the stage asks for signatures nobody compares), and sums as with it; with them it reveals nothing
    before every survivor signed, so a server that skips the stage gets no share."""
    nodes = [1, 2, 3, 4]
    vectors = vectors_for(nodes, seed=3)
    protocol = InProcess(nodes, SecureAggregationSettings(), SIZE)
    protocol.keys()
    for node in nodes:
        add_masked_vector(protocol.plan, node, protocol.mask(node, vectors[node]))
    with pytest.raises(SecureAggregationRefusal, match="the survivor set leaves out this hospital"):
        protocol.ask(4, UNMASK, lie(protocol, [1, 2, 3], [1, 2, 3], []))
    assert protocol.states[4].flower.sk1 == b""  # refused: it keeps nothing
    settle_survivors(protocol.plan)  # the sum of all four, unmasked from three hospitals' shares
    answers = {n: protocol.ask(n, UNMASK, unmask_config(protocol.plan, n)) for n in (1, 2, 3)}
    np.testing.assert_array_equal(unmask_sum(protocol.plan, answers), sum(vectors.values()) % MODULUS)

    protocol, _, _ = signed_protocol(tmp_path, nodes)
    protocol.keys()
    for node in nodes:
        add_masked_vector(protocol.plan, node, protocol.mask(node, vectors[node]))
    settle_survivors(protocol.plan)
    for node in nodes:
        with pytest.raises(SecureAggregationRefusal, match="holds the consortium's keys .* consistency stage"):
            protocol.ask(node, UNMASK, unmask_config(protocol.plan, node))
        assert protocol.states[node].flower.sk1 == b""


def test_a_round_set_up_ahead_is_claimed_once_and_only_for_a_later_round_of_the_run():
    """The unmask stage of a server that compares no signatures may carry the setup of the run's next round (with
    signatures, the consistency stage does): the hospital answers it with its shares (new key pairs, nothing
    claimed), then adds to that round once, whichever setup the server uses; it sets up nothing for an earlier
    round, another run or a round it took part in."""
    from common.trust.secure_aggregation.messages import AHEAD_PREFIX
    from common.trust.secure_aggregation.server import plan_round

    nodes = [1, 2, 3]
    protocol = InProcess(nodes, SecureAggregationSettings(), SIZE)
    protocol.keys()  # round 0 of run "" (InProcess's configs name neither)
    for node in nodes:
        add_masked_vector(protocol.plan, node, protocol.mask(node, np.zeros(SIZE, np.int64)))
    settle_survivors(protocol.plan)

    def ahead(rnd, run=""):
        upcoming = plan_round(nodes, SecureAggregationSettings(), [0, rnd], SIZE, run=run, rnd=rnd)
        config = {**setup_config(upcoming), "run-name": run, "server-round": rnd}
        return upcoming, {AHEAD_PREFIX + key: value for key, value in config.items()}

    upcoming, asked = ahead(1)
    answers = {n: protocol.ask(n, UNMASK, {**unmask_config(protocol.plan, n), **(asked if n != 3 else {})})
               for n in nodes}
    assert all(f"{AHEAD_PREFIX}secagg.pk1" in answers[n] for n in (1, 2)) and not any(k.startswith(AHEAD_PREFIX)
                                                                                     for k in answers[3])
    assert protocol.states[1].stage == SETUP and protocol.states[1].session == upcoming.session
    assert protocol.states[3].stage == UNMASK  # nothing set up: it ends the run's round as before
    assert protocol.states[1].flower.pk1 not in {pk for pair in protocol.plan.public_keys.values() for pk in pair}

    # the server sets round 1 up afresh after all (another session): accepted, its keys shared, and set up once more
    # (nothing is claimed before the collect stage, where a hospital first adds to a sum); claimed there, then refused
    fresh = plan_round(nodes, SecureAggregationSettings(), [0, 1], SIZE, rnd=1)
    fresh_config = {**setup_config(fresh), "server-round": 1}
    from common.trust.secure_aggregation.server import collect_config, receive_key_shares, receive_public_keys

    receive_public_keys(fresh, {n: protocol.ask(n, SETUP, fresh_config) for n in nodes})
    receive_key_shares(fresh, {n: protocol.ask(n, SHARE_KEYS, {**share_keys_config(fresh, n), "server-round": 1})
                               for n in nodes})
    assert f"{AHEAD_PREFIX}secagg.pk1" not in protocol.ask(2, SETUP, {**setup_config(upcoming), "server-round": 1})
    protocol.ask(1, COLLECT, {**collect_config(fresh, 1), "server-round": 1}, np.zeros(SIZE, np.int64))
    with pytest.raises(SecureAggregationRefusal, match="already took part in secure aggregation for run '' round 1"):
        protocol.ask(1, SETUP, {**setup_config(upcoming), "server-round": 1})
    # an ahead setup for an earlier round or another run: nothing set up
    for rnd, run in ((0, ""), (5, "another")):
        _, asked = ahead(rnd, run)
        assert setup_ahead(asked, 1, protocol.rules[1], "", 0) == (None, {})
    # one for a round it took part in is answered (nothing secret in it), and refused where the round is claimed
    again, asked = ahead(1)
    answered = {}
    for node in nodes:
        protocol.states[node], answered[node] = setup_ahead(asked, node, protocol.rules[node], "", 0)
    receive_public_keys(again, {n: {k[len(AHEAD_PREFIX):]: v for k, v in a.items()} for n, a in answered.items()})
    with pytest.raises(SecureAggregationRefusal, match="already took part in secure aggregation for run '' round 1"):
        protocol.ask(1, SHARE_KEYS, {**share_keys_config(again, 1), "server-round": 1})


def test_with_signatures_a_split_view_is_refused_at_the_unmask_stage(tmp_path):
    """Hospital 3 is told a survivor set that only it signed: it needs every survivor's signature on its set and
    refuses; the others, told the full set, which hospital 3 did not sign, refuse too: with the consortium's keys
    nobody unmasks a sum whose survivors were not all shown the same set (and the same round plan)."""
    nodes = [1, 2, 3, 4]
    protocol, _, _ = signed_protocol(tmp_path, nodes)
    plan = protocol.plan
    protocol.keys()
    assert plan.setup_done == set(nodes) and plan.keyed == set(nodes)
    vectors = vectors_for(nodes, seed=9)
    for node in nodes:
        add_masked_vector(plan, node, protocol.mask(node, vectors[node]))
    signatures = {node: protocol.ask(node, CONSISTENCY, {SURVIVORS_KEY: nodes, SESSION_KEY: plan.session})
                  for node in (1, 2, 4)}
    alone = protocol.ask(3, CONSISTENCY, {SURVIVORS_KEY: [1, 2, 3], SESSION_KEY: plan.session})
    signed = {n: s["secagg.signature"] for n, s in signatures.items()}
    request = lie(protocol, [1, 2, 3], [1, 2, 3], [4], {**signed, 3: alone["secagg.signature"]})
    with pytest.raises(SecureAggregationRefusal, match="1 of the 3 survivors signed the survivor set"):
        protocol.ask(3, UNMASK, request)
    full = lie(protocol, nodes, nodes, [], signed)
    forged = lie(protocol, nodes, nodes, [], {**signed, 2: alone["secagg.signature"]})  # 3's passed off as 2's
    with pytest.raises(SecureAggregationRefusal, match=r"2 of the 4 survivors signed .* nodes \[2, 3\]"):
        protocol.ask(1, UNMASK, forged)
    with pytest.raises(SecureAggregationRefusal, match=r"3 of the 4 survivors signed .* nodes \[3\]"):
        protocol.ask(2, UNMASK, full)  # hospital 3 signed another set: no share of anyone leaves


# --- replays ---------------------------------------------------------------------------------------------------------
def shared_state(tmp_path, name, **extra):
    """A run config whose hospitals keep their state in one folder whatever the run's name (their state folder)."""
    return config_of(tmp_path, SMALL_CLASSIFICATION, name, **{"state-dir": str(tmp_path / "hospitals"), **extra})


def test_a_round_run_again_is_refused_by_every_hospital_and_logged_at_both_ends(tmp_path, caplog):
    config = shared_state(tmp_path, "again")
    first = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    first.start(FakeGrid(secure_hospitals(config, 3)), num_rounds=1)
    assert "skipped" not in first.engine.history[0]

    again = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config={**config, "overwrite-run": True})
    before = arrays_of(again.initial_arrays())
    grid = FakeGrid(secure_hospitals(config, 3))  # restarted hospitals: a fresh context, the same state folder
    again.start(grid, num_rounds=1)
    assert "change run-name and seed" in again.nothing_aggregated  # what to change, said by the server
    assert "or give the hospitals fresh state folders (state-dir)" in again.nothing_aggregated
    record = again.engine.history[0]
    assert "skipped" in record and "after the setup stage" in record["skipped"]
    lost = record["secure-aggregation"]["lost"]
    assert sorted(lost) == ["hospital-00", "hospital-01", "hospital-02"]
    assert all("already took part in secure aggregation for run 'again' round 1" in why for why in lost.values())
    assert not [m for m in grid.sent_of_type(MessageType.TRAIN) if stage_of(m) == COLLECT]  # nothing trained
    for name, value in again.engine.method.global_arrays.items():
        np.testing.assert_array_equal(value, before[name])
    server_lines = [r for r in caplog.records if r.levelname == "WARNING" and "lost hospital-00 at the setup" in
                    r.getMessage()]
    hospital_lines = [r for r in caplog.records if r.levelname == "ERROR" and "hospital partition 0" in
                      r.getMessage() and "already took part" in r.getMessage()]
    assert server_lines and hospital_lines


def test_the_same_model_under_a_new_run_name_is_not_trained_again(tmp_path, caplog):
    """The issue's replay: round 1 again, under a new run name, without hospital-00; the difference of the two sums
    would be hospital-00's update. The others revealed shares for a sum trained from that model and refuse to train
    from it again; the second sum never exists."""
    config = shared_state(tmp_path, "first")
    first = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    first.start(FakeGrid(secure_hospitals(config, 3)), num_rounds=1)
    assert "skipped" not in first.engine.history[0]

    replay = shared_state(tmp_path, "second-look")
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=replay)
    nodes = {101 + pid: secure_node(replay, {"partition-id": pid, "num-partitions": 3}, 101 + pid) for pid in (1, 2)}
    grid = FakeGrid(nodes)
    strategy.start(grid, num_rounds=1)
    assert "already helped unmask a sum trained from this model" in strategy.nothing_aggregated
    assert "the same seed starts from the same model" in strategy.nothing_aggregated
    record = strategy.engine.history[0]
    assert "skipped" in record and record["aggregated"] == []
    assert sorted(record["refused"]) == ["hospital-01", "hospital-02"]
    assert all("already helped unmask a sum trained from this model (run 'first' round 1" in why
               for why in record["refused"].values())
    assert not [m for m in grid.sent_of_type(MessageType.TRAIN) if stage_of(m) in (CONSISTENCY, UNMASK)]
    assert "refused the update of hospital-01" in caplog.text


def test_a_round_skipped_before_unmasking_does_not_block_the_next(tmp_path):
    """An honest server's skipped round sends the same model again: hospitals that revealed nothing for it train."""
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "skip")
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config,
                                                       secure_aggregation={"reconstruction-threshold": 3})
    nodes = secure_hospitals(config, 3)
    answer, rounds = nodes[103], []

    def silent_in_round_one(message):
        if stage_of(message) == COLLECT and message.content["config"]["server-round"] == 1:
            return None
        return answer(message)

    nodes[103] = silent_in_round_one
    strategy.start(FakeGrid(nodes), num_rounds=2)
    rounds = strategy.engine.history
    assert "fewer than 3" in rounds[0]["skipped"]
    assert "skipped" not in rounds[1] and rounds[1]["aggregated"] == ["hospital-00", "hospital-01", "hospital-02"]


# --- a hospital's policy --------------------------------------------------------------------------------------------
def policy_file(tmp_path, text, name="policy.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_plain_request_is_refused_under_require_secure_aggregation(tmp_path):
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "plain")
    policy = policy_file(tmp_path, "require-secure-aggregation = true\n")
    strategy = FedAvgStrategy(min_train_nodes=2, run_config=config)
    before = arrays_of(strategy.initial_arrays())
    grid = FakeGrid(simulated_hospitals(config, 2, **{"policy-file": policy}))
    strategy.start(grid, num_rounds=1)
    assert "require-secure-aggregation" in strategy.nothing_aggregated
    record = strategy.engine.history[0]
    assert sorted(record["refused"]) == ["hospital-00", "hospital-01"]
    assert all("require-secure-aggregation" in why for why in record["refused"].values())
    trained = [m for m in grid.replies if m.metadata.message_type == MessageType.TRAIN]
    assert trained and all(m.has_error() for m in trained)  # no model left a hospital
    for name, value in strategy.engine.method.global_arrays.items():
        np.testing.assert_array_equal(value, before[name])


def test_a_weaker_plan_is_refused_by_a_hospitals_policy(tmp_path, caplog):
    """hospital-00's policy asks for at least 4 hospitals in a sum: it refuses the round of 3 at setup, with its
    reason logged at both ends; the other two go on without it. A threshold of 3 of 5 shares is refused under
    min-threshold-fraction = 0.7."""
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "weak")
    strict = policy_file(tmp_path, "min-hospitals-per-sum = 4\n")
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    nodes = secure_hospitals(config, 3)
    nodes[101] = secure_node(config, {"partition-id": 0, "num-partitions": 3, "policy-file": strict}, 101)
    strategy.start(FakeGrid(nodes), num_rounds=1)
    record = strategy.engine.history[0]
    why = record["secure-aggregation"]["lost"]["hospital-00"]
    assert "the round has 3 hospitals, fewer than its policy's min-hospitals-per-sum=4" in why
    assert "skipped" not in record and record["aggregated"] == ["hospital-01", "hospital-02"]
    assert "min-hospitals-per-sum=4" in caplog.text

    protocol = InProcess([1, 2, 3, 4, 5], SecureAggregationSettings(), 10)
    assert protocol.plan.threshold == 3
    protocol.rules[1].min_threshold_fraction = 0.7
    with pytest.raises(SecureAggregationRefusal, match="threshold 3 is not more than 0.7 of its 5 shares"):
        protocol.ask(1, SETUP, setup_config(protocol.plan))
    protocol.ask(2, SETUP, setup_config(protocol.plan))  # the default rule: 3 > 2.5


def test_metrics_leave_in_the_clear_only_as_the_policy_allows(tmp_path):
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "metrics")
    quiet = policy_file(tmp_path, 'release-metrics = "validation"\n')
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    nodes = secure_hospitals(config, 3)
    nodes[101] = secure_node(config, {"partition-id": 0, "num-partitions": 3, "policy-file": quiet}, 101)
    grid = FakeGrid(nodes)
    strategy.start(grid, num_rounds=1)
    assert "skipped" not in strategy.engine.history[0]
    replies = {m.metadata.src_node_id: from_recorddict(m.content) for m in masked_replies(grid)}
    withheld = set(replies[101].metrics) - {"num-examples", "server-round"}
    assert withheld and all(key.startswith("val-") for key in withheld) and "device" not in replies[101].config
    for key in ("hospital-seconds", "secagg-clipped", "secagg-seconds"):
        assert key in replies[102].metrics and key not in replies[101].metrics
    assert "device" in replies[102].config


# --- a hostile share -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["one-byte-short", "one-bit-flipped"])
def test_a_malformed_share_is_found_named_and_the_round_completes(tmp_path, damage):
    plain_config = config_of(tmp_path, SMALL_CLASSIFICATION, "plain")
    expected = arrays_of(FedAvgStrategy(min_train_nodes=2, run_config=plain_config).start(
        FakeGrid(plain_hospitals(plain_config, 3)), num_rounds=1).arrays)

    def hostile(stage, reply):
        if stage == UNMASK:
            shares = list(reply.content["config"]["secagg.shares"])
            share = bytearray(shares[0])
            if damage == "one-byte-short":
                share = share[:-1]
            else:
                share[-1] ^= 1
            shares[0] = bytes(share)
            reply.content["config"]["secagg.shares"] = shares

    config = config_of(tmp_path, SMALL_CLASSIFICATION, "hostile")
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    nodes = secure_hospitals(config, 3)
    nodes[103] = secure_node(config, {"partition-id": 2, "num-partitions": 3}, 103, tamper_reply=hostile)
    final = arrays_of(strategy.start(FakeGrid(nodes), num_rounds=1).arrays)
    record = strategy.engine.history[0]
    assert "skipped" not in record and record["aggregated"] == ["hospital-00", "hospital-01", "hospital-02"]
    hostile_shares = record["secure-aggregation"]["hostile-shares"]
    assert list(hostile_shares) == ["hospital-02"]
    assert "is not the one hospital-00 committed to" in hostile_shares["hospital-02"]
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, atol=3 * STEP + 1e-6, err_msg=name)


def test_unmasking_names_every_share_that_does_not_fit():
    """Seven hospitals (threshold 4), hospital 7's seed: three of the six other holders send the same bit altered
    (which cancels out of some combinations: only the owner's digests tell who changed a share). The sum is right
    and each of the three is named, nobody else."""
    nodes = list(range(1, 8))
    vectors = vectors_for(nodes, seed=11)
    protocol = InProcess(nodes, SecureAggregationSettings(), SIZE)
    plan = protocol.plan
    assert plan.threshold == 4
    protocol.keys()
    for node in nodes:
        add_masked_vector(plan, node, protocol.mask(node, vectors[node]))
    receive_survivor_signatures(plan, protocol.answers(CONSISTENCY, lambda n: consistency_config(plan, n), nodes))
    answers = protocol.answers(UNMASK, lambda n: unmask_config(plan, n), nodes)
    for holder in (2, 5, 6):
        shares = answers[holder]["secagg.shares"]
        index = answers[holder]["secagg.nids"].index(7)
        altered = bytearray(shares[index])
        altered[10] ^= 0x40
        shares[index] = bytes(altered)
    np.testing.assert_array_equal(unmask_sum(plan, answers), sum(vectors.values()) % MODULUS)
    assert sorted(plan.hostile) == [2, 5, 6]
    assert all("share of node-7's mask seed is not the one node-7 committed to" in why for why in plan.hostile.values())


def test_a_holder_refuses_a_share_its_sender_did_not_commit_to():
    """Each owner commits to the digest of every share; a holder checks its own on receipt, so a share changed on
    the way (or an owner committing to other shares than it sent) stops the holder before it masks anything, and
    a share changed later can only be its holder's."""
    protocol = InProcess([1, 2, 3], SecureAggregationSettings(), 10)
    protocol.keys()
    config = collect_config(protocol.plan, 1)
    config["secagg.share-digests"] = [bytes(64)] + config["secagg.share-digests"][1:]
    with pytest.raises(SecureAggregationRefusal, match="not the ones it committed to"):
        protocol.ask(1, COLLECT, config, np.zeros(10))
    assert protocol.states[1].flower.rd_seed == b""  # it keeps nothing of the run


# --- a signed round over the grid ------------------------------------------------------------------------------------
def test_a_signed_round_over_the_grid(tmp_path):
    """Identity keys at the hospitals, the consortium's keys on both sides: the round runs and sums as unsigned."""
    registered = tmp_path / "registered"
    registered.mkdir()
    keys = {pid: key_pair(registered, f"hospital-{pid:02d}") for pid in range(3)}
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "signed", **{"hospital-keys": str(registered)})
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    nodes = {101 + pid: secure_node(config, {"partition-id": pid, "num-partitions": 3, "identity-key": str(keys[pid]),
                                             "peer-keys": str(registered)}, 101 + pid) for pid in range(3)}
    grid = FakeGrid(nodes)
    strategy.start(grid, num_rounds=1)
    record = strategy.engine.history[0]
    assert "skipped" not in record and record["secure-aggregation"]["hospitals-in-sum"] == 3
    assert record["secure-aggregation"]["lost"] == {}
    signed = [m for m in grid.replies if not m.has_error() and m.content.config_records.get("config", {}).get(
        "secagg.stage") == CONSISTENCY]
    assert len(signed) == 3 and all(len(m.content["config"]["secagg.signature"]) > 0 for m in signed)

    # the same hospitals, a server without the registered keys: it checks no signature and skips the stage that
    # collects them, and hospitals holding the consortium's keys reveal no share
    config = config_of(tmp_path, SMALL_CLASSIFICATION, "unsigned-server")
    strategy = with_secure_aggregation(FedAvgStrategy)(min_train_nodes=2, run_config=config)
    nodes = {101 + pid: secure_node(config, {"partition-id": pid, "num-partitions": 3, "identity-key": str(keys[pid]),
                                             "peer-keys": str(registered)}, 101 + pid) for pid in range(3)}
    strategy.start(FakeGrid(nodes), num_rounds=1)
    secure = strategy.engine.history[0]["secure-aggregation"]
    assert "consistency_check" not in secure["stages"] and "skipped" in strategy.engine.history[0]
    assert all("which the server skipped (it runs it with run config hospital-keys)" in why
               for why in secure["lost"].values()) and len(secure["lost"]) == 3
