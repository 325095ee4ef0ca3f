#!/usr/bin/env python
"""Switch-off check (issue 19): the integration tests that matter most fail when their feature is off.

A test that still passes with the feature it covers switched off does not test that feature. For
each check below this script copies the working tree (tracked and untracked, non-ignored files)
into a fresh temporary directory, applies the check's exact source edits there (the smallest
honest way to switch the feature off), and runs the one test against that copy, real p2pd daemons
and all; first it runs the test on an unmodified copy (the baseline), which must pass. The copy's
``swarmgrad`` shadows the editable install through PYTHONPATH, in child processes too (checked
once before the checks run). An ``old`` string that no longer occurs exactly once stops the
script: the check is stale and must be updated with the code.

    .venv/bin/python scripts/switch_off.py [--only SUBSTRING] [--no-baseline] [--json]

Exit status 0 only if every baseline passed and every switched-off run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import py_compile
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = REPO / ".venv" / "bin" / "python"


@dataclass(frozen=True)
class Edit:
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str


@dataclass(frozen=True)
class Check:
    test: str  # pytest node id
    switched_off: str
    edits: tuple[Edit, ...]


OFF = "  # switch_off.py"
CHECKS = [
    Check("tests/averaging/test_averaging.py::test_four_peers_reach_exact_weighted_mean",
          "moshpit: the averaged result is not written into the tensors (the round still reports ok)",
          (Edit("swarmgrad/averaging/moshpit.py",
                "            self.schema.unflatten_into(allreduce.result, self.tensors)\n",
                f"            pass{OFF}\n"),)),
    Check("tests/averaging/test_averaging.py::test_error_feedback_codecs_track_the_true_mean_over_rounds",
          "error feedback: the residual a lossy codec dropped is never added back into the next update",
          (Edit("swarmgrad/averaging/codecs/feedback.py",
                "corrected = flat.view(shape) if residual is None else flat.view(shape) + residual",
                f"corrected = flat.view(shape){OFF}"),)),
    Check("tests/averaging/test_averaging.py::test_sigkill_mid_round_leaves_survivors_correct_or_unchanged",
          "a failed round changes nothing (invariant 2): a failed round writes what arrived into the tensors",
          (Edit("swarmgrad/averaging/moshpit.py",
                '            logger.info("round %s failed: %s", plan.round_id, result.error)\n            return\n',
                '            logger.info("round %s failed: %s", plan.round_id, result.error)\n'
                f"            self.schema.unflatten_into(allreduce.result, self.tensors){OFF}\n"
                "            return\n"),)),
    Check("tests/dht/test_membership.py::test_forged_malformed_and_oversized_records_are_rejected_and_node_keeps_serving",
          "signed records: a DHT record's signature is not verified",
          (Edit("swarmgrad/dht/records.py",
                'if not verify_signature(fields["pub"], fields["sig"], _signed_part(fields)):',
                f"if False:{OFF}"),)),
    Check("tests/net/test_wire_robustness.py::test_bad_contribution_inside_a_round_fails_it_cleanly[NaN values]",
          "wire: received raw float32 chunks are not checked for NaN/Inf",
          (Edit("swarmgrad/averaging/frames.py", 'check_finite(values, "received tensor")', f"pass{OFF}"),)),
    Check("tests/averaging/test_gossip.py::test_eight_peers_reach_the_weighted_mean_and_conserve_mass",
          "gossip: pushes are not merged into the values (their push-sum weight still is: mass is conserved)",
          (Edit("swarmgrad/averaging/gossip.py", "self.weight = merge(self._values, self.weight, pending)",
                f"self.weight = self.weight + sum(push.weight for push in pending){OFF}"),)),
    Check("tests/averaging/test_private_averaging.py::test_receiver_never_sees_the_raw_update",
          "privacy: released updates are clipped but no noise is added (the budget is still counted)",
          (Edit("swarmgrad/averaging/privacy/release.py", "            if std > 0:\n",
                f"            if False:{OFF}\n"),)),
    Check("tests/net/test_direct.py::test_direct_channel_is_used_when_reachable_and_encrypted_on_the_wire",
          "direct data plane: channels are plain TCP frames, not AES-GCM sealed (both sides)",
          (Edit("swarmgrad/net/direct.py", "channel = EncryptedChannel.take_over(peer_id, reader, writer, name)",
                f"channel = FastChannel.take_over(peer_id, reader, writer, name){OFF}"),
           Edit("swarmgrad/net/direct.py",
                "channel = EncryptedChannel.take_over(pending.peer_id, reader, writer, name)",
                f"channel = FastChannel.take_over(pending.peer_id, reader, writer, name){OFF}"))),
    Check("tests/peer/test_peer_python.py::"
          "test_a_python_peer_takes_the_runs_settings_from_its_manifest_and_refuses_conflicting_ones",
          "run config: settings that conflict with the run's manifest are not refused (RunConfigMismatch)",
          (Edit("swarmgrad/peer/config.py", "    if conflicts:\n        raise RunConfigMismatch",
                f"    if False:{OFF}\n        raise RunConfigMismatch"),)),
    Check("tests/commands/test_peer_cli.py::test_mid_run_joiner_downloads_the_swarms_state",
          "joining: a peer that joins mid-run does not download the swarm's state",
          (Edit("swarmgrad/peer/peer.py", "        if donors:\n            try:\n",
                f"        if False:{OFF}\n            try:\n"),)),
]


@dataclass
class Outcome:
    status: str  # passed | failed | error
    seconds: float
    detail: str  # the first error line of a failure


def copy_tree(target: Path) -> None:
    """Tracked and untracked non-ignored files of the working tree, as they are now."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file() or source.is_symlink():  # a tracked file deleted in the tree is still listed
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name, follow_symlinks=False)


