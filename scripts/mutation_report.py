"""Per-module mutation scores and the surviving mutants of the last ``mutmut run`` (scripts/mutation.sh).

Reads mutmut's results under ./mutants and the reasons in scripts/mutation_survivors.toml. A
survivor listed there (an equivalent mutant: it behaves exactly like the code; or an unreachable
branch) is *explained*. The score is the usual one, killed / (mutants - explained): an equivalent
mutant is no change at all, so no test can or should notice it. "raw" is killed / mutants. A listed
reason whose mutant no longer makes the same change is stale, and counts as unexplained.

Exit status: 0 when every module reaches --min-score and every survivor is explained, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files

SURVIVORS_FILE = Path(__file__).with_name("mutation_survivors.toml")
DETECTED = {"killed", "timeout", "segfault", "caught by type check"}  # the tests (or a limit) noticed
NOT_RUN = {"not checked", "skipped", "check was interrupted by user"}


@dataclass
class ModuleScore:
    path: str
    statuses: Counter = field(default_factory=Counter)
    survivors: list[dict] = field(default_factory=list)

    @property
    def counted(self) -> int:
        return sum(n for status, n in self.statuses.items() if status not in NOT_RUN)

    @property
    def detected(self) -> int:
        return sum(self.statuses[status] for status in DETECTED)

    @property
    def explained(self) -> int:
        return sum(1 for survivor in self.survivors if survivor.get("explained"))

    @property
    def score(self) -> float:
        relevant = self.counted - self.explained
        return self.detected / relevant if relevant else 1.0

    @property
    def raw(self) -> float:
        return self.detected / self.counted if self.counted else 1.0


def changed_lines(diff: str) -> tuple[str, str]:
    """The removed and added lines of a mutant's diff, each stripped and joined by ' / '."""
    lines = diff.splitlines()[2:]  # past the ---/+++ header
    removed = " / ".join(line[1:].strip() for line in lines if line.startswith("-"))
    added = " / ".join(line[1:].strip() for line in lines if line.startswith("+"))
    return removed, added


def collect(reasons: dict[str, dict]) -> list[ModuleScore]:
    scores = []
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        module = ModuleScore(str(path))
        for name, exit_code in sorted(data.exit_code_by_key.items(), key=lambda item: _natural(item[0])):
            status = status_by_exit_code[exit_code]
            module.statuses[status] += 1
            if status in DETECTED or status in NOT_RUN:
                continue
            removed, added = changed_lines(get_diff_for_mutant(name, path=path))
            listed = reasons.get(name)
            survivor = {"mutant": name, "status": status, "removed": removed, "added": added, "reason": None}
            if listed is not None:
                stale = listed.get("added", added) != added
                survivor["reason"] = f"STALE (was: {listed['added']!r})" if stale else listed["reason"]
                survivor["explained"] = not stale
            module.survivors.append(survivor)
        if module.counted:  # a run of some mutants only (a name pattern) leaves the other modules out
            scores.append(module)
    return scores


def _natural(name: str) -> tuple[str, int]:
    stem, _, number = name.rpartition("_")
    return stem, int(number) if number.isdigit() else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-score", type=float, default=0.85, help="lowest acceptable score per module")
    parser.add_argument("--json", action="store_true", help="print the scores and survivors as JSON")
    args = parser.parse_args()
    if not Path("mutants").is_dir():
        print("no mutmut results here: run scripts/mutation.sh first", file=sys.stderr)
        return 2
    reasons = {}
    if SURVIVORS_FILE.exists():
        reasons = {entry["mutant"]: entry for entry in tomllib.loads(SURVIVORS_FILE.read_text())["survivor"]}
    scores = collect(reasons)
    unexplained = [s for module in scores for s in module.survivors if not s.get("explained")]
    failing = [module.path for module in scores if module.score < args.min_score]
    if args.json:
        print(json.dumps([{"module": m.path, "score": round(m.score, 4), "raw": round(m.raw, 4), "mutants": m.counted,
                           "detected": m.detected, "explained": m.explained, "statuses": dict(m.statuses),
                           "survivors": m.survivors}
                          for m in scores], indent=2))
    else:
        print(f"{'module':<44} {'mutants':>7} {'killed':>7} {'survived':>8} {'no tests':>8} {'explained':>9} "
              f"{'raw':>6} {'score':>6}")
        for m in scores:
            print(f"{m.path:<44} {m.counted:>7} {m.detected:>7} {m.statuses['survived']:>8} "
                  f"{m.statuses['no tests']:>8} {m.explained:>9} {m.raw:>6.1%} {m.score:>6.1%}")
        total, detected = sum(m.counted for m in scores), sum(m.detected for m in scores)
        explained = sum(m.explained for m in scores)
        print(f"{'all':<44} {total:>7} {detected:>7} {'':>8} {'':>8} {explained:>9} "
              f"{detected / max(total, 1):>6.1%} {detected / max(total - explained, 1):>6.1%}")
        for m in scores:
            for s in m.survivors:
                mark = "explained" if s.get("explained") else "UNEXPLAINED"
                print(f"\n{s['mutant']} ({s['status']}, {mark})\n  - {s['removed']}\n  + {s['added']}")
                if s["reason"]:
                    print(f"  why: {s['reason']}")
    if failing:
        print(f"\nbelow {args.min_score:.0%}: {', '.join(failing)}", file=sys.stderr)
    if unexplained:
        print(f"{len(unexplained)} survivors have no test and no reason in {SURVIVORS_FILE.name}", file=sys.stderr)
    return 1 if failing or unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
