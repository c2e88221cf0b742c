#!/usr/bin/env python3
"""decode_loadgen against echo_server (and decode_server when given): sane JSON, and a
non-zero exit, without hanging, when the server is killed mid-run; overload reported in
the latency; a non-zero exit when an output cannot be written; bench/e2e's script
reading only what its run wrote; every sequence released on every way out (a failed
prefill, decode errors, SIGTERM, an exception); --help; progress lines; --sweep's CSV.

    python3 test_loadgen.py --loadgen L --echo_server E [--decode_server S]
"""
import argparse
import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

from sds_testutil import ServerProcess, free_port

ARGS = None
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = ["--num_layers=2", "--num_q_heads=8", "--num_kv_heads=2", "--head_dim=64"]


def listening(address):
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=1):
        return True


class LoadgenTest(unittest.TestCase):
    def run_loadgen(self, target, *flags, timeout=120, env=None):
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        out.close()
        self.addCleanup(os.unlink, out.name)
        argv = [ARGS.loadgen, f"--target={target}", f"--json_out={out.name}",
                "--prefill_len=64", "--topk=32", "--warmup_s=0.3", "--timeout_ms=2000"]
        proc = subprocess.run(argv + list(flags), capture_output=True, text=True,
                              timeout=timeout, env=env)
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
        self.assertAlmostEqual(s["tokens_per_s"], s["token_layers_per_s"] / s["model"]["num_layers"],
                               delta=1e-3)
        lat = s["latency_us"]
        self.assertEqual(lat["count"], s["calls_ok"] + s["not_sent_charged"])
        self.assertTrue(0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p999"] <= lat["max"])
        self.assertLess(lat["max"], 2_000_000 + 100_000)  # bounded by the deadline
        self.assertEqual(s["server_queue_us"]["count"], s["token_layers_ok"])
        self.assertEqual(s["errors_total"], 0)
        self.assertEqual(s["errors"], {})
        self.assertIn("request", s["errors_unit"])
        self.assertFalse(s["aborted"])
        self.assertEqual(s["model"]["num_q_heads"], 8)
        # The load generator's own CPU over the window: some, at most every core it has.
        cores = s["client_cpu_cores"]
        self.assertTrue(0 < cores <= (os.cpu_count() or 1) * 1.1, cores)
        self.assertAlmostEqual(s["client_cpu_us_per_token_layer"],
                               cores * 1e6 / s["token_layers_per_s"],
                               delta=1e-3 * s["client_cpu_us_per_token_layer"] + 1e-3)

    def echo(self):
        server = ServerProcess([ARGS.echo_server] + SHAPE, listening, name="echo_server")
        self.addCleanup(server.stop)
        return server

    def test_echo_all_modes(self):
        server = self.echo()
        for mode, flags, batch in [
                ("unary", ["--concurrency=4"], 1),
                ("stream", ["--concurrency=4", "--channels=2"], 1),  # auto: sync
                ("stream", ["--concurrency=8", "--channels=2"], 1),  # auto: callback
                ("batch", ["--concurrency=2", "--batch_size=8"], 8)]:
            with self.subTest(mode=mode, flags=flags):
                proc, s = self.run_loadgen(server.address, f"--mode={mode}", "--duration_s=1.5",
                                           *flags)
                self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
                self.assertIn("client latency", proc.stdout)
                self.check_sane(s, mode, batch)
                if mode == "stream":
                    self.assertEqual(s["stream_api"],
                                     "sync" if "--concurrency=4" in flags else "callback")

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

    def test_open_loop_overload_charges_the_unsent(self):
        # One caller cannot keep up with 50k arrivals/s: most are never sent. They must
        # show in the latency (their wait until the end), not vanish from it.
        server = self.echo()
        proc, s = self.run_loadgen(server.address, "--mode=unary", "--rate=50000",
                                   "--concurrency=1", "--duration_s=1", "--warmup_s=0")
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)  # overload != error
        self.assertGreater(s["not_sent"], 1000, s)
        self.assertGreater(s["not_sent_charged"], 1000, s)
        self.assertLessEqual(s["not_sent_charged"], s["not_sent"])
        lat = s["latency_us"]
        self.assertEqual(lat["count"], s["calls_ok"] + s["not_sent_charged"])
        # Most samples are arrivals still waiting: the median is a large part of the run,
        # and nothing waited longer than the run lasted.
        self.assertGreater(lat["p50"], 100_000, lat)
        self.assertLess(lat["max"], 1_200_000 + 300_000, lat)
        self.assertIn("OVERLOAD: not sent before the end", proc.stdout)
        self.assertIn("charged their wait so far", proc.stdout)
        self.assertIn("OVERLOAD", proc.stderr)

    def test_unwritable_outputs_fail_the_run(self):
        server = self.echo()
        missing = os.path.join(tempfile.mkdtemp(prefix="lgout_"), "no_such_dir")
        flags = ["--mode=unary", "--duration_s=0.3", "--warmup_s=0"]
        no_gnuplot = dict(os.environ, PATH=tempfile.mkdtemp(prefix="lgpath_"))
        for what, extra, env in [("json", [f"--json_out={missing}/run.json"], None),
                                 ("plots dir", [f"--plot_prefix={missing}/run"], None),
                                 ("no gnuplot", [f"--plot_prefix={os.path.dirname(missing)}/run"],
                                  no_gnuplot)]:
            with self.subTest(what=what):
                proc = subprocess.run(
                    [ARGS.loadgen, f"--target={server.address}", "--prefill_len=32",
                     "--topk=16"] + flags + extra,
                    capture_output=True, text=True, timeout=60, env=env)
                self.assertEqual(proc.returncode, 3, proc.stdout + proc.stderr)
                self.assertIn("was not written", proc.stderr)
                self.assertIn("client latency", proc.stdout)  # the table still printed

    def test_plot_data_without_rendering(self):
        # A host without gnuplot (the GPU machine) writes the plots' data and script only,
        # and that is a success: they are rendered elsewhere with `gnuplot <prefix>_plots.gp`.
        server = self.echo()
        out = tempfile.mkdtemp(prefix="lgplots_")
        self.addCleanup(shutil.rmtree, out, ignore_errors=True)
        prefix = os.path.join(out, "run")
        no_gnuplot = dict(os.environ, PATH=tempfile.mkdtemp(prefix="lgpath_"))
        proc = subprocess.run(
            [ARGS.loadgen, f"--target={server.address}", "--prefill_len=32", "--topk=16",
             "--mode=unary", "--duration_s=0.3", "--warmup_s=0", f"--plot_prefix={prefix}",
             "--plot_render=false"],
            capture_output=True, text=True, timeout=60, env=no_gnuplot)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        for suffix in ("_plots.gp", "_latency_time.dat", "_latency_dist.dat"):
            self.assertGreater(os.path.getsize(prefix + suffix), 0, suffix)
        self.assertFalse(os.path.exists(prefix + "_latency_dist.png"))
        with open(prefix + "_plots.gp") as f:
            self.assertIn(prefix + "_latency_dist.dat", f.read())

    def test_e2e_script_reads_only_this_runs_outputs(self):
        if not ARGS.decode_server or not os.path.exists(ARGS.decode_server):
            self.skipTest("decode_server not built")
        work = tempfile.mkdtemp(prefix="e2e_script_")
        self.addCleanup(shutil.rmtree, work, ignore_errors=True)
        out_dir = os.path.join(work, "out")
        os.makedirs(out_dir)
        case = "echo_small_stream1"
        # A passing run's numbers with a marker no loadgen writes: a fresh file lacks it.
        stale = {"label": "stale", "calls_ok": 1, "errors_total": 0, "token_layers_per_s": 1e9,
                 "latency_us": {"p99": 1}, "server_queue_us": {"p99": 1},
                 "server_compute_us": {"p99": 1}, "stale_marker": True}
        env = dict(os.environ, OUT_DIR=out_dir, SHAPES="small", STREAMS="1", BATCHES="",
                   LAYERS="2", PREFILL="64", DURATION_S="0.3", WARMUP_S="0.1",
                   CPU_THREADS="1")
        for name, real_loadgen in [("loadgen writing its outputs", True),
                                   ("loadgen writing nothing", False)]:
            with self.subTest(name):
                for c in (case, "server_small_stream1"):
                    with open(os.path.join(out_dir, f"{c}.json"), "w") as f:
                        json.dump(dict(stale, label=c), f)
                bin_dir = os.path.join(work, "bin_" + str(real_loadgen))
                os.makedirs(bin_dir, exist_ok=True)
                os.symlink(os.path.abspath(ARGS.echo_server), os.path.join(bin_dir, "echo_server"))
                os.symlink(os.path.abspath(ARGS.decode_server),
                           os.path.join(bin_dir, "decode_server"))
                loadgen = os.path.join(bin_dir, "decode_loadgen")
                real = os.path.abspath(ARGS.loadgen)
                if real_loadgen:
                    os.symlink(real, loadgen)
                else:  # runs, exits 0, writes neither JSON nor plots
                    with open(loadgen, "w") as f:
                        f.write("#!/usr/bin/env python3\nimport os, sys\n"
                                "args = [a for a in sys.argv[1:] if not a.startswith("
                                "('--json_out=', '--plot_prefix='))]\n"
                                f"os.execv({real!r}, [{real!r}] + args)\n")
                    os.chmod(loadgen, 0o755)
                proc = subprocess.run(
                    ["bash", os.path.join(REPO, "bench/e2e/run_e2e_bench.sh"), bin_dir],
                    capture_output=True, text=True, timeout=240, env=env)
                if real_loadgen:
                    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
                    for c in (case, "server_small_stream1"):
                        with open(os.path.join(out_dir, f"{c}.json")) as f:
                            s = json.load(f)
                        self.assertNotIn("stale_marker", s, f"{c}.json is the stale file")
                        self.assertEqual(s["label"], c)
                        self.assertGreater(s["calls_ok"], 0)
                    self.assertNotIn("1000000000", proc.stdout)  # the stale throughput
                else:
                    self.assertNotEqual(proc.returncode, 0, proc.stdout + proc.stderr[-3000:])
                    self.assertIn(f"{case} did not write", proc.stderr)
                    self.assertFalse(os.path.exists(os.path.join(out_dir, "summary.md")))

    def test_work_ceiling_script(self):
        """bench/e2e/work_ceiling.sh: an echo spending 1 ms per request is far below the
        plain echo (4 streams share 2 cores at most: <= 2k calls/s); a load generator that
        writes nothing, or a WORK_US list without the plain echo first, fails the run."""
        work = tempfile.mkdtemp(prefix="work_ceiling_")
        self.addCleanup(shutil.rmtree, work, ignore_errors=True)
        bin_dir = os.path.join(work, "bin")
        os.makedirs(bin_dir)
        os.symlink(os.path.abspath(ARGS.echo_server), os.path.join(bin_dir, "echo_server"))
        os.symlink(os.path.abspath(ARGS.loadgen), os.path.join(bin_dir, "decode_loadgen"))
        out_dir = os.path.join(work, "out")
        env = dict(os.environ, OUT_DIR=out_dir, WORK_US="0 1000", CASES="stream4", ROUNDS="1",
                   DURATION_S="0.5", WARMUP_S="0.1", PREFILL="64")
        script = os.path.join(REPO, "bench/e2e/work_ceiling.sh")
        proc = subprocess.run(["bash", script, bin_dir], capture_output=True, text=True,
                              timeout=120, env=env)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        rows = {}
        for line in proc.stdout.splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) == 6 and cells[0] == "stream4":
                rows[cells[1]] = float(cells[4])
        self.assertEqual(set(rows), {"0", "1000"}, proc.stdout)
        self.assertEqual(rows["0"], 1.0)
        self.assertLess(rows["1000"], 0.7, proc.stdout)

        with self.subTest("WORK_US without 0 first"):
            proc = subprocess.run(["bash", script, bin_dir], capture_output=True, text=True,
                                  timeout=60, env=dict(env, WORK_US="3 0"))
            self.assertEqual(proc.returncode, 2, proc.stderr)
        with self.subTest("loadgen writing nothing"):
            loadgen = os.path.join(bin_dir, "decode_loadgen")
            os.unlink(loadgen)
            real = os.path.abspath(ARGS.loadgen)
            with open(loadgen, "w") as f:  # runs, exits 0, writes no JSON
                f.write("#!/usr/bin/env python3\nimport os, sys\n"
                        "args = [a for a in sys.argv[1:] if not a.startswith('--json_out=')]\n"
                        f"os.execv({real!r}, [{real!r}] + args)\n")
            os.chmod(loadgen, 0o755)
            proc = subprocess.run(["bash", script, bin_dir], capture_output=True, text=True,
                                  timeout=120, env=env)
            self.assertNotEqual(proc.returncode, 0, proc.stdout)
            self.assertIn("wrote no JSON", proc.stderr)

    def test_requests_bound(self):
        server = self.echo()
        proc, s = self.run_loadgen(server.address, "--mode=unary", "--concurrency=2",
                                   "--duration_s=0", "--requests=300", "--warmup_s=0")
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertEqual(s["calls_ok"], 300)

    def test_killed_server_fails_fast(self):
        for api in ("sync", "callback"):
            with self.subTest(stream_api=api):
                self.check_killed_server_fails_fast(api)

    def check_killed_server_fails_fast(self, api):
        server = self.echo()
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        out.close()
        self.addCleanup(os.unlink, out.name)
        start = time.monotonic()
        proc = subprocess.Popen(
            [ARGS.loadgen, f"--target={server.address}", "--mode=stream", "--concurrency=4",
             f"--stream_api={api}", "--duration_s=30", "--warmup_s=0", "--prefill_len=32",
             "--topk=16", "--stall_s=2", "--timeout_ms=1000", f"--json_out={out.name}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(2.0)
        server.kill()
        output, _ = proc.communicate(timeout=30)
        elapsed = time.monotonic() - start
        self.assertNotEqual(proc.returncode, 0, output)
        self.assertLess(elapsed, 15, "loadgen did not notice the dead server")
        with open(out.name) as f:
            s = json.load(f)
        self.assertEqual(s["stream_api"], api)
        self.assertGreater(s["errors_total"], 0)
        self.assertIn("UNAVAILABLE", s["errors"])
        self.assertTrue(s["aborted"])
        self.assertIn("FAILED", output)
        # The dead server's sequences cannot be released: said, not waited for.
        self.assertIn("could NOT release 4 sequences", output)

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
             "--allow_client_shm",
             f"--metrics_listen=127.0.0.1:{free_port()}"] + SHAPE, listening, name="decode_server")
        self.addCleanup(server.stop)
        for mode, flags, batch in [("stream", ["--concurrency=4", "--stream_api=sync"], 1),
                                   ("stream", ["--concurrency=4", "--stream_api=callback"], 1),
                                   ("batch", ["--concurrency=1", "--batch_size=8"], 8),
                                   # DecodeLayer over a shared-memory region per worker
                                   ("batch", ["--concurrency=2", "--batch_size=8",
                                              "--transport=shm"], 8)]:
            with self.subTest(mode=mode, flags=flags):
                proc, s = self.run_loadgen(server.address, f"--mode={mode}", "--duration_s=1.5",
                                           *flags)
                self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
                self.check_sane(s, mode, batch)
                self.assertEqual(s["backend"], "cpu")
                self.assertGreater(s["server_compute_us"]["max"], 0)
        # Every worker's region was unregistered at the end.
        from sparse_decode_client import DecodeClient
        with DecodeClient(server.address, timeout=10) as c:
            self.assertEqual(c.list_regions(), [])


