"""A `swarmgrad peer` whose training loop never gets back to see SIGTERM says where it waits: every
thread's stack on stderr (the peer's log) within a few seconds, before a supervisor kills it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from peer_processes import SWARMGRAD

# a task whose loss blocks forever from its 30th batch on: the training loop is stuck in it
STUCK_TASK = '''
import dataclasses, itertools, threading
from swarmgrad.tasks import TaskFactory, get_task

def stuck():
    digits, calls = get_task("digits"), itertools.count(1)

    def loss_fn(outputs, targets):
        if next(calls) == 30:
            print("STUCK", flush=True)
            threading.Event().wait()  # never set
        return digits.loss_fn(outputs, targets)

    return dataclasses.replace(digits, name="stuck", loss_fn=loss_fn)

STUCK = TaskFactory("stuck", lambda options, data_dir: stuck())
'''


def test_a_training_loop_stuck_past_sigterm_dumps_every_threads_stack(tmp_path: Path):
    (tmp_path / "stuck_task.py").write_text(STUCK_TASK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    peer = subprocess.Popen([*SWARMGRAD, "peer", "stuck_task:STUCK", "--run-id", "stuck", "--create", "--json",
                             "--eval-every", "0", "--no-final-eval"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert any(line.startswith("STUCK") for line in peer.stdout), "the task never got stuck"
        peer.send_signal(signal.SIGTERM)
        time.sleep(9)  # the dump comes 6 s after the signal
        peer.send_signal(signal.SIGKILL)
        _, stderr = peer.communicate(timeout=30)
    finally:
        if peer.poll() is None:
            peer.kill()
    assert "Timeout (0:00:06)!" in stderr, stderr[-2000:]
    assert "in loss_fn" in stderr and "in train" in stderr, stderr[-3000:]  # where the training loop waits
