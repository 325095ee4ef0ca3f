"""Peer-level DP of every update that leaves a peer: clip the whole update, add Gaussian noise, count it."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence
from typing import Any

import torch

from .budget import Accounted, PrivacyBudget
from .settings import Privacy, PrivacyError

# clipped updates land a hair under clip_norm so float32 rounding can never push them over it
_CLIP_MARGIN = 1.0 - 1e-6


def private_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from the OS: a training script's torch.manual_seed must not make the noise predictable."""
    generator = torch.Generator(device=device)
    generator.manual_seed(secrets.randbits(63))
    return generator


def total_norm(tensors: Sequence[torch.Tensor]) -> float:
    """L2 norm of all tensors together, accumulated in float64 so large updates do not lose precision."""
    if not tensors:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64).cpu() for t in tensors])
    return float(torch.linalg.vector_norm(norms))


def add_gaussian_noise(tensor: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """tensor += N(0, std^2) independently per element, drawn on the generator's device."""
    noise = torch.empty(tensor.shape, dtype=tensor.dtype, device=generator.device)
    tensor.add_(noise.normal_(0.0, std, generator=generator).to(tensor.device))


class PrivateReleaser(Accounted):
    """Applies the privacy setting to every update that leaves the peer and keeps the budget (architecture.md, invariant
    'privacy before anything leaves').

    Call ``release`` once per update that leaves the peer, before compression; send its result to every
    receiver of that round or push (one release, many copies: copies are post-processing, extra releases spend budget).
    """

    def __init__(self, privacy: Privacy, generator: torch.Generator | None = None) -> None:
        if privacy.level != "update":
            raise PrivacyError("level: PrivateReleaser serves level='update'; with level='sample' the training loop "
                               "makes gradients private (make_per_sample_private) and releases need no more noise")
        self.privacy = privacy
        # accounted at the noise an average of noise_shares honest releases carries (distributed DP);
        # each release carries 1/sqrt(noise_shares) of it, and epsilon_local counts that
        self.noise_multiplier = privacy.resolved_noise_multiplier()
        self._generator = generator if generator is not None else private_generator()
        self._budget = PrivacyBudget(self.noise_multiplier, privacy.rate, privacy.delta, privacy.budget_limit(),
                                     privacy.accountant, what="release")
        self._last_clip_norm = 0.0
        self._lock = threading.Lock()  # check, noise and count are one step even if pushes release from threads

    def release(self, update: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """New float32 tensors: ``update`` clipped to clip_norm as a whole, plus noise; the inputs are untouched.

        Raises PrivacyError for non-finite or non-real input and BudgetExhausted past max_epsilon; neither counts.
        """
        _check_update(update)
        clip_norm = self.privacy.clip_norm
        std = self.privacy.release_noise_multiplier() * clip_norm
        with self._lock:
            self._budget.check()
            released = [t.detach().to(dtype=torch.float32, copy=True) for t in update]
            norm = total_norm(released)
            if norm > clip_norm:
                scale = clip_norm / norm * _CLIP_MARGIN
                for tensor in released:
                    tensor.mul_(scale)
            self._last_clip_norm = total_norm(released)  # measured, not assumed
            if std > 0:
                for tensor in released:
                    add_gaussian_noise(tensor, std, self._generator)
            self._budget.commit()
        return released

    @property
    def epsilon_local(self) -> float:
        return self._budget.epsilon_at(1.0 / self.privacy.noise_shares ** 0.5)

    def status(self) -> dict[str, Any]:
        return super().status() | {"noise_shares": self.privacy.noise_shares, "epsilon_local": self.epsilon_local}

    def last_clip_norm(self) -> float:
        """L2 norm of the last released update after clipping and before noise (0.0 before any release)."""
        return self._last_clip_norm


def _check_update(update: Sequence[torch.Tensor]) -> None:
    if len(update) == 0:
        raise PrivacyError("update: nothing to release (no tensors)")
    for index, tensor in enumerate(update):
        if not isinstance(tensor, torch.Tensor) or tensor.is_complex():
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise PrivacyError(f"update[{index}]: expected a real tensor, got {kind}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise PrivacyError(f"update[{index}]: holds NaN or Inf; nothing was released or counted")
