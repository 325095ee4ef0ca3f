"""Who matchmaking waits for: members that showed they are alive in a way a record cannot fake.

A presence record says a member exists; anyone can publish one that never averages, and a peer that
crashed leaves one behind until it expires. Matchmaking waits, for the members the moshpit grid puts
in this peer's slice, only for those it has *seen alive*: they declared under a round's key this
peer read, invited or accepted it in a round, or answered a direct probe (``Matchmaker.probe``: a
stream to its matchmaking protocol, which a record alone cannot open; a peer taking the swarm's
state answers ``busy``, which counts as a failed probe). A member seen alive that
was waited for and did not declare (a no-show) is not waited for again until it shows life again;
probes of members not seen alive back off (``PROBE_BACKOFF``, 0.5 s, doubling per no-show or failed probe),
so a listed member that never averages costs at most one matchmaking window, and a fake record
behind no peer costs no more than its failing probes: while a probe of a listed member is in flight,
matchmaking does not end its window early (members whose probes answered at different moments
would group different peers), and probes of a record that never answers grow rare. Members that are
not waited for still take part when they declare in time.

No-shows are counted per member (``no_shows``, shown in ``status()``); they are not misbehaviour
scores: a peer that crashed is not a liar, and a ban would outlast its restart.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

# seconds before a member not seen alive is probed again, doubled per no-show or failed probe since it
# was last seen declaring: an honest peer that missed one window (slow once, or a declaration read
# late) answers the next probe and is waited for again a round later, while one that answers probes
# and never declares costs a window ever more rarely (at 5 s first, slow honest peers were left out
# of rounds for seconds at a time and fell into catch-up loops)
PROBE_BACKOFF = 0.5
MAX_BACKOFF = 600.0
MAX_TRACKED = 4096  # members remembered (bounded: records come and go for days)


class Attendance:
    """Per member: seen alive, no-shows, when to probe it next. ``clock``: monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._alive: set[str] = set()
        self.no_shows: dict[str, int] = {}  # member -> times it was waited for and did not declare
        self._failures: dict[str, int] = {}  # member -> no-shows and failed probes since it was last seen alive
        self._probe_at: dict[str, float] = {}  # member -> clock time before which it is not probed again
        self._probing: set[str] = set()  # members whose probe is in flight

    def seen_alive(self, peer: str) -> None:
        """``peer`` declared, invited or accepted: waited for again, its backoff forgotten."""
        self._alive.add(peer)
        self._failures.pop(peer, None)
        self._probe_at.pop(peer, None)

    def answered(self, peer: str) -> None:
        """``peer`` answered a probe: waited for again, but its backoff stays, so a peer that answers
        probes and never declares costs a window less and less often."""
        self._probing.discard(peer)
        self._alive.add(peer)

    def is_alive(self, peer: str) -> bool:
        return peer in self._alive

    def waited_for(self, members: Iterable[str], me: str) -> frozenset[str]:
        """Of ``members``, those matchmaking waits for: this peer and the members seen alive."""
        return frozenset(peer for peer in members if peer == me or peer in self._alive)

    def missed(self, peers: Iterable[str]) -> None:
        """``peers`` were waited for the whole window and did not declare: no longer waited for."""
        for peer in peers:
            self._alive.discard(peer)
            self.no_shows[peer] = self.no_shows.get(peer, 0) + 1
            self._back_off(peer)

    def probe_failed(self, peer: str) -> None:
        self._probing.discard(peer)
        self._back_off(peer)

    def probing(self, members: Iterable[str]) -> frozenset[str]:
        """Of ``members``, those whose probe is still in flight: not yet known to be waited for or not.
        Matchmaking does not end its window early while one is, or members whose probes answered at
        different moments would each group a different set of peers (a flaky "no group formed")."""
        return frozenset(peer for peer in members if peer in self._probing)

    def to_probe(self, members: Iterable[str], me: str) -> list[str]:
        """Members of ``members`` not seen alive whose probe is due; each is then not due again
        until it fails (which backs it off) or answers."""
        now = self.clock()
        due = [peer for peer in members
               if peer != me and peer not in self._alive and self._probe_at.get(peer, -1.0) <= now]
        for peer in due:
            self._probe_at[peer] = now + MAX_BACKOFF  # in flight: its answer or failure sets the real time
            self._probing.add(peer)
        return due

    def suspects(self) -> list[str]:
        """Members with no-shows that have not shown life since."""
        return sorted(peer for peer in self.no_shows if peer not in self._alive)

    def keep_only(self, members: Iterable[str]) -> None:
        """Forget members no longer listed (their counts too), once the map grows past its bound."""
        if len(self._probe_at) + len(self.no_shows) + len(self._alive) <= MAX_TRACKED:
            return
        keep = set(members)
        self._alive &= keep
        self._probing &= keep
        for table in (self.no_shows, self._failures, self._probe_at):
            for peer in [peer for peer in table if peer not in keep]:
                del table[peer]

    def _back_off(self, peer: str) -> None:
        failures = self._failures.get(peer, 0)
        self._failures[peer] = failures + 1
        self._probe_at[peer] = self.clock() + min(MAX_BACKOFF, PROBE_BACKOFF * 2 ** min(failures, 16))