class LoadgenCleanupTest(unittest.TestCase):
    """The sequences a run created are gone when it ends, whichever way it ends: the
    server's pages are all free again (a failed prefill once left 2009 of 2048 used)."""

    # 64 pages of 16 tokens; a sequence of FLAGS reserves 6 (81 tokens): 10 fit.
    FLAGS = ["--prefill_len=64", "--max_new_tokens=16", "--topk=32", "--timeout_ms=2000",
             "--warmup_s=0.2"]

    def setUp(self):
        if not ARGS.decode_server or not os.path.exists(ARGS.decode_server):
            self.skipTest("decode_server not built")
        self.server = ServerProcess(
            [ARGS.decode_server, "--backend=cpu", "--page_size=16", "--cache_pages=64",
             "--cpu_threads=1", "--max_topk=64", f"--metrics_listen=127.0.0.1:{free_port()}"]
            + SHAPE,
            listening, name="decode_server")
        self.addCleanup(self.server.stop)
        self.assertAllPagesFree()

    def assertAllPagesFree(self, output=""):
        from sparse_decode_client import DecodeClient
        with DecodeClient(self.server.address, timeout=10) as c:
            info = c.model_info()
        self.assertEqual(info.total_pages, 64)
        self.assertEqual(info.free_pages, info.total_pages, output)

    def loadgen(self, *flags, env=None):
        argv = [ARGS.loadgen, f"--target={self.server.address}"] + self.FLAGS + list(flags)
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)

    def test_failed_prefill(self):
        # 20 sequences do not fit: the prefill fails with ~10 created.
        proc = self.loadgen("--mode=stream", "--concurrency=20", "--duration_s=1")
        out = proc.stdout + proc.stderr
        self.assertEqual(proc.returncode, 2, out)
        self.assertIn("prefill failed: RESOURCE_EXHAUSTED", proc.stderr)
        m = re.search(r"released (\d+) sequences", proc.stderr)
        self.assertTrue(m, out)
        self.assertGreaterEqual(int(m.group(1)), 8, out)
        self.assertAllPagesFree(out)

    def check_failed_and_released(self, exit_code, says, *flags, env=None):
        """A run of 3 sequences that fails with `exit_code`, printing `says`, and
        releases all 3."""
        proc = self.loadgen("--concurrency=3", *flags, env=env)
        out = proc.stdout + proc.stderr
        self.assertEqual(proc.returncode, exit_code, out)
        self.assertIn(says, out)
        self.assertIn("released 3 sequences", proc.stderr)
        self.assertAllPagesFree(out)

    def test_decode_errors(self):
        # Top-K above the server's --max_topk (64) fails every decode; the run aborts.
        self.check_failed_and_released(1, "ABORTED", "--mode=unary", "--topk=128",
                                       "--duration_s=5", "--stall_s=1")

    def test_exception(self):
        env = dict(os.environ, DECODE_LOADGEN_TEST_THROW="after_prefill")
        self.check_failed_and_released(4, "FAILED: exception", "--duration_s=1", env=env)

    def test_sigterm_mid_run(self):
        out_json = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        out_json.close()
        self.addCleanup(os.unlink, out_json.name)
        proc = subprocess.Popen(
            [ARGS.loadgen, f"--target={self.server.address}", "--mode=batch", "--batch_size=4",
             "--concurrency=2", "--duration_s=60", "--progress_s=0.3",
             f"--json_out={out_json.name}"] + self.FLAGS,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The second progress line: the run is well under way (and lines keep coming).
        progress = []
        deadline = time.monotonic() + 30
        while len(progress) < 2 and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            m = re.match(r"decode_loadgen: ([\d.]+) s: (\d+) calls, (\d+) token-layers/s "
                         r"\(last [\d.]+ s\), (\d+) errors", line)
            if m:
                progress.append([float(g) for g in m.groups()])
        self.assertEqual(len(progress), 2, "no progress lines")
        self.assertLess(progress[0][1], progress[1][1])  # calls go up
        self.assertGreater(progress[1][2], 0)            # token-layers/s
        self.assertEqual(progress[1][3], 0)              # errors
        self.assertAlmostEqual(progress[1][0] - progress[0][0], 0.3, delta=0.15)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
        out = stdout + stderr
        self.assertLess(time.monotonic() - started, 10, out)
        self.assertEqual(proc.returncode, 128 + signal.SIGTERM, out)
        self.assertIn("released 8 sequences", stderr)
        self.assertIn("INTERRUPTED", stdout)
        with open(out_json.name) as f:
            s = json.load(f)
        self.assertTrue(s["interrupted"])
        self.assertGreater(s["calls_ok"], 0)
        self.assertAllPagesFree(out)

    def test_sweep_stops_at_a_failed_point(self):
        # The second point's 20 sequences do not fit: a failed (partial) sweep.
        csv_path = os.path.join(tempfile.mkdtemp(prefix="lgsweep_"), "sweep.csv")
        proc = self.loadgen("--mode=stream", "--duration_s=0.5", "--sweep=concurrency:2,20,4",
                            f"--csv={csv_path}")
        out = proc.stdout + proc.stderr
        self.assertEqual(proc.returncode, 2, out)
        self.assertIn("sweep stopped at concurrency=20", proc.stderr)
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual([r["value"] for r in rows], ["2", "20"], out)
        self.assertEqual(rows[0]["result"], "ok")
        self.assertTrue(rows[1]["result"].startswith("FAILED: prefill failed"), rows[1])
        self.assertAllPagesFree(out)


class LoadgenCliTest(unittest.TestCase):
    def test_help_lists_every_flag(self):
        proc = subprocess.run([ARGS.loadgen, "--help"], capture_output=True, text=True,
                              timeout=30)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        with open(os.path.join(REPO, "client/loadgen/config.cc")) as f:
            names = re.findall(r"ABSL_FLAG\(\s*[\w:]+,\s*(\w+),", f.read())
        self.assertGreater(len(names), 25)
        lines = proc.stdout.splitlines()
        for name in names:
            with self.subTest(flag=name):
                at = [i for i, l in enumerate(lines) if l.startswith(f"  --{name} (default: ")]
                self.assertEqual(len(at), 1, proc.stdout)
                self.assertGreater(len(lines[at[0] + 1].strip()), 10)  # its help text
        for new in ("sweep", "csv", "progress_s", "release_timeout_s"):
            self.assertIn(new, names)

    def test_sweep_csv(self):
        server = ServerProcess([ARGS.echo_server] + SHAPE, listening, name="echo_server")
        self.addCleanup(server.stop)
        csv_path = os.path.join(tempfile.mkdtemp(prefix="lgsweep_"), "sweep.csv")
        proc = subprocess.run(
            [ARGS.loadgen, f"--target={server.address}", "--mode=stream", "--prefill_len=32",
             "--topk=16", "--duration_s=0.5", "--warmup_s=0.1", "--sweep=streams:1,2,8",
             f"--csv={csv_path}"], capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual([(r["dimension"], r["value"]) for r in rows],
                         [("concurrency", "1"), ("concurrency", "2"), ("concurrency", "8")])
        for r in rows:
            self.assertEqual(r["result"], "ok", r)
            self.assertEqual(r["concurrency"], r["value"])
            self.assertGreater(int(r["calls"]), 0, r)
            self.assertGreater(float(r["token_layers_per_s"]), 0, r)
            self.assertEqual(int(r["errors"]), 0, r)
            self.assertTrue(0 < int(r["p50_us"]) <= int(r["p90_us"]) <= int(r["p99_us"]), r)
        self.assertEqual(proc.stdout.count("client latency"), 3)  # a table per point

    def test_bad_sweep(self):
        for spec in ("concurrency", "warp:1,2", "concurrency:1,x", "concurrency:0", "rate:-1"):
            with self.subTest(spec=spec):
                proc = subprocess.run([ARGS.loadgen, f"--sweep={spec}"], capture_output=True,
                                      text=True, timeout=30)
                self.assertEqual(proc.returncode, 2, proc.stderr)
                self.assertIn("--sweep", proc.stderr)


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
