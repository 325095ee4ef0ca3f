"""Membership tickets of private runs: a peer id, signed by the run's key.

A private run's manifest names a *run key* (the public half of an Ed25519 key, as 64 hex digits;
the private half is an ordinary identity key file, ``swarmgrad keygen``). Whoever holds the private
half admits a peer by signing a ticket for its peer id (``swarmgrad run grant``)::

    {"v": 1, "run_key": "<64 hex>", "run_id": "my-run" | null, "peer_id": "12D3KooW...",
     "expires": <unix time> | null, "sig": "<base64 of the Ed25519 signature>"}

``run_id`` null admits the peer to every run whose manifest names this key. The signature covers
every other field, behind a domain prefix, so a ticket can never be mistaken for a DHT record or
anything else the same key might sign. A peer carries its ticket in its presence record; the
others check it against their manifest's key before they read the record or serve the peer.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmgrad.dht.identity import PUBLIC_KEY_BYTES, Identity, peer_id_from_public_key, verify_signature
from swarmgrad.errors import ConfigError

TICKET_VERSION = 1
MAX_TICKET_BYTES = 1024  # a ticket is ~300 bytes; it travels in every presence record
_DOMAIN = b"swarmgrad run ticket v1\n"
_FIELDS = {"v", "run_key", "run_id", "peer_id", "expires", "sig"}


def run_key_hex(public_key: bytes) -> str:
    """The form a manifest and a ticket name a run key in."""
    return public_key.hex()


def check_run_key(value: Any) -> str:
    """A run key as a manifest or ticket names it (64 lowercase hex digits); ConfigError otherwise."""
    if not isinstance(value, str) or len(value) != 2 * PUBLIC_KEY_BYTES or value.strip("0123456789abcdef"):
        raise ConfigError(f"a run key is {2 * PUBLIC_KEY_BYTES} lowercase hex digits (an Ed25519 public key), "
                          f"got {str(value)[:80]!r}")
    return value


@dataclass(frozen=True)
class Ticket:
    """A signed admission of ``peer_id`` to run ``run_id`` (None: any run of the key) until ``expires``."""

    run_key: str
    run_id: str | None
    peer_id: str
    expires: float | None
    signature: bytes

    @classmethod
    def issue(cls, run_key: Identity, peer_id: str, *, run_id: str | None = None,
              expires: float | None = None) -> Ticket:
        """A ticket for ``peer_id`` signed with the run key's private half."""
        _check_peer_id(peer_id)
        if expires is not None and not math.isfinite(expires):
            raise ConfigError("a ticket's expiry must be a finite unix time")
        unsigned = cls(run_key_hex(run_key.public_key), run_id, peer_id, expires, b"")
        return cls(unsigned.run_key, run_id, peer_id, expires, run_key.sign(unsigned._signed_part()))

    def _fields(self) -> dict[str, Any]:
        return {"v": TICKET_VERSION, "run_key": self.run_key, "run_id": self.run_id, "peer_id": self.peer_id,
                "expires": self.expires}

    def _signed_part(self) -> bytes:
        return _DOMAIN + json.dumps(self._fields(), sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> str:
        """The ticket as one line of JSON: the file format, and what a presence record carries."""
        return json.dumps({**self._fields(), "sig": base64.b64encode(self.signature).decode()}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "ticket") -> Ticket:
        """Parse a ticket and check its signature against the key it names; ConfigError (one line,
        starting with ``source``) for anything malformed or forged."""
        if len(text) > MAX_TICKET_BYTES:
            raise ConfigError(f"{source} is {len(text)} bytes; a ticket has at most {MAX_TICKET_BYTES}")
        try:
            fields = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(f"{source} is not a ticket (not JSON); create one with `swarmgrad run grant`") from None
        if not isinstance(fields, dict) or set(fields) != _FIELDS:
            raise ConfigError(f"{source} is not a ticket: it must have exactly the fields {', '.join(sorted(_FIELDS))}")
        if fields["v"] != TICKET_VERSION:
            raise ConfigError(f"{source} has ticket version {fields['v']!r}; this swarmgrad reads version {TICKET_VERSION}")
        try:
            run_key = check_run_key(fields["run_key"])
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None
        run_id, peer_id, expires = fields["run_id"], fields["peer_id"], fields["expires"]
        if run_id is not None and not isinstance(run_id, str):
            raise ConfigError(f"{source}: run_id must be a string or null")
        if not isinstance(peer_id, str):
            raise ConfigError(f"{source}: peer_id must be a string")
        if expires is not None and (isinstance(expires, bool) or not isinstance(expires, (int, float))
                                    or not math.isfinite(expires)):
            raise ConfigError(f"{source}: expires must be a unix time or null")
        try:
            signature = base64.b64decode(fields["sig"], validate=True) if isinstance(fields["sig"], str) else b""
        except binascii.Error:
            signature = b""
        ticket = cls(run_key, run_id, peer_id, None if expires is None else float(expires), signature)
        if not verify_signature(bytes.fromhex(run_key), signature, ticket._signed_part()):
            raise ConfigError(f"{source}: the signature does not verify against its run key (forged or altered)")
        return ticket

    @classmethod
    def load(cls, path: str | os.PathLike) -> Ticket:
        path = Path(path)
        try:
            data = path.read_bytes()[:MAX_TICKET_BYTES + 1]
        except OSError as error:
            raise ConfigError(f"cannot read ticket file {path}: {error.strerror}") from None
        return cls.from_json(data, source=f"ticket file {path}")

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        try:
            path.write_text(self.to_json() + "\n")
        except OSError as error:
            raise ConfigError(f"cannot write ticket file {path}: {error.strerror}") from None

    def problem(self, run_key: str, run_id: str, peer_id: str, now: float | None = None) -> str | None:
        """Why this ticket does not admit ``peer_id`` to ``run_id`` of ``run_key`` (None: it does)."""
        if self.run_key != run_key:
            return f"it is signed by run key {self.run_key[:16]}..., not this run's ({run_key[:16]}...)"
        if self.run_id is not None and self.run_id != run_id:
            return f"it is for run {self.run_id!r}, not {run_id!r}"
        if self.peer_id != peer_id:
            return f"it is for peer {self.peer_id}, not {peer_id}"
        now = time.time() if now is None else now
        if self.expires is not None and self.expires <= now:
            return f"it expired {now - self.expires:.0f} s ago"
        return None

    def check(self, run_key: str, run_id: str, peer_id: str, now: float | None = None) -> None:
        """ConfigError unless this ticket admits ``peer_id`` to ``run_id`` of ``run_key``."""
        problem = self.problem(run_key, run_id, peer_id, now)
        if problem is not None:
            raise ConfigError(f"the ticket does not admit this peer: {problem}; ask the run's creator for "
                              "one (`swarmgrad run grant`)")


def load_run_key(path: str | os.PathLike) -> Identity:
    """The private half of a run key: an identity key file (``swarmgrad keygen FILE``)."""
    try:
        return Identity.load(path)
    except ConfigError as error:
        raise ConfigError(str(error).replace("identity file", "run key file")) from None


def _check_peer_id(peer_id: str) -> None:
    """A ticket names an Ed25519 peer id (every swarmgrad peer's kind); catch typos at grant time."""
    import base58

    try:
        raw = base58.b58decode(peer_id)
    except ValueError:
        raw = b""
    if len(raw) != 38 or peer_id_from_public_key(raw[-PUBLIC_KEY_BYTES:]) != peer_id:
        raise ConfigError(f"{peer_id[:80]!r} is not a swarmgrad peer id (12D3KooW..., printed by `swarmgrad keygen`)")
