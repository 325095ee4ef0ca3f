"""JSON summary of a demo run: time to target accuracy, final and best accuracy, per-peer traffic."""

from __future__ import annotations

from swarmgrad.demo.events import PeerState, RunLog, integer, number

COUNTERS = ("samples", "rounds_ok", "rounds_failed", "bytes_sent", "bytes_received")
TARGETS = (0.85, 0.88)  # accuracies whose times the demo, the lab and the benchmarks report


def summarize(log: RunLog, targets: tuple[float, ...] = TARGETS) -> dict:
    """Plain JSON types only; every float is finite or None, so ``json.dumps(..., allow_nan=False)`` works."""
    evals = [eval_record(log, event) for event in log.sorted_evals()]
    final_accuracy, final_loss = final_result(log, evals)
    peers = {peer.peer_id: peer_record(peer) for peer in log.peers.values()}
    traffic = [peer["bytes_sent"] / max(peer["epochs"], 1) for peer in peers.values() if peer["reported"]]
    return {
        "seconds": _round(log.seconds(log.last_t)),
        "seconds_to": {target_key(target): seconds_to(evals, target) for target in targets},
        "final_accuracy": final_accuracy,
        "final_loss": final_loss,
        "best_accuracy": log.best_accuracy(),
        "evals": evals,
        "peers": peers,
        "bytes_sent_per_peer_per_epoch": _round(sum(traffic) / len(traffic)) if traffic else None,
    }


def target_key(target: float) -> str:
    return f"{target:g}"  # 0.85 -> "0.85", as the keys of `seconds_to`


def seconds_to(evals: list[dict], target: float) -> float | None:
    """Seconds since start of the earliest eval (``evals`` sorted by time) that reached ``target``."""
    return next((record["t"] for record in evals if record["accuracy"] >= target), None)


def eval_record(log: RunLog, event: dict) -> dict:
    return {
        "t": _round(log.seconds(float(event["t"]))),
        "peer_id": event["peer_id"],
        "accuracy": number(event.get("accuracy")),  # RunLog keeps only evals with a numeric accuracy
        "loss": number(event.get("loss")),
        "epoch": integer(event.get("epoch")),
        "step": integer(event.get("step")),
    }


def final_result(log: RunLog, evals: list[dict]) -> tuple[float | None, float | None]:
    """(accuracy, loss) of the latest ``done.final``, else of the latest eval, else (None, None)."""
    finals = log.finals()
    if finals:
        return number(finals[-1].get("accuracy")), number(finals[-1].get("loss"))
    if evals:
        return evals[-1]["accuracy"], evals[-1]["loss"]
    return None, None


def peer_record(peer: PeerState) -> dict:
    return {
        "state": peer.state,
        "reported": peer.progress is not None,
        "steps": peer.step,
        "epochs": peer.epoch,
        **{key: int(peer.stat(key, 0)) for key in COUNTERS},
        "epsilon": peer.stat("epsilon"),
        "reason": stop_reason(peer),
        "error": peer.error,
    }


def stop_reason(peer: PeerState) -> str | None:
    """The peer's own reason, else its error; None while it runs (or if it died silently)."""
    if peer.done is not None and peer.done.get("reason") is not None:
        return str(peer.done["reason"])
    return None if peer.error is None else f"error: {peer.error}"


def _round(value: float) -> float:
    return round(value, 3)
