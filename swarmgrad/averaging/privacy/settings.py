"""The user-facing privacy setting: what to clip to, how much noise, which budget to keep."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from swarmgrad.errors import ConfigError
from swarmgrad.settings import flag

# how far a given noise_multiplier may sit from the one derived from target_epsilon before we call them inconsistent
_CONSISTENCY = 0.01


class PrivacyError(ConfigError):
    """An invalid privacy setting or input; the message names the field and says what to change."""


class Privacy(BaseModel):
    """Differential privacy of what leaves a peer (architecture.md, invariant 'privacy before anything leaves').

    ``level="sample"``: per-sample DP-SGD in the training loop (make_per_sample_private). It protects each
    training example of a peer from everyone else (other peers, the network, whoever gets the model), trusting
    nobody; what the peer then releases is post-processing of private gradients and needs no more noise.

    ``level="update"``: every released update is clipped to ``clip_norm`` (L2, all tensors together) and gets
    Gaussian noise of std ``noise_multiplier * clip_norm / sqrt(noise_shares)`` (PrivateReleaser). It protects
    a peer's whole contribution (all its data) in each round. With ``noise_shares=1`` (local DP) every release
    carries all the noise and is private against everyone; with ``noise_shares=n`` (distributed DP) only an
    average of n honest peers' releases carries ``noise_multiplier * clip_norm``: what the swarm publishes
    (averages, the model) is private at ``noise_multiplier``, trusting n honest members per group, while one
    release seen alone (by its group's members) is private only at ``noise_multiplier / sqrt(n)``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    clip_norm: float = Field(description="Differential privacy: L2 clip norm of each update (level update) or "
                             "sample (level sample); with a noise, turns privacy on (default off).",
                             json_schema_extra=flag("privacy-clip"))
    noise_multiplier: float | None = Field(None, description="Differential privacy: noise std over the clip norm.",
                                           json_schema_extra=flag("privacy-noise"))
    target_epsilon: float | None = Field(None, description="Differential privacy: derive the noise from this epsilon "
                                         "over --expected-releases (instead of --privacy-noise).")
    expected_releases: int | None = Field(None, description="Differential privacy: releases --target-epsilon covers.")
    delta: float = Field(1e-5, description="Differential privacy: delta, well below 1/number of peers.",
                         json_schema_extra=flag("privacy-delta"))
    max_epsilon: float | None = Field(None, description="Differential privacy: stop releasing past this epsilon "
                                      "(default: --target-epsilon, else no limit).")
    # None: 1.0 at level update; at level sample each peer derives it from its batch and shard
    # (batch_size/dataset_size differ between peers, so a run's manifest must not carry one)
    sample_rate: float | None = Field(None, description="Differential privacy: the share of the data each release "
                                      "samples, in (0, 1] (default 1 at level update; level sample derives it from "
                                      "batch_size/dataset_size).", json_schema_extra=flag("privacy-sample-rate"))
    level: Literal["update", "sample"] = Field("update", description="Differential privacy: update (each released "
                                               "update) or sample (per-sample DP-SGD).",
                                               json_schema_extra=flag("privacy-level"))
    noise_shares: int = Field(1, description="Differential privacy, level update: how many peers' noise adds up in "
                              "each average (distributed DP): each release carries noise_multiplier/sqrt(shares) of "
                              "the noise, the average of that many honest peers all of it (default 1: local DP).",
                              json_schema_extra=flag("privacy-noise-shares"))
    accountant: Literal["rdp", "prv", "gdp"] = Field("rdp", description="Differential privacy: the accountant that "
                                                     "counts epsilon.", json_schema_extra=flag("privacy-accountant"))

    # derived from target_epsilon once, at validation, so a hopeless target fails at construction
    _derived_noise_multiplier: float | None = PrivateAttr(default=None)

    @field_validator("clip_norm")
    @classmethod
    def _check_clip_norm(cls, value: float) -> float:
        if value <= 0:
            raise PrivacyError(f"clip_norm must be > 0 (got {value}): it bounds the L2 norm of the whole update")
        return value

    @field_validator("noise_multiplier")
    @classmethod
    def _check_noise_multiplier(cls, value: float | None) -> float | None:
        if value is not None and value < 0:
            raise PrivacyError(f"noise_multiplier must be >= 0 (got {value}): noise std = noise_multiplier * clip_norm")
        return value

    @field_validator("target_epsilon")
    @classmethod
    def _check_target_epsilon(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise PrivacyError(f"target_epsilon must be > 0 (got {value})")
        return value

    @field_validator("expected_releases")
    @classmethod
    def _check_expected_releases(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise PrivacyError(f"expected_releases must be >= 1 (got {value})")
        return value

    @field_validator("delta")
    @classmethod
    def _check_delta(cls, value: float) -> float:
        if not 0 < value < 1:
            raise PrivacyError(f"delta must be in (0, 1) (got {value}); use well below 1/number of peers, e.g. 1e-5")
        return value

    @field_validator("max_epsilon")
    @classmethod
    def _check_max_epsilon(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise PrivacyError(f"max_epsilon must be > 0 (got {value}); leave it unset for no limit")
        return value

    @field_validator("noise_shares")
    @classmethod
    def _check_noise_shares(cls, value: int) -> int:
        if value < 1:
            raise PrivacyError(f"noise_shares must be >= 1 (got {value}): the peers whose noise adds up in an average")
        return value

    @field_validator("sample_rate")
    @classmethod
    def _check_sample_rate(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= 1:
            raise PrivacyError(f"sample_rate must be in (0, 1] (got {value})")
        return value

    @model_validator(mode="after")
    def _resolve_noise(self) -> Privacy:
        if self.level == "sample" and self.noise_shares != 1:
            raise PrivacyError("noise_shares: level='sample' noises each peer's own steps in full (its examples are "
                               "protected from everyone); noise shares are for level='update'")
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise PrivacyError("set noise_multiplier or target_epsilon (with expected_releases)")
        if self.target_epsilon is None:
            return self
        if self.expected_releases is None:
            raise PrivacyError("target_epsilon needs expected_releases: the number of releases the budget must cover")
        if self.level == "sample" and self.sample_rate is None:
            return self  # derived by each peer at its own sample rate (PerSamplePrivacy re-validates with it)
        derived = _noise_for_target(self.target_epsilon, self.delta, self.rate, self.expected_releases,
                                    self.accountant)
        given = self.noise_multiplier
        if given is not None and abs(given - derived) > _CONSISTENCY * derived:
            raise PrivacyError(
                f"noise_multiplier={given} and target_epsilon={self.target_epsilon} disagree: "
                f"{self.expected_releases} releases at epsilon {self.target_epsilon} need "
                f"noise_multiplier ~{derived:.4g}; "
                "give only one of them"
            )
        self._derived_noise_multiplier = derived
        return self

    @property
    def rate(self) -> float:
        """The sample rate each release is accounted at: sample_rate, else 1.0."""
        return 1.0 if self.sample_rate is None else self.sample_rate

    def resolved_noise_multiplier(self) -> float:
        """The noise multiplier in force: the one given, else the one derived from target_epsilon."""
        if self.noise_multiplier is not None:  # explicit noise wins; max_epsilon still guards the target
            return self.noise_multiplier
        if self._derived_noise_multiplier is None:  # level sample: only a peer knows its sample rate
            raise PrivacyError("target_epsilon at level='sample' is turned into noise at each peer's sample rate "
                               "(batch_size/dataset_size): make_per_sample_private does it")
        return self._derived_noise_multiplier

    def release_noise_multiplier(self) -> float:
        """The noise one release carries, over clip_norm: the share of one of ``noise_shares`` peers."""
        return self.resolved_noise_multiplier() / self.noise_shares ** 0.5

    def budget_limit(self) -> float | None:
        """The epsilon no release may pass: max_epsilon, else target_epsilon, else none."""
        return self.max_epsilon if self.max_epsilon is not None else self.target_epsilon

    @classmethod
    def parse(cls, **kwargs: Any) -> Privacy:
        """Like ``Privacy(**kwargs)`` but raises the first problem as a one-line PrivacyError."""
        try:
            return cls(**kwargs)
        except ValidationError as error:
            raise _first_problem(error) from None


def _first_problem(error: ValidationError) -> PrivacyError:
    first = error.errors()[0]
    original = first.get("ctx", {}).get("error")
    if isinstance(original, PrivacyError):
        return original
    field = ".".join(str(part) for part in first["loc"]) or "privacy"
    return PrivacyError(f"{field}: {first['msg']} (got {first.get('input')!r})")


def _noise_for_target(target_epsilon: float, delta: float, sample_rate: float, releases: int, accountant: str) -> float:
    from opacus.accountants.utils import get_noise_multiplier  # opacus takes ~1 s to import: only when asked

    try:
        return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate,
                                          steps=releases, accountant=accountant))
    except ValueError as error:  # "The privacy budget is too low."
        raise PrivacyError(
            f"target_epsilon={target_epsilon} is out of reach for {releases} releases at delta={delta} ({error}); "
            "raise target_epsilon or lower expected_releases"
        ) from None
