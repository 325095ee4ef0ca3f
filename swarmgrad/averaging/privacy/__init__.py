"""Differential privacy of what leaves a peer (architecture.md, invariant 'privacy before anything leaves'), with
Opacus's accountants.

    privacy = Privacy(clip_norm=1.0, noise_multiplier=1.1, max_epsilon=8.0)
    releaser = PrivateReleaser(privacy)             # one per peer, for the peer's lifetime
    noisy = releaser.release(update_tensors)        # clip whole update, add noise, count; then compress and send
    releaser.status()                               # epsilon, delta, releases, ... for the membership record

Per-sample DP-SGD (level="sample") lives in the training loop: ``make_per_sample_private(model, privacy, ...)``.
This package knows tensors and budgets only: no models beyond per-sample gradients, no networking.
"""

from swarmgrad.lazy import lazy_exports

_EXPORTS = {
    "BudgetExhausted": "swarmgrad.averaging.privacy.budget",
    "PrivacyBudget": "swarmgrad.averaging.privacy.budget",
    "PerSamplePrivacy": "swarmgrad.averaging.privacy.per_sample",
    "make_per_sample_private": "swarmgrad.averaging.privacy.per_sample",
    "PrivateReleaser": "swarmgrad.averaging.privacy.release",
    "private_generator": "swarmgrad.averaging.privacy.release",
    "total_norm": "swarmgrad.averaging.privacy.release",
    "Privacy": "swarmgrad.averaging.privacy.settings",
    "PrivacyError": "swarmgrad.averaging.privacy.settings",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
