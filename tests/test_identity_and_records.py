"""Identities and signed records, without the network."""

import time

import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from swarmgrad.dht.identity import Identity, peer_id_from_public_key
from swarmgrad.dht.membership import MemberRecord, members_key
from swarmgrad.dht.records import MAX_RECORD_BYTES, RecordError, SignedRecordValidator, open_envelope, seal
from swarmgrad.errors import ConfigError


def member_body(**changes) -> MemberRecord:
    fields = dict(maddrs=["/ip4/127.0.0.1/tcp/1"], role="peer", version="0.1.0", step=3, samples_per_second=1.5,
                  updated_at=time.time())
    fields.update(changes)
    return MemberRecord(**fields)


def dht_record(key: str, owner: str, envelope: bytes, expires: float) -> DHTRecord:
    return DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(owner),
                     MSGPackSerializer.dumps(envelope), expires)


def test_identity_roundtrip_keeps_peer_id(tmp_path):
    identity = Identity.generate()
    identity.save(tmp_path / "id.key")
    assert (tmp_path / "id.key").stat().st_mode & 0o077 == 0  # private key readable by the owner only
    loaded = Identity.load(tmp_path / "id.key")
    assert loaded.peer_id == identity.peer_id
    assert identity.peer_id.startswith("12D3KooW")
    assert peer_id_from_public_key(identity.public_key) == identity.peer_id


def test_identity_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read identity file"):
        Identity.load(tmp_path / "missing.key")
    (tmp_path / "junk.key").write_bytes(b"not a key")
    with pytest.raises(ConfigError, match="not a swarmgrad/libp2p Ed25519 key"):
        Identity.load(tmp_path / "junk.key")
    Identity.generate().save(tmp_path / "taken.key")
    with pytest.raises(ConfigError, match="already exists"):
        Identity.generate().save(tmp_path / "taken.key")


def test_sealed_record_opens_and_validates():
    owner = Identity.generate()
    key, expires = members_key("run"), time.time() + 30
    envelope = seal(owner, key, member_body(), expires)
    opened = open_envelope(envelope)
    assert opened.owner == owner.peer_id and opened.key == key and opened.body.step == 3
    assert SignedRecordValidator().validate(dht_record(key, owner.peer_id, envelope, expires))


def test_record_signed_by_another_key_is_rejected():
    owner, forger = Identity.generate(), Identity.generate()
    key, expires = members_key("run"), time.time() + 30
    validator = SignedRecordValidator()
    # the forger's own valid record, filed in the owner's slot
    forged = seal(forger, key, member_body(), expires)
    assert not validator.validate(dht_record(key, owner.peer_id, forged, expires))
    # the owner's record with a changed body keeps the owner's signature, which no longer verifies
    fields = msgpack.unpackb(seal(owner, key, member_body(), expires))
    fields["body"] = msgpack.packb(member_body(step=999).model_dump())
    tampered = msgpack.packb(fields)
    with pytest.raises(RecordError, match="signature"):
        open_envelope(tampered)
    assert not validator.validate(dht_record(key, owner.peer_id, tampered, expires))


def test_malformed_oversized_expired_and_misfiled_records_are_rejected():
    owner = Identity.generate()
    key, expires = members_key("run"), time.time() + 30
    validator = SignedRecordValidator()
    for junk in (b"", b"\xc1\xff", msgpack.packb([1, 2, 3]), msgpack.packb({"v": 1})):
        assert not validator.validate(dht_record(key, owner.peer_id, junk, expires))
    assert not validator.validate(dht_record(key, owner.peer_id, b"x" * (MAX_RECORD_BYTES + 1), expires))
    with pytest.raises(RecordError, match="exceeds"):
        open_envelope(b"x" * (MAX_RECORD_BYTES + 1))
    expired = seal(owner, key, member_body(), time.time() - 1)
    assert not validator.validate(dht_record(key, owner.peer_id, expired, time.time() + 30))
    valid = seal(owner, key, member_body(), expires)
    assert not validator.validate(dht_record(members_key("other-run"), owner.peer_id, valid, expires))
    assert not validator.validate(dht_record(key, owner.peer_id, valid, expires + 100))  # expiry stretched


def test_schema_violations_are_rejected():
    owner = Identity.generate()
    key, expires = members_key("run"), time.time() + 30
    fields = msgpack.unpackb(seal(owner, key, member_body(), expires))
    for bad_body in ({"role": "peer"}, {**member_body().model_dump(), "step": -1},
                     {**member_body().model_dump(), "role": "admin"},
                     {**member_body().model_dump(), "samples_per_second": float("nan")}):
        fields["body"] = msgpack.packb(bad_body)
        fields["sig"] = owner.sign(_signed(fields))
        with pytest.raises(RecordError, match="schema"):
            open_envelope(msgpack.packb(fields))


def _signed(fields):
    return msgpack.packb({name: value for name, value in fields.items() if name != "sig"}, use_bin_type=True)
