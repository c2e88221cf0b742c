#!/usr/bin/env python3
"""One layer's decode step through each transport, against its ceilings in the same run.

    python3 bench/layer/layer_bench.py --server HOST:PORT --echo HOST:PORT \
        [--transports bytes,shm,cuda] [--batches 1,8,64,256] [--in_flight 1,4] [--seconds 3]

--server: decode_server started with --allow_client_shm and --num_layers=1 (the model
shape is read from it); --echo: echo_server of the same shape (bench/e2e). Transports:
bytes = DecodeBatch of B requests (tensors in the message), shm = DecodeLayer with the
tensors in a POSIX shared-memory region, cuda = DecodeLayer with them in a CUDA region
(torch; the server on the CUDA backend). Every call of a case repeats the same prebuilt
message (the same tokens rewritten at the same positions), from `in_flight` threads.

For each case: per-call p50/p99 latency and token-layers/s (B items per call) of the
server and of the echo server (the same message answered without work: what gRPC alone
costs), the backend's median compute time per batch (BatchInfo.compute_us: device time
on CUDA, the kernel's wall time on the CPU) and its kernel-only rate B / compute, and
the ratios: rate / echo rate, rate / kernel-only rate, p50 / (compute + echo p50).
With --metrics, where a call's time goes: the server's mean latency per call (admission,
queue and run; the rest of p50 is gRPC and the client), the executor's mean time per
batch (cache bookkeeping, the run and the answers), the last batch's queue wait
(BatchInfo.queue_us: from the item's enqueue to its batch's start) and batches per call.
Writes the table and a JSON file; exits 1 when a case made no call, a call failed or an
item came back with an error.
"""
import argparse
import json
import os
import sys
import threading
import time

import numpy as np

from sparse_decode_client import DecodeClient, float32_to_bf16_bits
from sparse_decode_client._stubs import pb


def scrape(metrics):
    """(sum, count) of the histograms that split a call's time, from /metrics."""
    if not metrics:
        return {}
    import re
    import urllib.request
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    out = {}
    for m in re.finditer(r'^(sds_\w+?)_(sum|count)(\{[^}]*\})? (\S+)$', text, re.M):
        name, kind, labels, value = m.group(1), m.group(2), m.group(3) or "", float(m.group(4))
        key = name + labels
        out.setdefault(key, [0.0, 0.0])[0 if kind == "sum" else 1] = value
    return out


def mean_delta(before, after, key):
    """Mean of histogram `key` over the observations between two scrapes (nan if none)."""
    if key not in after:
        return float("nan"), 0
    s0, c0 = before.get(key, [0.0, 0.0])
    s1, c1 = after[key]
    return ((s1 - s0) / (c1 - c0) if c1 > c0 else float("nan")), int(c1 - c0)


def percentile(values, q):
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


class Case:
    def __init__(self, name, batch, in_flight, call, check):
        self.name, self.batch, self.in_flight, self.call, self.check = (
            name, batch, in_flight, call, check)


