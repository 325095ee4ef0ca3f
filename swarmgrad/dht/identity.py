"""A peer's identity: an Ed25519 key in libp2p's on-disk format, and the peer id derived from it.

The same key names the peer on the libp2p network (p2pd reads the file) and signs its DHT records,
so a record can be checked against the peer id it claims without any extra key exchange.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.proto import crypto_pb2

from swarmgrad.errors import ConfigError

PUBLIC_KEY_BYTES = 32
_IDENTITY_MULTIHASH = 0x00  # multihash code "identity": small keys are inlined into the peer id


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (base58, ``12D3KooW...``) of an Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key has {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.Ed25519, data=public_key).SerializeToString()
    return base58.b58encode(bytes([_IDENTITY_MULTIHASH, len(encoded)]) + encoded).decode()


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Identity:
    """An Ed25519 private key with its public key and libp2p peer id."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    # cached: the peer id is compared with every member's at each training step (progress.py), and
    # computing it (protobuf and base58) took 3.5% of a small model's training loop
    @functools.cached_property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes_raw()

    @functools.cached_property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def to_libp2p_bytes(self) -> bytes:
        """libp2p's protobuf PrivateKey encoding, which p2pd's ``-id`` flag reads."""
        seed = self.private_key.private_bytes_raw()
        return crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=seed + self.public_key).SerializeToString()

    @classmethod
    def from_libp2p_bytes(cls, data: bytes) -> Identity:
        key = crypto_pb2.PrivateKey()
        key.ParseFromString(data)
        if key.key_type != crypto_pb2.Ed25519 or len(key.data) not in (32, 64):
            raise ValueError("not an Ed25519 key in libp2p format")
        return cls(Ed25519PrivateKey.from_private_bytes(key.data[:32]))

    def save(self, path: str | os.PathLike) -> None:
        """Write the key readable by its owner only; never overwrite an existing identity."""
        path = Path(path)
        if path.exists():
            raise ConfigError(f"identity file {path} already exists; remove it first or pick another path")
        if not path.parent.is_dir():
            raise ConfigError(f"cannot write identity file {path}: folder {path.parent} does not exist")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(self.to_libp2p_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Identity:
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as error:
            raise ConfigError(
                f"cannot read identity file {path}: {error.strerror}; create one with `swarmgrad keygen {path}`"
            ) from None
        try:
            return cls.from_libp2p_bytes(data)
        except Exception:
            raise ConfigError(
                f"identity file {path} is not a swarmgrad/libp2p Ed25519 key; create one with `swarmgrad keygen`"
            ) from None

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> Identity:
        if Path(path).exists():
            return cls.load(path)
        identity = cls.generate()
        identity.save(path)
        return identity
