"""kvpack.testing.LocalDaemon against a stand-in daemon (fake_kvpackd.py)."""

import os
import pathlib

import pytest

from kvpack import testing

FAKE = pathlib.Path(__file__).with_name("fake_kvpackd.py")


def test_finds_binary_from_env(monkeypatch):
    monkeypatch.setenv("KVPACKD", str(FAKE))
    assert testing.find_kvpackd() == FAKE


def test_missing_binary_is_reported(monkeypatch, tmp_path):
    monkeypatch.delenv("KVPACKD", raising=False)
    monkeypatch.setenv("KVPACK_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(testing, "REPO", tmp_path)
    assert testing.find_kvpackd() is None
    with pytest.raises(FileNotFoundError):
        testing.LocalDaemon()


def test_starts_scrapes_and_stops(monkeypatch):
    monkeypatch.delenv("KVPACKD_TEST_ARGS", raising=False)
    d = testing.LocalDaemon(binary=FAKE)
    assert d.args()[0] == f"--listen=127.0.0.1:{d.port}", "flag name read from --help"
    with d:
        assert "kvpack_queue_depth 0" in d.scrape()
        proc = d.proc
    assert proc.returncode is not None, "stopped by SIGTERM"
    assert "fake kvpackd serving" in d.log()


def test_unix_socket_target(monkeypatch):
    monkeypatch.delenv("KVPACKD_TEST_ARGS", raising=False)
    monkeypatch.setenv("KVPACK_TEST_UNIX_SOCKET", "1")
    d = testing.LocalDaemon(binary=FAKE)
    assert d.socket_path and d.args()[0] == f"--listen=unix:{d.socket_path}"
    assert d.target == f"unix://{d.socket_path}", "what grpc dials"
    with d:
        assert os.path.exists(d.socket_path), "the daemon listens there"
        assert "kvpack_queue_depth 0" in d.scrape()
    assert not os.path.exists(d.socket_path), "the socket's directory is removed"
    assert testing.LocalDaemon(binary=FAKE, unix_socket=False).target.startswith("127.0.0.1:")


def test_args_override(monkeypatch):
    monkeypatch.setenv("KVPACKD_TEST_ARGS", "--x={port} --y='{metrics_port}'")
    d = testing.LocalDaemon(binary=FAKE)
    assert d.args() == [f"--x={d.port}", f"--y={d.metrics_port}"]


def test_early_exit_is_reported(tmp_path):
    bad = tmp_path / "kvpackd"
    bad.write_text("#!/bin/sh\necho bad flag >&2\nexit 3\n")
    os.chmod(bad, 0o755)
    with pytest.raises(RuntimeError, match="exited with 3"):
        with testing.LocalDaemon(binary=bad):
            pass
