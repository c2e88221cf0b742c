#!/usr/bin/env python3
"""A toy model runner: prefill a prompt, then decode tokens through every layer.

    python examples/toy_model.py --address 127.0.0.1:50051 --prompt_len 64 --steps 4

Per token and per layer the runner computes q, the new k/v and the gate from its
hidden state (random projections here), picks the top-K positions with a toy
indexer, and sends everything over one DecodeStream kept open for the whole loop.
"""
import argparse
import uuid

import numpy as np

from sparse_decode_client import DecodeClient  # pip install ./client/python


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    rng = np.random.default_rng(args.seed)
    client = DecodeClient(args.address)
    info = client.model_info()
    L, hq, hkv, d = info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim
    print(f"model: {L} layers, {hq}/{hkv} heads, D={d}, backend={info.backend}")

    hidden = hq * d
    proj = {name: rng.standard_normal((L, hidden, n * d), dtype=np.float32) / np.sqrt(hidden)
            for name, n in (("q", hq), ("k", hkv), ("v", hkv), ("g", hq))}
    seq = f"toy-{uuid.uuid4().hex[:8]}"
    client.create_sequence(seq, reserve_tokens=args.prompt_len + args.steps)

    # Prefill: the prompt's K/V for every layer in one AppendKV per layer.
    prompt = rng.standard_normal((args.prompt_len, hidden), dtype=np.float32)
    keys = []  # the indexer's view of each layer's keys (float32)
    for layer in range(L):
        k = (prompt @ proj["k"][layer]).reshape(args.prompt_len, hkv, d)
        v = (prompt @ proj["v"][layer]).reshape(args.prompt_len, hkv, d)
        client.append_kv(seq, layer=layer, start=0, k=k, v=v)
        keys.append(k.mean(axis=1))
    print(f"prefilled {seq}: {args.prompt_len} tokens x {L} layers")

    h = prompt[-1]
    with client.stream() as stream:
        for step in range(args.steps):
            pos = args.prompt_len + step
            for layer in range(L):
                q = (h @ proj["q"][layer]).reshape(hq, d)
                k = (h @ proj["k"][layer]).reshape(hkv, d)
                v = (h @ proj["v"][layer]).reshape(hkv, d)
                g = (h @ proj["g"][layer]).reshape(hq, d)
                keys[layer] = np.vstack([keys[layer], k.mean(axis=0)])
                scores = keys[layer] @ q.mean(axis=0)
                top = np.argsort(-scores)[: args.topk].astype(np.int32)
                res = stream.call(seq, layer=layer, position=pos, q=q, k=k, v=v, gate=g,
                                  indices=top, return_lse=True)
                h = h + res.out.reshape(-1)  # residual
            print(f"step {step}: position {pos}, |h|={np.linalg.norm(h):.3f}, "
                  f"last batch size {res.batch['batch_size']}, lse[0]={res.lse[0]:.3f}")
    client.release_sequence(seq)


if __name__ == "__main__":
    main()
