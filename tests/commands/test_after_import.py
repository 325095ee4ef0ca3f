"""after_import: a callback when a module is imported, without importing it (the CLI's logging set-up
must not load hivemind and torch for a command that ends before it needs them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from swarmgrad.after_import import after_import


def test_the_callback_runs_once_right_after_the_module_executes(tmp_path, monkeypatch):
    (tmp_path / "late_module.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    finders = len(sys.meta_path)

    def callback() -> None:
        seen.append(sys.modules["late_module"].VALUE)  # executed by then

    after_import("late_module", callback)
    assert seen == []
    import late_module  # noqa: F401

    assert seen == [42] and len(sys.meta_path) == finders  # the finder removed itself
    monkeypatch.delitem(sys.modules, "late_module")


def test_an_imported_module_gets_the_callback_at_once():
    seen: list[str] = []
    after_import("json", lambda: seen.append("now"))
    assert seen == ["now"]


def test_configuring_logging_loads_no_hivemind_yet_hivemind_logs_through_the_root_logger():
    script = textwrap.dedent("""
        import logging, sys
        from swarmgrad.eventloop import configure_logging
        configure_logging(logging.INFO)
        assert "hivemind" not in sys.modules and "torch" not in sys.modules
        from hivemind.utils.logging import get_logger
        logger = get_logger("hivemind.p2p")
        assert logger.getEffectiveLevel() == logging.WARNING  # hivemind no louder than WARNING at INFO
        hivemind = logging.getLogger("hivemind")
        assert hivemind.propagate and not hivemind.handlers
        logger.warning("routed")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "WARN" in done.stderr and "hivemind.p2p: routed" in done.stderr  # our one-line format
