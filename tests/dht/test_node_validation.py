"""The node's record validator checks each distinct copy of a record once (a search hears one
record from many nodes), and decides exactly as the full check does; a read takes the records that
check opened instead of checking their signatures again."""

import asyncio
import time
from types import SimpleNamespace

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

import swarmgrad.dht.node as node_module
import swarmgrad.dht.records as records_module
from swarmgrad.dht.identity import Identity
from swarmgrad.dht.membership import MemberRecord, members_key
from swarmgrad.dht.records import seal

KEY = members_key("run")


def record(owner: Identity, expires: float, *, step: int = 3, dht_expires: float | None = None,
           filed_as: str | None = None) -> DHTRecord:
    body = MemberRecord(maddrs=[], role="peer", version="0", step=step, samples_per_second=0.0, updated_at=time.time())
    envelope = seal(owner, KEY, body, expires)
    return DHTRecord(DHTID.generate(source=KEY).to_bytes(), MSGPackSerializer.dumps(filed_as or owner.peer_id),
                     MSGPackSerializer.dumps(envelope), expires if dht_expires is None else dht_expires)


def counting_validator(size: int = node_module.VERIFIED_RECORDS) -> tuple[node_module._RememberingValidator, list]:
    validator, checked = node_module._RememberingValidator(size), []
    full_check = validator.validator.open
    validator.validator.open = lambda rec: checked.append(rec) or full_check(rec)
    return validator, checked


def test_a_copy_heard_again_is_not_checked_again():
    validator, checked = counting_validator()
    copy = record(Identity.generate(), time.time() + 30)
    assert all(validator.validate(copy) for _ in range(20))
    assert len(checked) == 1


def test_a_remembered_copy_whose_dht_time_ran_out_gets_the_full_check(monkeypatch):
    validator, checked = counting_validator()
    now = time.time()
    copy = record(Identity.generate(), now + 30)
    assert validator.validate(copy)
    monkeypatch.setattr(node_module.time, "time", lambda: now + 31)  # the clock records.py reads too
    assert not validator.validate(copy)  # expired: the full check says so
    assert len(checked) == 2


def test_any_other_bytes_are_checked_in_full():
    validator, checked = counting_validator()
    owner, other = Identity.generate(), Identity.generate()
    expires = time.time() + 30
    good = record(owner, expires)
    assert validator.validate(good)
    fields = msgpack.unpackb(MSGPackSerializer.loads(good.value))
    fields["body"] = msgpack.packb({**msgpack.unpackb(fields["body"]), "step": 999})
    tampered = DHTRecord(good.key, good.subkey, MSGPackSerializer.dumps(msgpack.packb(fields)), expires)
    assert not validator.validate(tampered)  # a changed body: the signature no longer verifies
    misfiled = DHTRecord(good.key, MSGPackSerializer.dumps(other.peer_id), good.value, expires)
    assert not validator.validate(misfiled)  # the same record in another peer's slot
    later = DHTRecord(good.key, good.subkey, good.value, expires + 1)
    assert not validator.validate(later)  # a DHT expiry past the signed one
    assert len(checked) == 4 and validator.validate(good) and len(checked) == 4


def test_the_memory_is_bounded_and_forgets_the_oldest_first():
    validator, checked = counting_validator(size=2)
    owner, expires = Identity.generate(), time.time() + 30
    first, second, third = (record(owner, expires, step=step) for step in (1, 2, 3))
    assert validator.validate(first) and validator.validate(second) and validator.validate(first)
    assert validator.validate(third)  # evicts second, the least recently heard
    assert len(validator._passed) == 2 and len(checked) == 3
    assert validator.validate(first) and len(checked) == 3
    assert validator.validate(second) and len(checked) == 4


def test_a_read_takes_the_records_the_check_opened_without_checking_their_signatures_again(monkeypatch):
    """A presence read of N members hears each new record once from a holder (the full check)
    and then opened every record again for its result: a second Ed25519 check of each, half of the
    read's CPU. Only these very bytes, checked here and not expired since, skip the second check."""
    validator, _ = counting_validator()
    owner, other = Identity.generate(), Identity.generate()
    now = time.time()
    heard, unheard = record(owner, now + 30), record(other, now + 30)
    assert validator.validate(heard)
    envelope = MSGPackSerializer.loads(heard.value)
    assert validator.opened(envelope).owner == owner.peer_id and validator.opened(envelope).body.step == 3
    assert validator.opened(MSGPackSerializer.loads(unheard.value)) is None  # never checked here
    fields = msgpack.unpackb(envelope)
    fields["body"] = msgpack.packb({**msgpack.unpackb(fields["body"]), "step": 999})
    assert validator.opened(msgpack.packb(fields)) is None  # other bytes
    monkeypatch.setattr(node_module.time, "time", lambda: now + 31)
    assert validator.opened(envelope) is None  # expired since

    monkeypatch.undo()
    verified = []
    verify = records_module.verify_signature
    monkeypatch.setattr(records_module, "verify_signature", lambda *a: verified.append(a) or verify(*a))
    node = node_module.SwarmNode()
    assert node._validator.validate(heard)
    found = {owner.peer_id: SimpleNamespace(value=envelope)}

    async def get(key, latest, **_options):
        return SimpleNamespace(value=found)

    node.dht = SimpleNamespace(get=get)
    records = asyncio.run(node.get_records(KEY, MemberRecord))
    assert list(records) == [owner.peer_id] and records[owner.peer_id].body.step == 3
    assert len(verified) == 1  # the holder's copy, checked once; the read added no check
