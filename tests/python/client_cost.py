#!/usr/bin/env python3
"""The Python client's own cost per request item and per layer batch: building the
request from the runner's arrays (and serialising it, which gRPC does inside the call)
and reading the answer back, without any RPC.

    python3 client_cost.py [--batch 64] [--hq 32 --hkv 8 --d 128 --topk 512]

Rows: decode_layer (one DecodeLayer message for the whole [B, ...] batch) and
decode_batch (one DecodeRequest per item), from ml_dtypes.bfloat16 arrays, uint16 bits,
float32 arrays (rounded to bf16 on the way) and torch bf16 tensors when torch is installed.
"""
import argparse
import statistics
import time

import ml_dtypes
import numpy as np

from sparse_decode_client import DecodeClient
from sparse_decode_client._stubs import pb
from sparse_decode_client.results import batch_results


def per_call_us(fn, min_seconds=0.3, repeats=5):
    """Median over `repeats` runs of the mean time per call, in microseconds."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.05:
        fn()
        n += 1
    n = max(1, int(n * min_seconds / 0.05))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--topk", type=int, default=512)
    args = p.parse_args()
    b, hq, hkv, d, kk = args.batch, args.hq, args.hkv, args.d, args.topk

    client = DecodeClient("127.0.0.1:1")  # never called: the shape is set below
    client._info = pb.ModelInfo(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    rng = np.random.default_rng(0)
    f32 = {"q": rng.standard_normal((b, hq, d), dtype=np.float32),
           "gate": rng.standard_normal((b, hq, d), dtype=np.float32),
           "k": rng.standard_normal((b, hkv, d), dtype=np.float32),
           "v": rng.standard_normal((b, hkv, d), dtype=np.float32)}
    kinds = {"float32": f32,
             "ml_dtypes bf16": {n: a.astype(ml_dtypes.bfloat16) for n, a in f32.items()}}
    kinds["uint16 bits"] = {n: a.view(np.uint16) for n, a in kinds["ml_dtypes bf16"].items()}
    try:
        import torch
        kinds["torch bf16"] = {n: torch.from_numpy(a).to(torch.bfloat16) for n, a in f32.items()}
    except ImportError:
        torch = None
    indices = rng.integers(0, 1000, size=(b, kk)).astype(np.int32)
    seqs = [f"seq-{i}" for i in range(b)]
    answer = pb.DecodeLayerResponse(error_codes=[0] * b, error_messages=[""] * b,
                                    out=pb.Tensor(dtype=pb.BF16, shape=[b, hq, d],
                                                  data=bytes(2 * b * hq * d)))
    batch_answer = pb.DecodeBatchResponse(responses=[pb.DecodeResponse(
        out=pb.Tensor(dtype=pb.BF16, shape=[hq, d], data=bytes(2 * hq * d)))] * b)

    print(f"B={b} Hq={hq} Hkv={hkv} D={d} K={kk}; microseconds (median of 5 runs)")
    print("build: the request from the arrays; answer: the response to results; per item:")
    print("(build + answer) / B. serialise: SerializeToString, which gRPC runs inside the call")
    print(f"{'path':<14} {'inputs':<15} {'build':>9} {'answer':>8} {'per item':>9} {'serialise':>10}")
    for kind, x in kinds.items():
        layer_args = dict(layer=0, sequence_ids=seqs, positions=[1000] * b, indices=indices, **x)
        if kind != "float32":  # decode_layer takes bf16 only, exactly
            req, ctx = client._layer_request(**layer_args)
            build = per_call_us(lambda: client._layer_request(**layer_args))
            ser = per_call_us(req.SerializeToString)
            ans = per_call_us(lambda: client._layer_result(answer, ctx))
            print(f"{'decode_layer':<14} {kind:<15} {build:>9.1f} {ans:>8.1f} "
                  f"{(build + ans) / b:>9.2f} {ser:>10.1f}")
        items = [dict(sequence_id=seqs[i], layer=0, position=1000, q=x["q"][i], gate=x["gate"][i],
                      k=x["k"][i], v=x["v"][i], indices=indices[i]) for i in range(b)]
        build = per_call_us(lambda: client._batch_request(items))
        ser = per_call_us(client._batch_request(items)[0].SerializeToString)
        ans = per_call_us(lambda: batch_results(batch_answer, seqs, True))
        print(f"{'decode_batch':<14} {kind:<15} {build:>9.1f} {ans:>8.1f} "
              f"{(build + ans) / b:>9.2f} {ser:>10.1f}")


if __name__ == "__main__":
    main()
