"""Membership tickets of private runs (dht/tickets.py), the admission that reads them
(net/admission.py), the manifest's run key and `swarmgrad run grant`. No network here:
tests/peer/test_private_run.py has the real peers."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import swarmgrad as sg
from swarmgrad.dht.identity import Identity
from swarmgrad.dht.tickets import Ticket
from swarmgrad.errors import ConfigError, StartupError
from swarmgrad.net.admission import Admission
from swarmgrad.peer.manifest import RunManifest, check_admission, settle_run

SWARMGRAD = [sys.executable, "-m", "swarmgrad"]
RUN = "private-run"


@pytest.fixture
def run_key() -> Identity:
    return Identity.generate()


@pytest.fixture
def peer() -> str:
    return Identity.generate().peer_id


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and message
    return message


def test_a_ticket_round_trips_through_its_file_and_admits_its_peer_only(run_key, peer, tmp_path):
    ticket = Ticket.issue(run_key, peer, run_id=RUN, expires=time.time() + 60)
    ticket.save(tmp_path / "t.json")
    loaded = Ticket.load(tmp_path / "t.json")
    assert loaded == ticket and loaded.run_key == run_key.public_key.hex()
    loaded.check(ticket.run_key, RUN, peer)
    assert "not this run's" in loaded.problem(Identity.generate().public_key.hex(), RUN, peer)
    assert "not 'other-run'" in loaded.problem(ticket.run_key, "other-run", peer)
    assert "is for peer" in loaded.problem(ticket.run_key, RUN, Identity.generate().peer_id)
    assert "expired" in loaded.problem(ticket.run_key, RUN, peer, now=time.time() + 120)
    any_run = Ticket.issue(run_key, peer)  # no run id: every run of the key
    assert any_run.problem(any_run.run_key, "whatever", peer) is None and any_run.expires is None


def _altered(ticket: Ticket, **changes) -> str:
    fields = json.loads(ticket.to_json())
    fields.update(changes)
    return json.dumps(fields)


@pytest.mark.parametrize("make, fragment", [
    (lambda t: "not json{", "not JSON"),
    (lambda t: "[1, 2]", "exactly the fields"),
    (lambda t: _altered(t, extra=1), "exactly the fields"),
    (lambda t: _altered(t, v=2), "ticket version 2"),
    (lambda t: _altered(t, run_key="zz"), "64 lowercase hex digits"),
    (lambda t: _altered(t, peer_id=7), "peer_id must be a string"),
    (lambda t: _altered(t, expires="soon"), "expires must be a unix time"),
    (lambda t: _altered(t, run_id=["a"]), "run_id must be a string or null"),
    (lambda t: _altered(t, sig="%%%"), "signature does not verify"),
    (lambda t: _altered(t, run_id="another-run"), "signature does not verify"),  # altered after signing
    (lambda t: _altered(t, peer_id=Identity.generate().peer_id), "signature does not verify"),
    (lambda t: _altered(t, run_key=Identity.generate().public_key.hex()), "signature does not verify"),
    (lambda t: "x" * 5000, "at most 1024"),
])
def test_each_malformed_or_forged_ticket_is_a_one_line_config_error(run_key, peer, tmp_path, make, fragment):
    path = tmp_path / "bad.json"
    path.write_text(make(Ticket.issue(run_key, peer, run_id=RUN)))
    with pytest.raises(ConfigError) as error:
        Ticket.load(path)
    assert fragment in one_line(error) and str(path) in str(error.value)


def test_missing_ticket_and_run_key_files_and_bad_peer_ids_are_one_line_errors(tmp_path, run_key):
    from swarmgrad.dht.tickets import load_run_key

    with pytest.raises(ConfigError) as error:
        Ticket.load(tmp_path / "none.json")
    assert "cannot read ticket file" in one_line(error)
    (tmp_path / "junk.key").write_bytes(b"junk")
    with pytest.raises(ConfigError) as error:
        load_run_key(tmp_path / "junk.key")
    assert "run key file" in one_line(error)
    with pytest.raises(ConfigError) as error:
        Ticket.issue(run_key, "12D3KooWnotapeer")
    assert "is not a swarmgrad peer id" in one_line(error)


def test_admission_takes_records_with_a_valid_ticket_only_and_counts_the_rest(run_key, peer):
    key = run_key.public_key.hex()
    admission = Admission(RUN, key)
    stranger, other_key = Identity.generate().peer_id, Identity.generate()
    assert not admission.admits(peer)
    assert admission.admit_record(peer, Ticket.issue(run_key, peer, run_id=RUN).to_json())
    assert admission.admits(peer)
    refused = [
        (stranger, None),  # no ticket
        (stranger, Ticket.issue(run_key, peer, run_id=RUN).to_json()),  # another peer's ticket
        (stranger, Ticket.issue(other_key, stranger, run_id=RUN).to_json()),  # another run key's
        (stranger, Ticket.issue(run_key, stranger, run_id="other").to_json()),  # another run's
        (stranger, Ticket.issue(run_key, stranger, expires=time.time() - 1).to_json()),  # expired
        (stranger, "garbage"),
    ]
    for owner, ticket in refused:
        assert not admission.admit_record(owner, ticket)
    assert admission.refused_records == len(refused) and admission.refused_peers == {stranger}
    assert not admission.admits(stranger)
    assert Admission(RUN).admits(stranger) and Admission(RUN).admit_record(stranger, None)  # a public run


def test_an_admitted_peer_is_dropped_when_its_ticket_expires(run_key, peer):
    admission = Admission(RUN, run_key.public_key.hex())
    assert admission.admit_record(peer, Ticket.issue(run_key, peer, expires=time.time() + 0.2).to_json())
    assert admission.admits(peer)
    admission._admitted[peer] = time.time() - 1  # as the clock passes its expiry
    assert not admission.admits(peer)


def test_a_ticket_makes_a_created_run_private_and_joining_checks_the_runs_key(run_key, peer):
    config = sg.RunConfig(task="digits")
    ticket = Ticket.issue(run_key, peer, run_id=RUN)
    _, manifest = settle_run(RUN, config, None, create=True, fingerprint=lambda task: None, ticket=ticket)
    assert manifest.run_key == ticket.run_key
    public = RunManifest.create(config, None)
    assert public.run_key is None and manifest.digest != public.digest
    settle_run(RUN, sg.RunConfig(), manifest, create=False, fingerprint=lambda task: None, ticket=ticket)
    problems = [
        (manifest, None, "is private"),
        (public, ticket, "is public"),
        (manifest, Ticket.issue(Identity.generate(), peer), "not run 'private-run''s"),
        (manifest, Ticket.issue(run_key, peer, run_id="other"), "is for run 'other'"),
    ]
    for found, carried, fragment in problems:
        with pytest.raises(StartupError) as error:
            check_admission(RUN, found, carried)
        assert fragment in one_line(error)
    check_admission(RUN, public, None)
    check_admission(RUN, None, ticket)  # no manifest to check against: the ticket's key decides


def test_a_manifest_with_a_malformed_run_key_is_rejected(run_key):
    with pytest.raises(ConfigError) as error:
        RunManifest.create(sg.RunConfig(task="digits"), None, run_key="ABC")
    assert "64 lowercase hex digits" in one_line(error)
    with pytest.raises(Exception):  # a record body with one is rejected by its schema
        RunManifest(task="digits", settings="{}", version="0", created_at=0.0, run_key="x" * 64)


def test_cli_run_grant_writes_a_ticket_that_verifies(tmp_path):
    key_file, peer_file = tmp_path / "run.key", tmp_path / "peer.key"
    keygen = subprocess.run([*SWARMGRAD, "keygen", str(peer_file)], capture_output=True, text=True, check=True)
    peer_id = keygen.stdout.strip()
    Identity.generate().save(key_file)
    run_key = Identity.load(key_file).public_key.hex()
    out = tmp_path / "peer.ticket"
    result = subprocess.run([*SWARMGRAD, "run", "grant", "--run-key", str(key_file), peer_id, "--run-id", RUN,
                             "--expires", "3600", "-o", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    ticket = Ticket.load(out)
    ticket.check(run_key, RUN, peer_id)
    assert 3590 < ticket.expires - time.time() <= 3600
    printed = subprocess.run([*SWARMGRAD, "run", "grant", "-k", str(key_file), peer_id], capture_output=True, text=True)
    assert printed.returncode == 0 and Ticket.from_json(printed.stdout.strip()).run_id is None
    for args, fragment in [(["-k", str(tmp_path / "none.key"), peer_id], "cannot read run key file"),
                           (["-k", str(key_file), "12D3KooWbad"], "is not a swarmgrad peer id"),
                           (["-k", str(key_file), peer_id, "--run-id", "bad id!"], "run id 'bad id!' is invalid")]:
        bad = subprocess.run([*SWARMGRAD, "run", "grant", *args], capture_output=True, text=True)
        errors = [line for line in bad.stderr.splitlines() if line.startswith("error: ")]
        assert bad.returncode == 2 and len(errors) == 1 and fragment in errors[0], bad.stderr
        assert "Traceback" not in bad.stderr


def test_cli_run_help_explains_private_runs():
    result = subprocess.run([*SWARMGRAD, "run", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "ticket" in result.stdout and "grant" in result.stdout
    grant = subprocess.run([*SWARMGRAD, "run", "grant", "--help"], capture_output=True, text=True)
    assert "--run-key" in grant.stdout and "--expires" in grant.stdout and "PEER_ID" in grant.stdout


def test_a_ticket_holder_reads_only_the_manifests_of_its_run_key(run_key):
    """Forged public manifests, even a majority, cannot make a ticket holder's private run look public."""
    from types import SimpleNamespace

    from conftest import run_async

    from swarmgrad.peer.manifest import read_manifest

    config = sg.RunConfig(task="digits")
    key = run_key.public_key.hex()
    private = RunManifest.create(config, None, run_key=key)
    forged = [RunManifest.create(config, None) for _ in range(3)]

    class Node:
        async def get_records(self, _key, _body_type):
            return {f"peer{i}": SimpleNamespace(body=body) for i, body in enumerate([private, *forged])}

    assert run_async(read_manifest(Node(), RUN)).run_key is None  # without a ticket: the majority
    assert run_async(read_manifest(Node(), RUN, key)) == private
    other = Identity.generate().public_key.hex()  # a key no manifest names: the majority, which check_admission refuses
    assert run_async(read_manifest(Node(), RUN, other)).run_key is None
