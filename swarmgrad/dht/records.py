"""Typed, signed DHT records.

Every value swarmgrad stores in the DHT is a msgpack *envelope*::

    {"v": 1, "kind": "member", "key": <DHT key>, "subkey": <owner peer id>,
     "expires": <float>, "body": <msgpack of the kind's schema>, "pub": <32 bytes>, "sig": <64 bytes>}

The signature covers everything but itself, so neither the body, the key it is filed under nor its
expiry can be changed by anyone but the owner, and the subkey must be the signer's own peer id:
each peer writes only its own slot. The validator plugs into hivemind's DHTNode and runs on every
store request and every value returned by a search, so forged, malformed, oversized or expired
records never enter (or leave) a node.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import msgpack
import pydantic
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from swarmgrad.dht.identity import Identity, peer_id_from_public_key, verify_signature

logger = logging.getLogger(__name__)

ENVELOPE_VERSION = 1
MAX_RECORD_BYTES = 16 * 1024  # no record kind needs more; bigger ones are rejected unparsed
MAX_CLOCK_SKEW = 60.0  # seconds a record's expiry may exceed its kind's TTL limit, for peers' clock drift
UNKNOWN_KIND_MAX_TTL = 3600.0  # the longest any record kind may live


class RecordBody(pydantic.BaseModel):
    """Base of every record schema."""

    # wrong types are errors; unknown fields are ignored so newer peers can add fields older ones skip
    model_config = pydantic.ConfigDict(extra="ignore", strict=True, frozen=True)

    kind: ClassVar[str]
    max_ttl: ClassVar[float] = 3600.0


BodyT = TypeVar("BodyT", bound=RecordBody)
_SCHEMAS: dict[str, type[RecordBody]] = {}


def record_kind(cls: type[BodyT]) -> type[BodyT]:
    """Register a RecordBody subclass so the validator knows its schema."""
    _SCHEMAS[cls.kind] = cls
    return cls


class RecordError(ValueError):
    """A record failed validation; the message says why."""


@dataclass(frozen=True)
class SignedRecord(Generic[BodyT]):
    key: str
    owner: str  # peer id of the signer, also the DHT subkey
    expires: float
    body: BodyT


def _signed_part(fields: dict[str, Any]) -> bytes:
    unsigned = {name: value for name, value in fields.items() if name != "sig"}
    return msgpack.packb(unsigned, use_bin_type=True)


def seal(identity: Identity, key: str, body: RecordBody, expires: float) -> bytes:
    """Serialize and sign ``body`` as ``identity``'s record under ``key``, valid until ``expires``."""
    fields = {
        "v": ENVELOPE_VERSION,
        "kind": body.kind,
        "key": key,
        "subkey": identity.peer_id,
        "expires": float(expires),
        "body": msgpack.packb(body.model_dump(), use_bin_type=True),
        "pub": identity.public_key,
    }
    fields["sig"] = identity.sign(_signed_part(fields))
    envelope = msgpack.packb(fields, use_bin_type=True)
    if len(envelope) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(envelope)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
    return envelope


def open_envelope(envelope: bytes, *, now: float | None = None, known_kind: bool = True) -> SignedRecord:
    """Check an envelope completely and return its parsed record; raise RecordError otherwise.

    With ``known_kind=False`` a kind this process has no schema for is accepted on its envelope
    alone (signature, owner, size, expiry within UNKNOWN_KIND_MAX_TTL) and its body left unparsed:
    a bootstrap node, or an older peer, stores and serves record kinds that newer code added,
    and the peers that read them check the body.
    """
    if not isinstance(envelope, bytes):
        raise RecordError(f"record must be bytes, got {type(envelope).__name__}")
    if len(envelope) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(envelope)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
    try:
        fields = msgpack.unpackb(envelope, raw=False, max_bin_len=MAX_RECORD_BYTES, max_str_len=MAX_RECORD_BYTES)
    except Exception as error:
        raise RecordError(f"record is not msgpack: {error}") from None
    expected = {"v", "kind", "key", "subkey", "expires", "body", "pub", "sig"}
    if not isinstance(fields, dict) or set(fields) != expected:
        raise RecordError("record envelope must have exactly the fields " + ", ".join(sorted(expected)))
    if fields["v"] != ENVELOPE_VERSION:
        raise RecordError(f"unsupported record version {fields['v']!r}")
    schema = _SCHEMAS.get(fields["kind"]) if isinstance(fields["kind"], str) else None
    if schema is None and (known_kind or not isinstance(fields["kind"], str) or len(fields["kind"]) > 32):
        raise RecordError(f"unknown record kind {fields['kind']!r}")
    for name, kind in (("key", str), ("subkey", str), ("expires", float), ("body", bytes), ("pub", bytes)):
        if not isinstance(fields[name], kind):
            raise RecordError(f"record field {name!r} must be {kind.__name__}")
    if not isinstance(fields["sig"], bytes):
        raise RecordError("record field 'sig' must be bytes")
    try:
        signer = peer_id_from_public_key(fields["pub"])
    except ValueError as error:
        raise RecordError(str(error)) from None
    if fields["subkey"] != signer:
        raise RecordError("record subkey is not the signer's peer id")
    if not verify_signature(fields["pub"], fields["sig"], _signed_part(fields)):
        raise RecordError("record signature does not verify")
    now = time.time() if now is None else now
    expires = fields["expires"]
    if not math.isfinite(expires) or expires <= now:
        raise RecordError("record has expired")
    max_ttl = schema.max_ttl if schema is not None else UNKNOWN_KIND_MAX_TTL
    if expires > now + max_ttl + MAX_CLOCK_SKEW:
        raise RecordError(f"record expiry is more than {max_ttl:.0f} s ahead")
    if schema is None:
        return SignedRecord(key=fields["key"], owner=signer, expires=expires, body=None)  # type: ignore[arg-type]
    try:
        body = schema.model_validate(msgpack.unpackb(fields["body"], raw=False))
    except Exception as error:
        raise RecordError(f"record body does not match the {schema.kind!r} schema: {error}") from None
    return SignedRecord(key=fields["key"], owner=signer, expires=expires, body=body)


class SignedRecordValidator(RecordValidatorBase):
    """hivemind validator: a DHT entry is accepted only if it is a valid envelope filed where it claims."""

    def validate(self, record: DHTRecord) -> bool:
        return self.open(record) is not None

    def open(self, record: DHTRecord) -> tuple[bytes, SignedRecord] | None:
        """``validate``'s check, returning the envelope and the record it holds; None if refused."""
        try:
            return self._check(record)
        except RecordError as error:
            logger.info("rejected DHT record: %s", error)
            return None
        except Exception as error:  # a validator must never take the node down
            logger.info("rejected DHT record (%s: %s)", type(error).__name__, error)
            return None

    @staticmethod
    def _check(record: DHTRecord) -> tuple[bytes, SignedRecord]:
        if len(record.value) > MAX_RECORD_BYTES + 16:  # +16: msgpack's own header around the bytes
            raise RecordError(f"value of {len(record.value)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
        envelope = MSGPackSerializer.loads(record.value)
        opened = open_envelope(envelope, known_kind=False)
        if DHTID.generate(source=opened.key).to_bytes() != record.key:
            raise RecordError("record is filed under a different key than it was signed for")
        if record.subkey != MSGPackSerializer.dumps(opened.owner):
            raise RecordError("record is filed under a different subkey than its owner")
        if record.expiration_time > opened.expires:
            raise RecordError("DHT expiration is later than the signed expiry")
        return envelope, opened
