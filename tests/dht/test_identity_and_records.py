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


# ---- every refusal names its reason (open_envelope, the DHT validator) ----------------------------

NOW = 1_000_000.0
KEY = members_key("run")


def envelope_fields(owner: Identity, valid_until: float = NOW + 30, **changes) -> dict:
    fields = msgpack.unpackb(seal(owner, KEY, member_body(), valid_until))
    fields.update(changes)
    fields["sig"] = owner.sign(_signed(fields))  # re-signed: only the change is wrong
    return fields


def test_open_envelope_reads_back_everything_that_was_sealed():
    owner = Identity.generate()
    opened = open_envelope(seal(owner, KEY, member_body(step=7), NOW + 30), now=NOW)
    assert (opened.key, opened.owner, opened.expires, opened.body.step) == (KEY, owner.peer_id, NOW + 30, 7)
    assert isinstance(opened.expires, float)
    # a kind this process has no schema for: accepted on its envelope alone, body unparsed
    fields = envelope_fields(owner, kind="future-kind", body=b"\x01\x02")
    unknown = open_envelope(msgpack.packb(fields), now=NOW, known_kind=False)
    assert (unknown.key, unknown.owner, unknown.expires, unknown.body) == (KEY, owner.peer_id, NOW + 30, None)
    with pytest.raises(RecordError, match="^unknown record kind 'future-kind'$"):
        open_envelope(msgpack.packb(fields), now=NOW)  # known kinds only, by default


@pytest.mark.parametrize("changes, message", [
    ({"v": 2}, "^unsupported record version 2$"),
    ({"kind": 7}, "^unknown record kind 7$"),
    ({"kind": [1]}, r"^unknown record kind \[1\]$"),  # not even hashable
    ({"kind": "k" * 33}, "^unknown record kind 'k{33}'$"),
    ({"key": b"run"}, "^record field 'key' must be str$"),
    ({"subkey": 5}, "^record field 'subkey' must be str$"),
    ({"expires": 5}, "^record field 'expires' must be float$"),
    ({"body": "text"}, "^record field 'body' must be bytes$"),
    ({"pub": "text"}, "^record field 'pub' must be bytes$"),
    ({"subkey": "12D3KooWsomeoneelse"}, "^record subkey is not the signer's peer id$"),
    ({"expires": NOW}, "^record has expired$"),
    ({"expires": float("nan")}, "^record has expired$"),
    ({"expires": NOW + 600 + 60 + 1}, "^record expiry is more than 600 s ahead$"),
])
def test_each_bad_envelope_is_refused_with_its_reason(changes, message):
    fields = envelope_fields(Identity.generate(), **changes)
    with pytest.raises(RecordError, match=message):
        open_envelope(msgpack.packb(fields), now=NOW, known_kind=False)  # the validator's way: the strictest checks


def test_expiry_limits_are_inclusive_where_they_say_so():
    owner = Identity.generate()
    for expires in (NOW + 1e-3, NOW + 600 + 60):  # just alive; exactly at the member kind's TTL + skew
        assert open_envelope(seal(owner, KEY, member_body(), expires), now=NOW).expires == expires
    unknown = envelope_fields(owner, valid_until=NOW + 3600 + 60, kind="future-kind")
    assert open_envelope(msgpack.packb(unknown), now=NOW, known_kind=False).body is None
    unknown = envelope_fields(owner, valid_until=NOW + 3600 + 61, kind="future-kind")
    with pytest.raises(RecordError, match="^record expiry is more than 3600 s ahead$"):
        open_envelope(msgpack.packb(unknown), now=NOW, known_kind=False)
    longest = envelope_fields(owner, valid_until=NOW + 3600, kind="k" * 32)  # the longest kind name
    assert open_envelope(msgpack.packb(longest), now=NOW, known_kind=False).owner == owner.peer_id


def test_envelope_structure_errors_name_what_is_wrong():
    owner = Identity.generate()
    with pytest.raises(RecordError, match="^record must be bytes, got str$"):
        open_envelope("text")  # type: ignore[arg-type]
    with pytest.raises(RecordError, match=f"^record of {MAX_RECORD_BYTES + 1} bytes exceeds the {MAX_RECORD_BYTES}-byte limit$"):
        open_envelope(b"x" * (MAX_RECORD_BYTES + 1))
    with pytest.raises(RecordError, match="^record is not msgpack: "):
        open_envelope(b"\xc1")
    with pytest.raises(RecordError, match="^record is not msgpack: "):  # an inner string past the limit
        open_envelope(b"\xdb" + (MAX_RECORD_BYTES + 1).to_bytes(4, "big"))
    fields = envelope_fields(owner)
    del fields["pub"]
    with pytest.raises(RecordError, match="^record envelope must have exactly the fields body, expires, key, kind, "
                                          "pub, sig, subkey, v$"):
        open_envelope(msgpack.packb(fields))
    fields = envelope_fields(owner)
    fields["sig"] = "text"
    with pytest.raises(RecordError, match="^record field 'sig' must be bytes$"):
        open_envelope(msgpack.packb(fields), now=NOW)
    fields = envelope_fields(owner)
    fields["sig"] = bytes(64)
    with pytest.raises(RecordError, match="^record signature does not verify$"):
        open_envelope(msgpack.packb(fields), now=NOW)
    fields = envelope_fields(owner, pub=b"short")
    with pytest.raises(RecordError, match="public key"):
        open_envelope(msgpack.packb(fields), now=NOW)


