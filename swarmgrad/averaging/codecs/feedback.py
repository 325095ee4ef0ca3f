"""Error feedback: what a lossy codec drops from one update is added back into the next (architecture.md, invariant
'lossy codecs keep error feedback').

Two-phase, so a failed round changes nothing (architecture.md, invariant 'a failed round changes nothing'): `encode`
only *stages* the new residual (and the codec's warm start, e.g. PowerSGD's Q); `commit` applies everything staged once
the round that carried those encodings succeeded, `discard` drops it when it failed.

Over rounds t = 1..T with committed residuals e_t = y_t - decoded_t and y_t = u_t + e_{t-1}:

    sum(decoded_t) = sum(u_t) - e_T

so the swarm receives every update exactly, only delayed, and ||sum(u_t) - sum(decoded_t)|| is
the current residual norm; where the codec keeps its residuals as bfloat16 (`Codec.residual_dtype`:
the block quantizers', whose residuals are at most a quantization step of their block, 1/254 of its
largest value for int8 and 1/4 for q2; DESIGN's memory budget), up to 2^-8 of each residual a round
more (round to nearest: unbiased). Not thread-safe: one owner (the averaging round) at a time.
"""


from __future__ import annotations

import dataclasses

import torch

from .base import Codec, CodecError, Encoded, as_float32

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Keeps what a lossy codec dropped, per tensor key, and adds it back into the next update."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residual: dict[str, torch.Tensor] = {}  # committed, codec.residual_dtype CPU, shaped like the tensor
        self._warm: dict[str, torch.Tensor] = {}  # committed codec warm starts
        self._staged: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def encode(self, key: str, tensor: torch.Tensor) -> Encoded:
        """Encode tensor + residual[key]; stage the new residual (applied by `commit`).

        Encoding the same key twice before commit/discard restages from the committed state:
        the last call wins.
        """
        if not self.codec.lossy:  # nothing is ever dropped: no state at all
            return self.codec.encode(tensor)
        flat, dtype = as_float32(tensor)
        shape = tuple(int(dim) for dim in tensor.shape)
        residual = self._residual.get(key)
        if residual is not None and residual.shape != shape:
            raise CodecError(f"tensor {key!r} changed shape from {tuple(residual.shape)} to {shape}; reset() it first")
        corrected = flat.view(shape) if residual is None else flat.view(shape) + residual
        encoded = self.codec.encode(corrected, warm_start=self._warm.get(key))
        decoded = self.codec.decode(encoded, max_elements=max(1, corrected.numel()))
        new_residual = torch.sub(corrected, decoded, out=decoded).to(self.codec.residual_dtype)
        self._staged[key] = (new_residual, self.codec.next_warm_start(encoded))
        # The payload describes `tensor`, so it carries the caller's dtype, not float32's.
        return encoded if encoded.dtype == dtype else dataclasses.replace(encoded, dtype=dtype)

    def commit(self) -> None:
        """Apply every staged residual (the round that carried them succeeded)."""
        for key, (residual, warm) in self._staged.items():
            self._residual[key] = residual
            if warm is None:
                self._warm.pop(key, None)
            else:
                self._warm[key] = warm
        self._staged.clear()

    def discard(self) -> None:
        """Drop staged residuals (the round failed: state stays as it was)."""
        self._staged.clear()

    def reset(self, key: str | None = None) -> None:
        """Forget the state of one tensor, or of all (e.g. after downloading fresh state)."""
        keys = list(self._residual) + list(self._staged) if key is None else [key]
        for name in keys:
            self._residual.pop(name, None)
            self._warm.pop(name, None)
            self._staged.pop(name, None)

    def residual_norm(self, key: str) -> float:
        """L2 norm of the committed residual of `key` (0.0 when there is none)."""
        residual = self._residual.get(key)
        return 0.0 if residual is None else float(torch.linalg.vector_norm(residual.float()))

    def held_bytes(self) -> int:
        """Host bytes of committed and staged residuals and warm starts."""
        tensors = [*self._residual.values(), *self._warm.values(),
                   *(t for pair in self._staged.values() for t in pair if t is not None)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def __len__(self) -> int:
        """Number of tensors with a committed residual."""
        return len(self._residual)
