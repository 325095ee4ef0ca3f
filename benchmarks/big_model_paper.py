"""1B and 7B parameters on paper, from what ``benchmarks/big_model.py`` measured at 20M-200M.

    python benchmarks/big_model_paper.py REPORT.json [REPORT.json ...] [--sizes 1e9,7e9] [--mbps 100,1000]

Per codec, from the largest model measured (the inputs are printed with the table):

* host RAM beyond model, gradients and Adam: the starters' measured bytes per parameter (steady, and
  peak), times P; the model, its gradients and Adam's moments (16 bytes per parameter) beside it.
* round time = the CPU's share of a round (encoding, reducing, decoding, the outer step: the loopback
  round per parameter where one was measured, else the lab round less its wire time; the lab's quiet
  rounds where the report has them, whose link carried no state served to a joiner) times P, plus
  this peer's bytes of a round (measured bytes per parameter, the busier direction) at the link
  rate. An upper bound where encoding and sending overlap (they stream chunk by chunk); with a
  loopback case, the measured lab round is printed beside the same sum at its own size as a check.
* join time = the state a fresh joiner takes (model, outer momentum and Adam's moments: 16 bytes per
  parameter) at the link rate, divided by the download efficiency measured in the lab (bytes at the
  link rate / download seconds), plus the verification (a fixed sample of parts: its measured seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

STATE_BYTES_PER_PARAM = 16  # model fp32 4 + outer momentum 4 + Adam's two moments 8
MODEL_BYTES_PER_PARAM = 16  # fp32 weights 4, gradients 4, Adam 8: what the budget is beyond


def cases(paths: list[str]) -> list[dict[str, Any]]:
    found = []
    for path in paths:
        with open(path) as file:
            found += [case for case in json.load(file)["cases"] if case.get("status") == "ok"]
    return found


def largest(found: list[dict], network: str, codec: str) -> dict | None:
    matching = [case for case in found if case["network"] == network and case["codec"] == codec]
    return max(matching, key=lambda case: case["params"], default=None)


def starters(case: dict, key: str) -> float:
    values = [peer[key] for peer in case["peers"] if peer["role"] == "starter" and peer.get(key) is not None]
    return statistics.median(values)


def _measured(case: dict, key: str) -> bool:
    """Whether every starter of ``case`` has ``key`` (older reports lack the newer figures)."""
    return all(peer.get(key) is not None for peer in case["peers"] if peer["role"] == "starter")


def inputs(found: list[dict], codec: str, link_mbps: float) -> dict[str, float] | None:
    lab, loopback = largest(found, "lab", codec), largest(found, "loopback", codec)
    if lab is None:
        return None
    joiner = next(peer for peer in lab["peers"] if peer["role"] == "joiner")
    link = link_mbps * 1e6 / 8
    sent = max(starters(lab, "round_mb_sent"), starters(lab, "round_mb_received")) * 1e6
    # the lab's quiet rounds, where measured: those whose link carried no state or replay beside them
    # (a joiner's download shares the donors' uplinks for minutes, not every round)
    lab_round = "quiet_round_s" if _measured(lab, "quiet_round_s") else "round_s"
    cpu_s_per_param = (starters(loopback, "round_s") / loopback["params"] if loopback is not None else
                       (starters(lab, lab_round) - starters(lab, "wire_s")) / lab["params"])
    return {
        "lab_params": lab["params"], "loopback_params": loopback["params"] if loopback is not None else None,
        "steady_bpp": starters(lab, "steady_bytes_per_param"), "peak_bpp": starters(lab, "peak_bytes_per_param"),
        "cpu_s_per_param": cpu_s_per_param,
        "wire_bytes_per_param": sent / lab["params"],
        "lab_round_s": starters(lab, lab_round), "lab_round": lab_round, "lab_wire_s": starters(lab, "wire_s"),
        "download_efficiency": (joiner["download_bytes"] / link) / joiner["download_s"],
        "verify_s": joiner.get("verify_s") or 0.0,
    }


def table(found: list[dict], sizes: list[float], rates_mbps: list[float], link_mbps: float) -> str:
    lines = ["| codec | P | link | host RAM beyond model (steady / peak) | model + grads + Adam | round | join |",
             "|---|---|---|---|---|---|---|"]
    notes = []
    for codec in sorted({case["codec"] for case in found}):
        measured = inputs(found, codec, link_mbps)
        if measured is None:
            continue
        check = measured["lab_params"] * measured["cpu_s_per_param"] + \
            measured["wire_bytes_per_param"] * measured["lab_params"] / (link_mbps * 1e6 / 8)
        loopback = measured["loopback_params"]
        notes.append(f"- {codec}: from {measured['lab_params'] / 1e6:.0f}M in the lab"
                     f"{f' and {loopback / 1e6:.0f}M on loopback' if loopback else ''}: {measured['steady_bpp']:.1f} / "
                     f"{measured['peak_bpp']:.1f} B/param; CPU {measured['cpu_s_per_param'] * 1e9:.1f} s per 1B "
                     f"params a round; {measured['wire_bytes_per_param']:.2f} wire bytes per param a round; download "
                     f"at {measured['download_efficiency']:.2f} of the link; verify "
                     f"{measured['verify_s']:.1f} s. " + (
                         f"Check: the lab round measured {measured['lab_round_s']:.1f} s, the sum predicts {check:.1f} s."
                         if loopback else f"The CPU's share is the lab round less its wire time (no loopback case; "
                              f"{'the quiet rounds, no state served beside them' if measured['lab_round'] == 'quiet_round_s' else 'every round'}: "
                              f"{measured['lab_round_s']:.1f} s)."))
        for size in sizes:
            for mbps in rates_mbps:
                rate = mbps * 1e6 / 8
                round_s = size * measured["cpu_s_per_param"] + size * measured["wire_bytes_per_param"] / rate
                join_s = size * STATE_BYTES_PER_PARAM / rate / measured["download_efficiency"] + measured["verify_s"]
                lines.append(f"| {codec} | {size / 1e9:g}B | {mbps:g} Mbit/s | {measured['steady_bpp'] * size / 1e9:.0f} / "
                             f"{measured['peak_bpp'] * size / 1e9:.0f} GB | {MODEL_BYTES_PER_PARAM * size / 1e9:.0f} GB | "
                             f"{round_s / 60:.1f} min | {join_s / 60:.0f} min |")
    return "\n".join(lines + ["", "Measured inputs:"] + notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", help="JSON reports of benchmarks/big_model.py (--out).")
    parser.add_argument("--sizes", default="1e9,7e9", help="Parameters, comma-separated.")
    parser.add_argument("--mbps", default="100,1000", help="Link rates (Mbit/s up and down), comma-separated.")
    parser.add_argument("--lab-mbps", type=float, default=100.0, help="The link rate the lab cases ran at.")
    args = parser.parse_args(argv)
    found = cases(args.reports)
    if not found:
        print("no finished cases in the reports", file=sys.stderr)
        return 1
    print(table(found, [float(s) for s in args.sizes.split(",")], [float(r) for r in args.mbps.split(",")],
                args.lab_mbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
