#!/usr/bin/env python3
"""decode_loadgen against echo_server (and decode_server when given): sane JSON, and a
non-zero exit, without hanging, when the server is killed mid-run.

    python3 test_loadgen.py --loadgen L --echo_server E [--decode_server S]
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest

from sds_testutil import ServerProcess, free_port

ARGS = None
SHAPE = ["--num_layers=2", "--num_q_heads=8", "--num_kv_heads=2", "--head_dim=64"]


def listening(address):
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=1):
        return True


class LoadgenTest(unittest.TestCase):
    def run_loadgen(self, target, *flags, timeout=120):
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        out.close()
        self.addCleanup(os.unlink, out.name)
        argv = [ARGS.loadgen, f"--target={target}", f"--json_out={out.name}",
                "--prefill_len=64", "--topk=32", "--warmup_s=0.3", "--timeout_ms=2000"]
        proc = subprocess.run(argv + list(flags), capture_output=True, text=True,
                              timeout=timeout)
        summary = None
        if os.path.getsize(out.name) > 0:
            with open(out.name) as f:
                summary = json.load(f)
        return proc, summary

    def check_sane(self, s, mode, batch=1):
        self.assertEqual(s["mode"], mode)
        self.assertGreater(s["calls_ok"], 0)
        self.assertEqual(s["token_layers_ok"], s["calls_ok"] * batch)
        self.assertGreater(s["calls_per_s"], 0)
        self.assertAlmostEqual(s["token_layers_per_s"], s["calls_per_s"] * batch, delta=1e-3 * batch + 1)
        lat = s["latency_us"]
        self.assertEqual(lat["count"], s["calls_ok"])
        self.assertTrue(0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p999"] <= lat["max"])
        self.assertLess(lat["max"], 2_000_000 + 100_000)  # bounded by the deadline
        self.assertEqual(s["server_queue_us"]["count"], s["token_layers_ok"])
        self.assertEqual(s["errors_total"], 0)
        self.assertEqual(s["errors"], {})
        self.assertFalse(s["aborted"])
        self.assertEqual(s["model"]["num_q_heads"], 8)

    def echo(self):
        server = ServerProcess([ARGS.echo_server] + SHAPE, listening, name="echo_server")
        self.addCleanup(server.stop)
        return server

    def test_echo_all_modes(self):
        server = self.echo()
        for mode, flags, batch in [("unary", ["--concurrency=4"], 1),
                                   ("stream", ["--concurrency=4", "--channels=2"], 1),
                                   ("batch", ["--concurrency=2", "--batch_size=8"], 8)]:
            with self.subTest(mode=mode):
                proc, s = self.run_loadgen(server.address, f"--mode={mode}", "--duration_s=1.5",
                                           *flags)
                self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
                self.assertIn("client latency", proc.stdout)
                self.check_sane(s, mode, batch)

    def test_echo_open_loop_and_plots(self):
        server = self.echo()
        prefix = tempfile.mkdtemp(prefix="lgplots_")
        proc, s = self.run_loadgen(server.address, "--mode=unary", "--rate=500",
                                   "--concurrency=8", "--duration_s=2",
                                   f"--plot_prefix={prefix}/run")
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.check_sane(s, "unary")
        self.assertEqual(s["loop"], "open")
        # ~500/s for 2 s, Poisson: far from both 0 and the closed-loop rate.
        self.assertTrue(300 < s["calls_ok"] < 1800, s["calls_ok"])
        for png in ("run_latency_time.png", "run_latency_dist.png"):
            path = os.path.join(prefix, png)
            if subprocess.run(["which", "gnuplot"], capture_output=True).returncode == 0:
                self.assertGreater(os.path.getsize(path), 1000, path)

    def test_requests_bound(self):
        server = self.echo()
        proc, s = self.run_loadgen(server.address, "--mode=unary", "--concurrency=2",
                                   "--duration_s=0", "--requests=300", "--warmup_s=0")
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertEqual(s["calls_ok"], 300)

    def test_killed_server_fails_fast(self):
        server = self.echo()
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        out.close()
        self.addCleanup(os.unlink, out.name)
        start = time.monotonic()
        proc = subprocess.Popen(
            [ARGS.loadgen, f"--target={server.address}", "--mode=stream", "--concurrency=4",
             "--duration_s=30", "--warmup_s=0", "--prefill_len=32", "--topk=16",
             "--stall_s=2", "--timeout_ms=1000", f"--json_out={out.name}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(2.0)
        server.kill()
        output, _ = proc.communicate(timeout=30)
        elapsed = time.monotonic() - start
        self.assertNotEqual(proc.returncode, 0, output)
        self.assertLess(elapsed, 15, "loadgen did not notice the dead server")
        with open(out.name) as f:
            s = json.load(f)
        self.assertGreater(s["errors_total"], 0)
        self.assertIn("UNAVAILABLE", s["errors"])
        self.assertTrue(s["aborted"])
        self.assertIn("FAILED", output)

    def test_unreachable_server(self):
        port = free_port()
        proc = subprocess.run([ARGS.loadgen, f"--target=127.0.0.1:{port}", "--duration_s=1",
                               "--timeout_ms=500"], capture_output=True, text=True, timeout=60)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("GetModelInfo", proc.stderr)

    def test_decode_server(self):
        if not ARGS.decode_server or not os.path.exists(ARGS.decode_server):
            self.skipTest("decode_server not built")
        server = ServerProcess(
            [ARGS.decode_server, "--backend=cpu", "--page_size=16", "--cache_pages=4096",
             "--max_batch_size=16", "--max_queue_delay_us=200", "--cpu_threads=1",
             f"--metrics_listen=127.0.0.1:{free_port()}"] + SHAPE, listening, name="decode_server")
        self.addCleanup(server.stop)
        for mode, flags, batch in [("stream", ["--concurrency=4"], 1),
                                   ("batch", ["--concurrency=1", "--batch_size=8"], 8)]:
            with self.subTest(mode=mode):
                proc, s = self.run_loadgen(server.address, f"--mode={mode}", "--duration_s=1.5",
                                           *flags)
                self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
                self.check_sane(s, mode, batch)
                self.assertEqual(s["backend"], "cpu")
                self.assertGreater(s["server_compute_us"]["max"], 0)


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--loadgen", required=True)
    p.add_argument("--echo_server", required=True)
    p.add_argument("--decode_server", default="")
    ARGS, rest = p.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