def run(calls, check, in_flight, seconds):
    """Thread t calls `calls[t]()` for `seconds` (t < in_flight); returns latencies (s),
    the responses' compute_us and the wall time. Raises on a failed call or item."""
    latencies, compute, errors = [], [], []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def loop(call):
        mine, comp = [], []
        try:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                resp = call()
                mine.append(time.perf_counter() - t0)
                c = check(resp)
                if c is not None:
                    comp.append(c)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)
        with lock:
            latencies.extend(mine)
            compute.extend(comp)

    threads = [threading.Thread(target=loop, args=(calls[t],)) for t in range(in_flight)]
    t_start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t_start
    if errors:
        raise RuntimeError(f"a call failed: {errors[0]}")
    return latencies, compute, wall


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--server", required=True)
    p.add_argument("--echo", required=True)
    p.add_argument("--transports", default="bytes,shm")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--in_flight", default="1,4")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=0.5)
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--prefill", type=int, default=600)
    p.add_argument("--json", default="layer_bench.json")
    p.add_argument("--metrics", default="",
                   help="the server's /metrics host:port: adds where a call's time goes")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    flights = [int(f) for f in args.in_flight.split(",")]
    transports = args.transports.split(",")

    client = DecodeClient(args.server, timeout=60)
    echo = DecodeClient(args.echo, timeout=60)
    hq, hkv, d = client.shape
    rng = np.random.default_rng(7)
    # Calls in flight are a runner's micro-batches: disjoint sequences (and output rows),
    # so that their batches may run side by side.
    n = max(batches) * max(flights)
    seqs = [f"bench-{os.getpid()}-{i}" for i in range(n)]  # a fresh set per run
    for s in seqs:
        client.create_sequence(s, reserve_tokens=args.prefill + 1)
        k = float32_to_bf16_bits(rng.standard_normal((args.prefill, hkv, d)))
        client.append_kv(s, layer=0, start=0, k=k, v=k)
    pos = args.prefill
    q = float32_to_bf16_bits(rng.standard_normal((n, hq, d)))
    gate = float32_to_bf16_bits(rng.standard_normal((n, hq, d)))
    kn = float32_to_bf16_bits(rng.standard_normal((n, hkv, d)))
    vn = float32_to_bf16_bits(rng.standard_normal((n, hkv, d)))
    idx = rng.integers(0, pos + 1, size=(n, args.topk)).astype(np.int32)

    regions = {}
    if "shm" in transports:
        r = client.register_system_region(f"bench-shm-{os.getpid()}", 256 << 20)
        views = {name: r.numpy(a.shape, a.dtype) for name, a in
                 (("q", q), ("gate", gate), ("k", kn), ("v", vn), ("indices", idx))}
        for name, a in (("q", q), ("gate", gate), ("k", kn), ("v", vn), ("indices", idx)):
            views[name][...] = a
        views["out"] = r.numpy((n, hq, d), np.uint16)
        regions["shm"] = (r, views)
    if "cuda" in transports:
        import torch
        mem = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        r = client.register_cuda_region(f"bench-cuda-{os.getpid()}", mem)
        views = {}
        for name, a in (("q", q), ("gate", gate), ("k", kn), ("v", vn), ("indices", idx)):
            t = torch.from_numpy(a.view(np.int16) if a.dtype == np.uint16 else a)
            dt = torch.bfloat16 if a.dtype == np.uint16 else torch.int32
            views[name] = r.torch(a.shape, dt)
            views[name].copy_(t.view(dt).to("cuda"))
        views["out"] = r.torch((n, hq, d), torch.bfloat16)
        torch.cuda.synchronize()
        regions["cuda"] = (r, views)

    def layer_request(b, transport, t):
        """Thread t's call: items t * b .. (t + 1) * b."""
        region, views = regions[transport]
        rows = slice(t * b, (t + 1) * b)
        req = pb.DecodeLayerRequest(layer=0, sequence_ids=seqs[rows], positions=[pos] * b)
        for name in ("q", "gate", "k", "v", "indices", "out"):
            v = views[name][rows]
            addr = v.ctypes.data if isinstance(v, np.ndarray) else v.data_ptr()
            nbytes = v.nbytes if isinstance(v, np.ndarray) else v.numel() * v.element_size()
            t = getattr(req, name)
            t.dtype = pb.INT32 if name == "indices" else pb.BF16
            t.shape.extend(v.shape)
            t.ref.CopyFrom(region.ref(addr, nbytes))
        return req

    def batch_request(b, t):
        return pb.DecodeBatchRequest(requests=[client.make_request(
            seqs[i], layer=0, position=pos, q=q[i], k=kn[i], v=vn[i], gate=gate[i],
            indices=idx[i]) for i in range(t * b, (t + 1) * b)])

    def check_layer(resp):
        if any(c != 0 for c in resp.error_codes):
            i = next(i for i, c in enumerate(resp.error_codes) if c != 0)
            raise RuntimeError(f"item {i}: {resp.error_messages[i]}")
        return resp.batch.compute_us, resp.batch.queue_us

    def check_batch(resp):
        for r in resp.responses:
            if r.error_code != 0:
                raise RuntimeError(r.error_message)
        if not resp.responses:
            return None
        return resp.responses[-1].batch.compute_us, resp.responses[-1].batch.queue_us

    rows, failed = [], False
    for transport in transports:
        for b in batches:
            if transport == "bytes":
                reqs = [batch_request(b, t) for t in range(max(flights))]
                server_calls = [lambda r=r: client._stub.DecodeBatch(r, timeout=60) for r in reqs]
                echo_calls = [lambda r=r: echo._stub.DecodeBatch(r, timeout=60) for r in reqs]
                check = check_batch
            else:
                reqs = [layer_request(b, transport, t) for t in range(max(flights))]
                server_calls = [lambda r=r: client._stub.DecodeLayer(r, timeout=60) for r in reqs]
                echo_calls = [lambda r=r: echo._stub.DecodeLayer(r, timeout=60) for r in reqs]
                check = check_layer
            message_bytes = reqs[0].ByteSize()
            for f in flights:
                try:
                    run(server_calls, check, f, args.warmup)
                    before = scrape(args.metrics)
                    lat, comp, wall = run(server_calls, check, f, args.seconds)
                    after = scrape(args.metrics)
                    run(echo_calls, lambda r: None, f, args.warmup)
                    elat, _, ewall = run(echo_calls, lambda r: None, f, args.seconds)
                except RuntimeError as e:
                    print(f"{transport} B={b} in_flight={f}: {e}", file=sys.stderr)
                    failed = True
                    continue
                if not lat or not elat:
                    print(f"{transport} B={b} in_flight={f}: no calls completed", file=sys.stderr)
                    failed = True
                    continue
                rate = len(lat) * b / wall
                erate = len(elat) * b / ewall
                queue_us = float(np.median([c[1] for c in comp])) if comp else float("nan")
                comp = [c[0] for c in comp]
                compute_us = float(np.median(comp)) if comp else float("nan")
                kernel_rate = b / (compute_us * 1e-6) if comp and compute_us > 0 else float("nan")
                p50, ep50 = percentile(lat, 50), percentile(elat, 50)
                rpc = "DecodeBatch" if transport == "bytes" else "DecodeLayer"
                server_s, _ = mean_delta(before, after,
                                         f'sds_request_latency_seconds{{rpc="{rpc}"}}')
                exec_s, n_batches = mean_delta(before, after, "sds_batch_total_seconds")
                rows.append(dict(
                    server_call_ms=server_s * 1e3, executor_us_per_batch=exec_s * 1e6,
                    queue_us=queue_us,
                    batches_per_call=n_batches / len(lat) if lat else float("nan"),
                    transport=transport, batch=b, in_flight=f, message_bytes=message_bytes,
                    calls=len(lat), p50_ms=p50 * 1e3, p99_ms=percentile(lat, 99) * 1e3,
                    token_layers_per_s=rate, echo_p50_ms=ep50 * 1e3, echo_token_layers_per_s=erate,
                    compute_us=compute_us, kernel_token_layers_per_s=kernel_rate,
                    rate_vs_echo=rate / erate, rate_vs_kernel=rate / kernel_rate,
                    p50_vs_ceiling=p50 / (compute_us * 1e-6 + ep50)))
    for r in regions.values():
        r[0].close()
    hdr = ("transport", "B", "fl", "msg KB", "calls", "p50 ms", "p99 ms", "tok-layers/s",
           "echo p50", "echo rate", "compute us", "kernel rate", "/echo", "/kernel", "p50/ceil",
           "server ms", "queue us", "exec us", "batches")
    print(" | ".join(hdr))
    for r in rows:
        print(" | ".join([r["transport"], str(r["batch"]), str(r["in_flight"]),
                          f"{r['message_bytes'] / 1024:.1f}", str(r["calls"]), f"{r['p50_ms']:.3f}",
                          f"{r['p99_ms']:.3f}", f"{r['token_layers_per_s']:.0f}",
                          f"{r['echo_p50_ms']:.3f}", f"{r['echo_token_layers_per_s']:.0f}",
                          f"{r['compute_us']:.0f}", f"{r['kernel_token_layers_per_s']:.0f}",
                          f"{r['rate_vs_echo']:.2f}", f"{r['rate_vs_kernel']:.2f}",
                          f"{r['p50_vs_ceiling']:.2f}", f"{r['server_call_ms']:.3f}",
                          f"{r['queue_us']:.0f}",
                          f"{r['executor_us_per_batch']:.0f}", f"{r['batches_per_call']:.2f}"]))
    by = {(r["transport"], r["batch"], r["in_flight"]): r for r in rows}
    for (t, b, f), r in sorted(by.items()):
        if t != "bytes" and ("bytes", b, f) in by:
            print(f"{t} / bytes at B={b} in_flight={f}: "
                  f"{r['token_layers_per_s'] / by[('bytes', b, f)]['token_layers_per_s']:.1f}x")
    with open(args.json, "w") as fh:
        json.dump(rows, fh, indent=1)
    expected = len(transports) * len(batches) * len(flights)
    if failed or len(rows) != expected:
        print(f"layer_bench: {len(rows)} of {expected} cases measured", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
