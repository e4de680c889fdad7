"""A server of this project run as a user runs it, for a bench: started, waited for, stopped."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """Ask `proc` to end (SIGTERM), and kill it when it has not ended within `timeout_s` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def started(cmd: list[str], base: str, what: str, log: Path | None = None, timeout_s: float = 1800):
    """Run `cmd` (from the checkout), wait until `base`/v1/health answers 200, yield the process;
    terminate it on leaving. Its output goes to `log` (else nowhere)."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(base + "/v1/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"{what} exited with {proc.returncode} before it served" + (f" (log: {log})" if log else ""))
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} did not serve within {timeout_s:.0f} s")
            time.sleep(1)
        yield proc
    finally:
        stop(proc, timeout_s=60)
        if log:
            out.close()
