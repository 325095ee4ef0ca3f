"""`swarmgrad doctor` as a volunteer runs it, on this CPU-only machine: real torch, real p2pd."""

import json
import subprocess
import sys

import torch

SWARMGRAD = [sys.executable, "-m", "swarmgrad"]


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SWARMGRAD, "doctor", *args], capture_output=True, text=True, timeout=120)


def test_doctor_json_on_a_cpu_machine_names_the_cpu_build_fp32_the_whole_batch_and_p2pd():
    result = doctor("--json", "--reachability")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["torch"] == torch.__version__
    assert report["build"] == "cpu-only"
    assert report["device"] == "cpu" and report["gpus"] == []
    assert report["precision"] == "fp32"
    batch = report["micro_batch"]
    assert batch["task"] == "digits" and batch["probed"] is False and batch["size"] == batch["batch_size"] == 32
    assert report["p2pd"]["found"] is True and report["p2pd"]["path"].endswith("hivemind_cli/p2pd")
    node = report["reachability"]  # a node really started on loopback and gave its address
    assert node["node_started"] is True
    assert node["maddrs"] and all(address.startswith("/ip4/127.0.0.1/tcp/") for address in node["maddrs"])
    assert report["warnings"] == []


def test_doctor_lines_name_each_answer_and_a_bad_task_is_one_error_line():
    result = doctor("--task", "charlm")
    assert result.returncode == 0, result.stderr
    lines = {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip() for line in result.stdout.splitlines()}
    assert lines["torch"].endswith("(cpu-only build)") and lines["device auto"] == "cpu"
    assert lines["precision auto"] == "fp32" and lines["p2pd"].startswith("found: ")
    assert lines["micro-batch auto"].startswith("32 of charlm's batch 32: whole batch")
    bad = doctor("--task", "no-such-task")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert [line for line in bad.stderr.splitlines() if line.startswith("error: ")]
