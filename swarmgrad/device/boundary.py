"""The one place swarm data crosses between the training device and the host.

A round reads the parameters (or accumulated gradients) from the device once and writes its result
back once, in pieces of at most ``CHUNK_BYTES``: on CUDA each piece goes through one of two pinned
host buffers with a non-blocking copy on a side stream, so the next piece travels while the host
works on the last one and the GPU never needs a second model-sized buffer; elsewhere (the CPU, MPS)
the same pieces are plain copies, so tests on the CPU run this very code and count its bytes.

What stays on the host, as INTELLECT-1 and OpenDiLoCo keep it: DiLoCo's outer start and momentum,
the contribution, the codecs' error feedback. The pseudo-gradient is formed there, chunk by chunk,
from the piece just read: 4 bytes per parameter down and 4 back per round (fp32), against the 1 byte
an int8 encoding on the device would send down but 4 more it would need up (the start, to form the
pseudo-gradient on the device) and 4 more bytes per parameter of GPU memory to keep it there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

CHUNK_BYTES = 32 << 20  # one copy: long enough to run at the bus's rate; two pinned buffers of it are little


@dataclass
class Crossings:
    """What crossed the boundary so far (bytes as the host buffers hold them: float32)."""

    to_host_bytes: int = 0
    to_device_bytes: int = 0
    copies: int = 0

    def total(self) -> int:
        return self.to_host_bytes + self.to_device_bytes


class DeviceBoundary:
    """Copies between device tensors (laid end to end, as ``FlatLayout`` lays them) and host float32."""

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES):
        self.device = device
        self.chunk_numel = max(1, chunk_bytes // 4)
        self.crossings = Crossings()
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._pinned: list[torch.Tensor] = []  # two, made on first use

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> DeviceBoundary:
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"the swarm's tensors must sit on one device, found {sorted(map(str, devices))}")
        return cls(devices.pop() if devices else torch.device("cpu"), chunk_bytes)

    @property
    def on_host(self) -> bool:
        return self.device.type == "cpu"

    def _pieces(self, tensors: Sequence[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
        offset = 0
        for tensor in tensors:
            if not tensor.is_contiguous():
                raise ValueError("the swarm's tensors must be contiguous")
            flat = tensor.detach().view(-1)
            for start in range(0, flat.numel(), self.chunk_numel):
                yield offset + start, flat[start:start + self.chunk_numel]
            offset += flat.numel()

    def _buffers(self) -> list[torch.Tensor]:
        if not self._pinned:
            self._pinned = [torch.empty(self.chunk_numel, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        return self._pinned

    def read(self, tensors: Sequence[torch.Tensor], consume: Callable[[int, torch.Tensor], None]) -> None:
        """``consume(offset, chunk)`` for each piece of ``tensors`` in order, ``chunk`` its float32
        values on the host (valid during the call only; on the host device it may be the tensor itself)."""
        if not self._cuda:
            for offset, piece in self._pieces(tensors):
                self._count(piece.numel(), to_host=True)
                consume(offset, piece.to("cpu", torch.float32))
            return
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # as the training stream left them
        buffers = self._buffers()
        pending: tuple[int, torch.Tensor, torch.cuda.Event] | None = None
        for index, (offset, piece) in enumerate(self._pieces(tensors)):
            buffer = buffers[index % 2][:piece.numel()]  # the other one holds the piece consumed next
            with torch.cuda.stream(self._stream):
                buffer.copy_(piece, non_blocking=True)
                arrived = self._stream.record_event()
            self._count(piece.numel(), to_host=True)
            if pending is not None:
                self._finish(pending, consume)
            pending = (offset, buffer, arrived)
        if pending is not None:
            self._finish(pending, consume)

    def read_span(self, tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start + length)`` of ``tensor`` (flat), float32 on the host: one chunk a
        round reads where it lives instead of from a model-sized copy (a plain copy, also on CUDA)."""
        piece = tensor.detach().view(-1)[start : start + length]
        self._count(piece.numel(), to_host=True)
        return piece.to("cpu", torch.float32)

    @staticmethod
    def _finish(pending: tuple[int, torch.Tensor, torch.cuda.Event], consume: Callable[[int, torch.Tensor], None]) -> None:
        offset, buffer, arrived = pending
        arrived.synchronize()
        consume(offset, buffer)

    def write(self, tensors: Sequence[torch.Tensor], source: Callable[[int, int], torch.Tensor],
              add: bool = False) -> None:
        """Set each piece of ``tensors`` to (``add``: add to it) ``source(offset, numel)``, float32 on
        the host, called once per piece in order (so it may compute the values as it goes)."""
        if not self._cuda:
            for offset, piece in self._pieces(tensors):
                values = source(offset, piece.numel())
                self._count(piece.numel(), to_host=False)
                piece.add_(values) if add else piece.copy_(values)
            return
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # nothing still reads the old values
        buffers = self._buffers()
        sent: list[torch.cuda.Event | None] = [None, None]
        for index, (offset, piece) in enumerate(self._pieces(tensors)):
            slot = index % 2
            if sent[slot] is not None:
                sent[slot].synchronize()  # the buffer's last piece has left it
            buffer = buffers[slot][:piece.numel()]
            buffer.copy_(source(offset, piece.numel()))
            with torch.cuda.stream(self._stream):
                if add:
                    piece.add_(buffer.to(self.device, non_blocking=True))
                else:
                    piece.copy_(buffer, non_blocking=True)
                sent[slot] = self._stream.record_event()
            self._count(piece.numel(), to_host=False)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)  # training sees the new values

    def _count(self, numel: int, to_host: bool) -> None:
        if to_host:
            self.crossings.to_host_bytes += 4 * numel
        else:
            self.crossings.to_device_bytes += 4 * numel
        self.crossings.copies += 1
