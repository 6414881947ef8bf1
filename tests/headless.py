"""A finished study as a reader opens it, for the browser test (test_e2e.py): an MLflow UI on its
store, and headless Chromium (Debian's package `chromium`) that loads a page and hands back
the text it renders. `browser_or_skip` skips, saying why, where Chromium cannot start."""

from __future__ import annotations

import contextlib
import html
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,900",
    "--virtual-time-budget=15000",
]


def browser_or_skip() -> str:
    """The Chromium binary; the test is skipped, with the reason, where there is none or it cannot start."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("no headless Chromium (Debian's package 'chromium': apt-get install chromium)")
    try:
        rendered(binary, "data:text/html,<p>ready</p>")
    except (subprocess.SubprocessError, OSError, AssertionError) as error:
        pytest.skip(f"Chromium ({binary}) does not start headless here: {error}")
    return binary


def rendered(binary: str, url: str, timeout_s: float = 120) -> str:
    """The text a page shows once its scripts ran (the DOM without its scripts and styles, its tags
    dropped), in a fresh profile."""
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-2000:]
    dom = re.sub(r"(?is)<(script|style)\b.*?</\1>", " ", done.stdout)
    return html.unescape(re.sub(r"<[^>]+>", " ", dom))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def mlflow_ui(store_uri: str, start_timeout_s: float = 180):
    """`mlflow ui` on `store_uri` (one worker), as the README starts it; yields its address."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store_uri, "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{address}/health", timeout=5):
                    break
            except OSError:
                assert server.poll() is None, f"mlflow ui exited with {server.returncode}"
                assert time.monotonic() < deadline, f"mlflow ui did not answer in {start_timeout_s:.0f} s"
                time.sleep(1)
        yield address
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and its workers
        server.wait(timeout=60)
