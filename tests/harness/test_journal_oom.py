"""The evidence a dead worker's message carries about the kernel's OOM killer (/proc/vmstat ``oom_kill``)."""

from __future__ import annotations

from fp8rl import journal as J


def test_sigkilled_worker_names_oom_kills_since_the_run_started(tmp_path, monkeypatch):
    monkeypatch.setattr(J, "OOM_KILLS_AT_START", 3)
    monkeypatch.setattr(J, "oom_kills", lambda: 5)
    why = J.describe_death(tmp_path, "gw0")
    assert "no fatal-signal report" in why
    assert "the kernel's OOM killer killed 2 processes on this machine since the run started" in why


def test_sigkilled_worker_without_oom_kill_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(J, "OOM_KILLS_AT_START", 3)
    monkeypatch.setattr(J, "oom_kills", lambda: 3)
    assert "no OOM kill on this machine since the run started" in J.describe_death(tmp_path, "gw0")


def test_unreadable_vmstat_adds_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(J, "oom_kills", lambda: None)
    assert "OOM kill" not in J.describe_death(tmp_path, "gw0").replace("by the OOM killer", "")


def test_fatal_signal_carries_no_oom_evidence(tmp_path, monkeypatch):
    (tmp_path / "gw0.fault").write_text("Fatal Python error: Segmentation fault\n")
    monkeypatch.setattr(J, "OOM_KILLS_AT_START", 0)
    monkeypatch.setattr(J, "oom_kills", lambda: 1)
    why = J.describe_death(tmp_path, "gw0")
    assert why.startswith("fatal signal: Segmentation fault") and "OOM killer killed" not in why


def test_op_trace_follows_each_run_directory_exact(tmp_path, monkeypatch):
    """A process that runs several conformance runs in turn (in-process ``--no-isolation`` runs) traces each run's
    engine ops into that run's own directory: before, the first run's trace was kept for the life of the process,
    so a later run's breadcrumbs (the op a dying check was in) landed in an earlier run's folder."""
    import faulthandler

    monkeypatch.setattr(J, "_TRACE", {})
    was_enabled = faulthandler.is_enabled()
    try:
        for run in ("a", "b"):
            monkeypatch.setenv(J.TRACE_ENV, str(tmp_path / run))
            J.start_trace("main")
            J.set_current_node(f"check-of-{run}")
            J.enter_op("quantize")
            assert (tmp_path / run / "main.op").read_text().count(f"check-of-{run}") == 1
        J.leave_op()
        assert "check-of-b" not in (tmp_path / "a" / "main.op").read_text()
        J.start_trace("main")  # the same directory again: the trace is kept, not reopened
        assert J._TRACE["trace"].trace_dir == tmp_path / "b"
    finally:
        J._TRACE["trace"].close()
        if was_enabled:
            faulthandler.enable()
