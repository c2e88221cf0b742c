"""Helpers shared by the Python tests: free ports and server processes."""
import os
import socket
import subprocess
import tempfile
import time


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Starts `argv` (a server taking --listen=127.0.0.1:PORT) and waits until `ready()`."""

    def __init__(self, argv, ready, timeout=60.0, name="server"):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}_", suffix=".log", delete=False)
        self.argv = list(argv) + [f"--listen={self.address}"]
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if ready(self.address):
                    return
            except Exception as e:  # noqa: BLE001  (not up yet)
                last = e
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{name} not ready after {timeout} s ({last}):\n{self.output()}")

    def output(self):
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-4000:]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