def apply(root: Path, edits: tuple[Edit, ...]) -> None:
    for edit in edits:
        path = root / edit.path
        text = path.read_text()
        if text.count(edit.old) != 1:
            sys.exit(f"stale check: {edit.old!r} occurs {text.count(edit.old)} times in {edit.path}, not once")
        path.write_text(text.replace(edit.old, edit.new))
        py_compile.compile(str(path), doraise=True)


def check_current(checks: list[Check]) -> None:
    """Every edit's ``old`` occurs exactly once in the working tree now: stale checks stop the script at once."""
    for check in checks:
        for edit in check.edits:
            count = (REPO / edit.path).read_text().count(edit.old)
            if count != 1:
                sys.exit(f"stale check {check.test}: {edit.old!r} occurs {count} times in {edit.path}, not once")


def environment(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


SANITY = """import subprocess, sys, swarmgrad
child = subprocess.run([sys.executable, "-c", "import swarmgrad; print(swarmgrad.__file__)"], cwd="/",
                       capture_output=True, text=True, check=True).stdout.strip()
print(swarmgrad.__file__); print(child)"""


def check_imports(root: Path) -> list[str]:
    """Where this process and a child it spawns (elsewhere) import swarmgrad from; must be the copy."""
    out = subprocess.run([str(PYTHON), "-c", SANITY], cwd=root / "tests", env=environment(root), check=True,
                         capture_output=True, text=True).stdout.split()
    if len(out) != 2 or not all(Path(path).resolve().is_relative_to(root.resolve()) for path in out):
        sys.exit(f"the copy's swarmgrad is not the one imported: {out} (copy: {root})")
    return out


def first_error(output: str) -> str:
    """The first ``E`` line of pytest's report, after the source line it points at (``>``); else the summary line."""
    lines = output.splitlines()
    for index, line in enumerate(lines):
        if match := re.match(r"^E\s+(\S.*)", line):
            source = next((l[1:].strip() for l in reversed(lines[:index]) if l.startswith(">")), "")
            return f"{source} → {match.group(1).strip()}" if source else match.group(1).strip()
    for line in lines:
        if match := re.match(r"^(?:FAILED|ERROR) (.*)|^(Timeout.*)", line):
            return (match.group(1) or match.group(2)).strip()
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def run_test(root: Path, test: str, limit: float) -> Outcome:
    argv = [str(PYTHON), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test]
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=root, env=environment(root), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the test and everything it started
        process.communicate()
        return Outcome("error", time.monotonic() - started, f"no result within {limit:.0f} s")
    seconds = time.monotonic() - started
    if process.returncode == 0:
        return Outcome("passed", seconds, "")
    detail = first_error(output)
    broken = process.returncode != 1 or re.search(r"\b(Syntax|Import|Name|Indentation)Error\b", detail)
    return Outcome("error" if broken else "failed", seconds, detail or f"pytest exit code {process.returncode}")


def cell(text: str, limit: int = 220) -> str:
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def markdown(rows: list[dict], seconds: float) -> str:
    def shown(outcome: dict | None) -> str:
        return "skipped" if outcome is None else f"{outcome['status']} ({outcome['seconds']:.1f} s)"

    lines = ["| test | what was switched off | baseline | switched off | how it failed |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| `{row['test'].removeprefix('tests/')}` | {cell(row['switched_off'])} | "
                     f"{shown(row['baseline'])} | {shown(row['off'])} | {cell(row['off']['detail'])} |")
    return "\n".join(lines) + f"\n\n{len(rows)} checks in {seconds:.0f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", metavar="SUBSTRING", help="run only the checks whose test id contains this")
    parser.add_argument("--no-baseline", action="store_true", help="skip the runs on the unmodified copy")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one test run may take (default 600)")
    args = parser.parse_args()
    checks = [check for check in CHECKS if args.only is None or args.only in check.test]
    if not checks:
        parser.error(f"no check's test id contains {args.only!r}")
    check_current(checks)
    started, rows = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="switch-off-") as scratch:
        baseline = Path(scratch) / "baseline"
        copy_tree(baseline)
        print(f"swarmgrad imported from {check_imports(baseline)}", file=sys.stderr)
        for index, check in enumerate(checks):
            copy = Path(scratch) / f"off-{index}"
            copy_tree(copy)
            apply(copy, check.edits)
            base = None if args.no_baseline else run_test(baseline, check.test, args.timeout)
            off = run_test(copy, check.test, args.timeout)
            shutil.rmtree(copy)
            rows.append({"test": check.test, "switched_off": check.switched_off,
                         "edits": [asdict(edit) for edit in check.edits],
                         "baseline": asdict(base) if base else None, "off": asdict(off)})
            print(f"[{index + 1}/{len(checks)}] {check.test}: baseline {base.status if base else 'skipped'}, "
                  f"switched off {off.status} {off.detail[:120]}", file=sys.stderr)
    seconds = time.monotonic() - started
    report = {"checks": rows, "seconds": round(seconds, 1)}
    print(json.dumps(report, indent=2) if args.json else markdown(rows, seconds))
    good = all((row["baseline"] is None or row["baseline"]["status"] == "passed") and row["off"]["status"] == "failed"
               for row in rows)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