def test_a_record_exactly_at_the_size_limit_is_kept():
    owner = Identity.generate()
    length = MAX_RECORD_BYTES
    while True:  # the longest key that still fits
        try:
            padded = seal(owner, "k" * length, member_body(), NOW + 30)
            break
        except RecordError:
            length -= 1
    assert len(padded) == MAX_RECORD_BYTES
    assert open_envelope(padded, now=NOW).owner == owner.peer_id
    with pytest.raises(RecordError, match=f"^record of {MAX_RECORD_BYTES + 1} bytes exceeds the {MAX_RECORD_BYTES}-byte limit$"):
        seal(owner, "k" * (length + 1), member_body(), NOW + 30)


def test_the_validator_says_why_it_refused(caplog):
    owner = Identity.generate()
    expires = time.time() + 30
    envelope = seal(owner, KEY, member_body(), expires)
    cases = [
        (dht_record(members_key("other"), owner.peer_id, envelope, expires),
         "record is filed under a different key than it was signed for"),
        (dht_record(KEY, Identity.generate().peer_id, envelope, expires),
         "record is filed under a different subkey than its owner"),
        (dht_record(KEY, owner.peer_id, envelope, expires + 1), "DHT expiration is later than the signed expiry"),
        (DHTRecord(DHTID.generate(source=KEY).to_bytes(), MSGPackSerializer.dumps(owner.peer_id),
                   b"x" * (MAX_RECORD_BYTES + 17), expires),
         f"value of {MAX_RECORD_BYTES + 17} bytes exceeds the {MAX_RECORD_BYTES}-byte limit"),
    ]
    validator = SignedRecordValidator()
    for record, reason in cases:
        caplog.clear()
        with caplog.at_level("INFO", logger="swarmgrad.dht.records"):
            assert validator.validate(record) is False
        assert caplog.messages == [f"rejected DHT record: {reason}"]
    # not even msgpack: another exception type, still a refusal, never a crash
    caplog.clear()
    with caplog.at_level("INFO", logger="swarmgrad.dht.records"):
        assert validator.validate(DHTRecord(DHTID.generate(source=KEY).to_bytes(),
                                            MSGPackSerializer.dumps(owner.peer_id), b"\xc1", expires)) is False
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith("rejected DHT record (")
    assert caplog.messages[0] != "rejected DHT record (%s: %s)"
    # a record of a kind only newer peers know is stored and served
    future = envelope_fields(owner, valid_until=expires, kind="future-kind")
    assert validator.validate(dht_record(KEY, owner.peer_id, msgpack.packb(future), expires)) is True
    # a value just at the wrapper limit is looked into (and refused for what it is, not its size)
    caplog.clear()
    with caplog.at_level("INFO", logger="swarmgrad.dht.records"):
        validator.validate(DHTRecord(DHTID.generate(source=KEY).to_bytes(), MSGPackSerializer.dumps(owner.peer_id),
                                     MSGPackSerializer.dumps(b"x" * MAX_RECORD_BYTES), expires))
    assert "exceeds" not in caplog.messages[0] and "not msgpack" in caplog.messages[0]


def test_a_record_kind_registered_at_run_time_is_validated_by_its_schema():
    """record_kind registers the schema open_envelope checks bodies against; bytes in a body go on
    the wire as msgpack bin (a str would fail the strict schema)."""
    from swarmgrad.dht.records import RecordBody, record_kind

    @record_kind
    class Blob(RecordBody):
        kind = "test-blob"
        max_ttl = 60.0
        data: bytes

    owner = Identity.generate()
    opened = open_envelope(seal(owner, KEY, Blob(data=b"\x00\xff"), NOW + 30), now=NOW)
    assert opened.body == Blob(data=b"\x00\xff")
    with pytest.raises(RecordError, match="^record expiry is more than 60 s ahead$"):
        open_envelope(seal(owner, KEY, Blob(data=b""), NOW + 121), now=NOW)


def test_the_validator_logs_an_unexpected_error_with_its_type_and_text(caplog):
    owner = Identity.generate()
    try:
        MSGPackSerializer.loads(b"\xc1")
    except Exception as error:
        expected = f"rejected DHT record ({type(error).__name__}: {error})"
    with caplog.at_level("INFO", logger="swarmgrad.dht.records"):
        assert SignedRecordValidator().validate(DHTRecord(DHTID.generate(source=KEY).to_bytes(),
                                                          MSGPackSerializer.dumps(owner.peer_id), b"\xc1", 1e12)) is False
    assert caplog.messages == [expected]
    # a value of exactly the wrapper limit is looked into, not refused for its size
    caplog.clear()
    with caplog.at_level("INFO", logger="swarmgrad.dht.records"):
        SignedRecordValidator().validate(DHTRecord(DHTID.generate(source=KEY).to_bytes(),
                                                   MSGPackSerializer.dumps(owner.peer_id),
                                                   b"\xc1" * (MAX_RECORD_BYTES + 16), 1e12))
    assert len(caplog.messages) == 1 and "exceeds" not in caplog.messages[0]
