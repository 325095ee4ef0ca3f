"""The privacy budget: counts releases with an Opacus accountant and refuses the one that would pass the limit."""

from __future__ import annotations

import copy
import logging
from typing import Any

from swarmgrad.errors import SwarmgradError

from .settings import PrivacyError

logger = logging.getLogger(__name__)


class BudgetExhausted(SwarmgradError, RuntimeError):
    """Releasing one more update would push epsilon past max_epsilon; nothing was released or counted."""


class PrivacyBudget:
    """One accountant for one stream of releases, all at the same noise multiplier and sample rate.

    ``check()`` before a release (raises BudgetExhausted), ``commit()`` after it: splitting the two lets the
    caller count only a release that really happened.
    """

    def __init__(self, noise_multiplier: float, sample_rate: float, delta: float, limit: float | None,
                 mechanism: str = "rdp", what: str = "update") -> None:
        from opacus.accountants import create_accountant  # opacus takes ~1 s to import: only when privacy is on

        self.noise_multiplier = noise_multiplier
        self.sample_rate = sample_rate
        self.delta = delta
        self.limit = limit
        self.what = what  # what one count is ("release", "step"), for messages
        self._accountant = create_accountant(mechanism)
        self._releases = 0
        self._refused = False
        # (releases, epsilon) pairs, each computed at most once: RDP at q < 1 or PRV costs ~10-100 ms
        self._current: tuple[int, float] = (0, 0.0)
        self._next: tuple[int, float] | None = None  # epsilon after one more release
        self._scaled: tuple[int, float, float] | None = None  # (releases, noise factor, epsilon): epsilon_at's

    @property
    def releases(self) -> int:
        return self._releases

    @property
    def epsilon(self) -> float:
        if self._current[0] != self._releases:
            self._current = (self._releases, float(self._accountant.get_epsilon(delta=self.delta)))
        return self._current[1]

    @property
    def exhausted(self) -> bool:
        return self._refused or (self.limit is not None and self._next_epsilon() > self.limit)

    def check(self) -> None:
        """Raise BudgetExhausted if counting one more release would pass the limit; changes no accounting."""
        if self.limit is None:
            return
        after = self._next_epsilon()
        if after <= self.limit:
            return
        message = (f"privacy budget spent: {self.what} {self._releases + 1} would raise epsilon from "
                   f"{self.epsilon:.4g} to {after:.4g}, past max_epsilon={self.limit:g} (delta={self.delta:g}); "
                   f"this peer stops releasing")
        if not self._refused:  # one line in the log, however often the caller retries
            logger.warning(message)
        self._refused = True
        raise BudgetExhausted(message)

    def commit(self) -> None:
        """Count one release that happened."""
        self._accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        self._releases += 1
        if self._next is not None and self._next[0] == self._releases - 1:
            self._current = (self._releases, self._next[1])  # check() already computed it

    def _next_epsilon(self) -> float:
        # epsilon with one more release, from a copy of the history so a refused release leaves no trace
        if self._next is None or self._next[0] != self._releases:
            trial = copy.deepcopy(self._accountant)
            trial.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
            self._next = (self._releases, float(trial.get_epsilon(delta=self.delta)))
        return self._next[1]

    def epsilon_at(self, noise_factor: float) -> float:
        """Epsilon of the same releases had each carried ``noise_factor`` x the noise accounted (distributed DP:
        one peer's share of the noise is 1/sqrt(shares) of what the average carries); computed once per release."""
        if noise_factor == 1.0:
            return self.epsilon
        if self._scaled is None or self._scaled[:2] != (self._releases, noise_factor):
            from opacus.accountants import create_accountant

            scaled = create_accountant(self._accountant.mechanism())
            scaled.history = [(nm * noise_factor, q, n) for nm, q, n in self._accountant.history]
            epsilon = float(scaled.get_epsilon(delta=self.delta)) if scaled.history else 0.0
            self._scaled = (self._releases, noise_factor, epsilon)
        return self._scaled[2]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep: a restarted peer that forgot its releases would overspend its budget."""
        return {"mechanism": self._accountant.mechanism(), "history": copy.deepcopy(self._accountant.history),
                "releases": self._releases}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mechanism") != self._accountant.mechanism():
            raise PrivacyError(f"accountant: checkpoint was kept with {state.get('mechanism')!r}, "
                               f"this peer uses {self._accountant.mechanism()!r}")
        try:
            history = [(float(nm), float(q), int(n)) for nm, q, n in state["history"]]
            releases = int(state["releases"])
        except (KeyError, TypeError, ValueError) as error:
            raise PrivacyError(f"accountant: malformed privacy state in checkpoint ({error!r})") from None
        self._accountant.history = history
        self._releases = releases
        self._refused = False  # re-derived from the limit, which a restart may have changed
        self._current = (0, 0.0) if not history else (-1, 0.0)  # recomputed on first read
        self._next = self._scaled = None

    def status(self, clip_norm: float) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "delta": self.delta, "releases": self.releases,
                "noise_multiplier": self.noise_multiplier, "clip_norm": clip_norm, "exhausted": self.exhausted}


class Accounted:
    """What every private mechanism reports of its budget (``_budget``, and ``privacy.clip_norm``)."""

    _budget: PrivacyBudget
    privacy: Any

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far at privacy.delta (0.0 before any release; inf when noise_multiplier is 0)."""
        return self._budget.epsilon

    @property
    def epsilon_local(self) -> float:
        """Epsilon of one peer's own releases seen alone; the same as ``epsilon`` unless noise is shared
        (update level with noise_shares > 1: ``epsilon`` is then the guarantee of the swarm's averages)."""
        return self.epsilon

    @property
    def releases(self) -> int:
        return self._budget.releases

    @property
    def exhausted(self) -> bool:
        """True once a release was refused, or when the next one would pass max_epsilon."""
        return self._budget.exhausted

    def status(self) -> dict[str, Any]:
        return self._budget.status(self.privacy.clip_norm)

    def state_dict(self) -> dict[str, Any]:
        """The accountant's history, so a restarted peer never resets the budget it spent."""
        return self._budget.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._budget.load_state_dict(state)

