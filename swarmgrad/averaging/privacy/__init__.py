"""Differential privacy of what leaves a peer (DESIGN invariant 6), with Opacus's accountants.

    privacy = Privacy(clip_norm=1.0, noise_multiplier=1.1, max_epsilon=8.0)
    releaser = PrivateReleaser(privacy)             # one per peer, for the peer's lifetime
    noisy = releaser.release(update_tensors)        # clip whole update, add noise, count; then compress and send
    releaser.status()                               # epsilon, delta, releases, ... for the membership record

Per-sample DP-SGD (level="sample") lives in the training loop: ``make_per_sample_private(model, privacy, ...)``.
This package knows tensors and budgets only: no models beyond per-sample gradients, no networking.
"""

from .budget import BudgetExhausted, PrivacyBudget
from .per_sample import PerSamplePrivacy, make_per_sample_private
from .release import PrivateReleaser, private_generator, total_norm
from .settings import Privacy, PrivacyError

__all__ = [
    "BudgetExhausted",
    "PerSamplePrivacy",
    "Privacy",
    "PrivacyBudget",
    "PrivacyError",
    "PrivateReleaser",
    "make_per_sample_private",
    "private_generator",
    "total_norm",
]
