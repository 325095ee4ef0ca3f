"""Encrypted frames for the direct data plane: AES-256-GCM with counter nonces.

Every frame is two AEAD messages, its header and its payload, so a payload can still be decrypted
straight into its destination. The nonce of message n in one direction is (direction, n): a
replayed, dropped, reordered or modified message fails authentication, and the channel closes.

Wire format of one frame:  [u32 header ciphertext length][header ciphertext][payload ciphertext]
The payload ciphertext is the payload length (from the decrypted header) plus the 16-byte tag.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from swarmgrad.net.framestream import FastChannel
from swarmgrad.net.wire import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_HEADER_BYTES,
    PREFIX,
    FrameError,
    check_lengths,
    pack_prefix_and_header,
    parse_header,
)

KEY_BYTES = 32
TAG_BYTES = 16
_LENGTH = struct.Struct(">I")
_NONCE = struct.Struct(">IQ")  # direction, message counter: 12 bytes


class FrameCipher:
    """AES-256-GCM for one channel; each side sends with its own direction number."""

    def __init__(self, key: bytes, sending: int):
        if len(key) != KEY_BYTES:
            raise ValueError(f"session key must be {KEY_BYTES} bytes")
        self._aead = AESGCM(key)
        self._send_direction, self._receive_direction = sending, 1 - sending
        self._sent = self._received = 0

    def seal(self, data: bytes | memoryview) -> bytes:
        nonce = _NONCE.pack(self._send_direction, self._sent)
        self._sent += 1
        return self._aead.encrypt(nonce, data, None)

    def open(self, ciphertext: bytes | memoryview) -> bytes:
        return self._aead.decrypt(self._next_receive_nonce(), bytes(ciphertext), None)

    def open_into(self, ciphertext: memoryview, target: memoryview) -> None:
        """Decrypt into ``target`` (exactly the plaintext length), with no intermediate copy."""
        nonce = self._next_receive_nonce()
        if hasattr(self._aead, "decrypt_into"):  # cryptography >= 45
            self._aead.decrypt_into(nonce, ciphertext, None, target)
        else:
            target[:] = self._aead.decrypt(nonce, bytes(ciphertext), None)

    def _next_receive_nonce(self) -> bytes:
        nonce = _NONCE.pack(self._receive_direction, self._received)
        self._received += 1
        return nonce


class EncryptedChannel(FastChannel):
    """A FastChannel whose frames are sealed with a FrameCipher (set ``cipher`` before use)."""

    cipher: FrameCipher
    _scratch = bytearray()  # receive buffer for sealed payloads, replaced per channel on first use

    async def send(self, header: dict, payload: bytes | memoryview = b"") -> None:
        await self._protocol._can_write.wait()
        if self._protocol._closed is not None and self._transport.is_closing():
            raise ConnectionResetError(f"channel to {self.peer_id} is closed")
        sealed_header = self.cipher.seal(pack_prefix_and_header(header, len(payload)))
        pieces = [_LENGTH.pack(len(sealed_header)), sealed_header]
        if len(payload):
            pieces.append(self.cipher.seal(payload))
        await self._write(pieces)
        self.bytes_sent += sum(len(piece) for piece in pieces)

    async def recv_header(self, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[dict, int]:
        if self._pending_payload:
            raise RuntimeError("the previous frame's payload was not read")
        (sealed_length,) = _LENGTH.unpack(await self._protocol.read_exactly(_LENGTH.size))
        if not TAG_BYTES + PREFIX.size < sealed_length <= TAG_BYTES + PREFIX.size + MAX_HEADER_BYTES:
            raise FrameError(f"sealed header of {sealed_length} bytes is out of range")
        try:
            plain = self.cipher.open(await self._protocol.read_exactly(sealed_length))
        except InvalidTag:
            raise FrameError("frame failed authentication (tampered, replayed or out of order)") from None
        header_length, payload_length = PREFIX.unpack_from(plain)
        check_lengths(header_length, payload_length, max_payload)
        if PREFIX.size + header_length != len(plain):
            raise FrameError("sealed header length does not match its prefix")
        header = parse_header(plain[PREFIX.size :])
        self.bytes_received += _LENGTH.size + sealed_length + (payload_length + TAG_BYTES if payload_length else 0)
        self._pending_payload = payload_length
        return header, payload_length

    async def recv_payload_into(self, target: memoryview) -> None:
        self._claim_payload(target)
        if not len(target):
            return
        if len(self._scratch) < len(target) + TAG_BYTES:
            self._scratch = bytearray(len(target) + TAG_BYTES)
        sealed = memoryview(self._scratch)[: len(target) + TAG_BYTES]
        await self._protocol.read_into(sealed)
        try:
            self.cipher.open_into(sealed, target)
        except InvalidTag:
            raise FrameError("payload failed authentication (tampered, replayed or out of order)") from None
