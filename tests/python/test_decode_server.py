#!/usr/bin/env python3
"""The real decode_server (cpu backend) on loopback, driven by the Python client and
checked against a float64 numpy reference over the FP8-quantised K/V.

    python3 test_decode_server.py --server build/server/decode_server
"""
import argparse
import asyncio
import importlib.util
import os
import subprocess
import sys
import types
import unittest

import grpc
import ml_dtypes
import numpy as np

import reference as ref
from sds_testutil import ServerProcess, free_port

from sparse_decode_client import AsyncDecodeClient, DecodeClient, DecodeError, float32_to_bf16_bits

SERVER = None
# 8 query heads over 2 KV heads: G = 4 != Hkv, so h / G and h % Hkv disagree.
HQ, HKV, D, LAYERS, PAGE = 8, 2, 64, 2, 16
PREFILL = 40  # crosses page boundaries


class ServerCase(unittest.TestCase):
    """Runs one server configuration; subclasses set EXTRA_FLAGS and ULPS."""

    EXTRA_FLAGS = []
    ULPS = 2.0

    @classmethod
    def setUpClass(cls):
        if cls is ServerCase:
            raise unittest.SkipTest("base class")
        argv = [SERVER, "--backend=cpu", f"--num_layers={LAYERS}", f"--num_q_heads={HQ}",
                f"--num_kv_heads={HKV}", f"--head_dim={D}", f"--page_size={PAGE}",
                "--cache_pages=256", "--max_batch_size=8", "--max_queue_delay_us=300",
                "--cpu_threads=2", f"--metrics_listen=127.0.0.1:{free_port()}"] + cls.EXTRA_FLAGS

        def ready(address):
            with DecodeClient(address, timeout=2) as c:
                c.model_info()
            return True

        cls.server = ServerProcess(argv, ready, name="decode_server")
        cls.client = DecodeClient(cls.server.address, timeout=30)
        cls.info = cls.client.model_info()
        cls.rng = np.random.default_rng(1234)
        cls.cache = {}  # (seq, layer) -> list of (k_bits [Hkv, D], v_bits [Hkv, D])

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    # -- helpers -------------------------------------------------------------------
    def bf16(self, *shape, scale=1.0):
        return float32_to_bf16_bits(self.rng.standard_normal(shape).astype(np.float32) * scale)

    def prefill(self, seq, n=PREFILL):
        self.client.create_sequence(seq, reserve_tokens=n + 8)
        for layer in range(LAYERS):
            k, v = self.bf16(n, HKV, D, scale=2.0), self.bf16(n, HKV, D)
            # Two appends: the second starts mid-page.
            self.assertEqual(self.client.append_kv(seq, layer=layer, start=0, k=k[:21], v=v[:21]),
                             21)
            self.assertEqual(self.client.append_kv(seq, layer=layer, start=21, k=k[21:], v=v[21:]),
                             n)
            self.cache[(seq, layer)] = [(k[t], v[t]) for t in range(n)]

    def make(self, seq, layer, position, indices, return_lse=True):
        """A request dict, recording its new K/V in the mirror."""
        k, v = self.bf16(HKV, D, scale=2.0), self.bf16(HKV, D)
        rows = self.cache[(seq, layer)]
        self.assertEqual(len(rows), position, "test bug: position gap")
        rows.append((k, v))
        return dict(sequence_id=seq, layer=layer, position=position, q=self.bf16(HQ, D),
                    k=k, v=v, gate=self.bf16(HQ, D), indices=np.asarray(indices, np.int32),
                    return_lse=return_lse)

    def expected(self, req):
        rows = self.cache[(req["sequence_id"], req["layer"])][: req["position"] + 1]
        layer = req["layer"]
        mode = self.info.scale_mode
        ks = self.info.k_scales[layer] if self.info.k_scales else 1.0
        vs = self.info.v_scales[layer] if self.info.v_scales else 1.0
        k_dq = ref.dequantised(np.stack([r[0] for r in rows]), mode, ks)
        v_dq = ref.dequantised(np.stack([r[1] for r in rows]), mode, vs)
        return ref.decode(req["q"], req["gate"], k_dq, v_dq, req["indices"])

    def check(self, req, res):
        want_out, want_lse = self.expected(req)
        got = res.out.astype(np.float64)
        floor = 0.01 * np.max(np.abs(want_out), axis=1, keepdims=True)
        tol = self.ULPS * ref.bf16_ulp(np.maximum(np.abs(want_out), floor)) + 1e-30
        bad = np.abs(got - want_out) > tol
        self.assertFalse(bad.any(), f"{bad.sum()} outputs off, e.g. got {got[bad][:4]} "
                                    f"want {want_out[bad][:4]}")
        if req["return_lse"]:
            self.assertEqual(res.lse.shape, (HQ,))
            finite = np.isfinite(want_lse)
            np.testing.assert_allclose(res.lse[finite], want_lse[finite], rtol=1e-4, atol=1e-4)
            self.assertTrue(np.all(np.isneginf(res.lse[~finite])))

    def random_indices(self, position, k=24, heads=False):
        shape = (HKV, k) if heads else (k,)
        idx = self.rng.integers(0, position + 1, size=shape).astype(np.int32)
        flat = idx.reshape(-1)
        flat[0] = position  # attend to itself
        flat[1] = -1        # skip
        flat[2] = flat[3]   # a duplicate counts twice
        return idx

    # -- tests ---------------------------------------------------------------------
    def test_model_info(self):
        i = self.info
        self.assertEqual((i.num_layers, i.num_q_heads, i.num_kv_heads, i.head_dim),
                         (LAYERS, HQ, HKV, D))
        self.assertEqual(i.kv_dtype, "fp8_e4m3")
        self.assertEqual(i.backend, "cpu")

    def test_decode_shared_and_per_head_indices(self):
        seq = f"{self.id()}"
        self.prefill(seq)
        req = self.make(seq, 0, PREFILL, self.random_indices(PREFILL))
        self.check(req, self.client.decode(**req))
        req = self.make(seq, 1, PREFILL, self.random_indices(PREFILL, heads=True))
        self.check(req, self.client.decode(**req))
        # All indices skipped: out = 0, lse = -inf.
        req = self.make(seq, 0, PREFILL + 1, np.full(8, -1, np.int32))
        res = self.client.decode(**req)
        self.assertTrue(np.all(res.out_bits & 0x7FFF == 0))
        self.assertTrue(np.all(np.isneginf(res.lse)))

    def test_decode_batch_and_invariance(self):
        seqs = [f"{self.id()}-{i}" for i in range(3)]
        for s in seqs:
            self.prefill(s)
        reqs = [self.make(s, layer, PREFILL, self.random_indices(PREFILL, heads=(layer == 1)))
                for s in seqs for layer in range(LAYERS)]
        results = self.client.decode_batch(reqs, raise_on_error=True)
        self.assertEqual(len(results), len(reqs))
        for req, res in zip(reqs, results):
            self.check(req, res)
        # The same request again (same K/V at the same position: allowed) alone: same bits.
        alone = self.client.decode(**reqs[3])
        np.testing.assert_array_equal(alone.out_bits, results[3].out_bits)

    def test_decode_batch_async_calls_in_flight(self):
        seqs = [f"{self.id()}-{i}" for i in range(4)]
        for s in seqs:
            self.prefill(s)
        batches = [[self.make(s, layer, PREFILL, self.random_indices(PREFILL))
                    for layer in range(LAYERS)] for s in seqs]
        calls = [self.client.decode_batch_async(b, raise_on_error=True) for b in batches]
        for batch, call in zip(batches, calls):
            results = call.result()
            self.assertEqual(len(results), len(batch))
            for req, res in zip(batch, results):
                self.check(req, res)

    def test_stream_layer_loop(self):
        seq = f"{self.id()}"
        self.prefill(seq)
        with self.client.stream() as stream:
            for step in range(3):
                pos = PREFILL + step
                for layer in range(LAYERS):
                    req = self.make(seq, layer, pos, self.random_indices(pos, heads=step == 1))
                    self.check(req, stream.call(**req))
            # Several in flight at once, received out of order.
            pos = PREFILL + 3
            reqs = [self.make(seq, layer, pos, self.random_indices(pos)) for layer in range(LAYERS)]
            ids = [stream.send(**r) for r in reqs]
            for req, rid in reversed(list(zip(reqs, ids))):
                self.check(req, stream.result(rid))

    def test_errors(self):
        seq = f"{self.id()}"
        self.prefill(seq)
        q, g = self.bf16(HQ, D), self.bf16(HQ, D)
        k, v = self.bf16(HKV, D), self.bf16(HKV, D)

        def code_of(**kw):
            args = dict(sequence_id=seq, layer=0, position=PREFILL, q=q, k=k, v=v, gate=g,
                        indices=np.arange(4, dtype=np.int32))
            args.update(kw)
            with self.assertRaises(DecodeError) as cm:
                self.client.decode(**args)
            self.assertTrue(cm.exception.message, "error without a message")
            return cm.exception.code

        self.assertEqual(code_of(indices=np.array([0, PREFILL + 1], np.int32)),
                         grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(code_of(indices=np.array([0, -2], np.int32)),
                         grpc.StatusCode.INVALID_ARGUMENT)
        bad_q = q.copy()
        bad_q[0, 0] = 0x7FC0  # NaN
        self.assertEqual(code_of(q=bad_q), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(code_of(layer=LAYERS), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(code_of(sequence_id="no-such-sequence"), grpc.StatusCode.NOT_FOUND)
        self.assertEqual(code_of(position=PREFILL + 5), grpc.StatusCode.FAILED_PRECONDITION)
        with self.assertRaises(DecodeError) as cm:
            self.client.create_sequence(seq)
        self.assertEqual(cm.exception.code, grpc.StatusCode.ALREADY_EXISTS)
        # In a batch, a bad request fails alone.
        good = self.make(seq, 1, PREFILL, self.random_indices(PREFILL))
        bad = dict(good, layer=0, position=PREFILL + 7)
        results = self.client.decode_batch([good, bad], raise_on_error=False)
        self.check(good, results[0])
        self.assertIsInstance(results[1], DecodeError)
        self.assertEqual(results[1].code, grpc.StatusCode.FAILED_PRECONDITION)


class PerTensorScales(ServerCase):
    # Powers of two: x / scale is exact, so the reference's FP8 bits match exactly.
    EXTRA_FLAGS = ["--scale_mode=per_tensor", "--k_scales=0.0625", "--v_scales=0.03125,0.015625"]
    ULPS = 2.0

    def test_scales_reported(self):
        self.assertEqual(self.info.scale_mode, "per_tensor")
        self.assertEqual(list(self.info.k_scales), [0.0625, 0.0625])
        self.assertEqual(list(self.info.v_scales), [0.03125, 0.015625])
        self.assertFalse(self.info.scales_are_default)

    def test_toy_model_example(self):
        here = os.path.dirname(os.path.abspath(__file__))
        example = os.path.join(here, "..", "..", "client", "python", "examples", "toy_model.py")
        proc = subprocess.run([sys.executable, example, "--address", self.server.address,
                               "--prompt_len", "20", "--steps", "2", "--topk", "8"],
                              capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("step 1: position 21", proc.stdout)


class RunnerApiTests:
    """The runner-facing helpers against the real server (mixed into one ServerCase)."""

    def layer_items(self, seqs, layer, position):
        """decode_layer's arguments for `seqs` (each its own inputs, recorded in the
        mirror) and the per-item request dicts that check() takes."""
        items = [self.make(s, layer, position, self.random_indices(position), return_lse=False)
                 for s in seqs]
        stack = {key: np.stack([it[key] for it in items]) for key in ("q", "gate", "k", "v")}
        args = dict(layer=layer, sequence_ids=list(seqs), positions=[position] * len(seqs),
                    indices=np.stack([it["indices"] for it in items]),
                    **{key: a.view(ml_dtypes.bfloat16) for key, a in stack.items()})
        return args, items

    def check_layer(self, items, out):
        for i, item in enumerate(items):
            self.check(item, types.SimpleNamespace(out=np.asarray(out[i], np.float32)))

    def test_layer_batch_from_ml_dtypes(self):
        seqs = [f"{self.id()}-{i}" for i in range(3)]
        for s in seqs:
            self.prefill(s)
        args, items = self.layer_items(seqs, 1, PREFILL)
        res = self.client.decode_layer(**args)
        self.assertEqual((res.out.dtype, res.out.shape), (ml_dtypes.bfloat16, (3, HQ, D)))
        self.check_layer(items, res.out)

    @unittest.skipUnless(importlib.util.find_spec("torch"), "torch is not installed")
    def test_layer_batch_from_torch(self):
        import torch
        seqs = [f"{self.id()}-{i}" for i in range(2)]
        for s in seqs:
            self.prefill(s)
        args, items = self.layer_items(seqs, 0, PREFILL)
        for key in ("q", "gate", "k", "v"):
            args[key] = torch.from_numpy(args[key].view(np.int16)).view(torch.bfloat16)
        args["indices"] = torch.from_numpy(args["indices"])
        res = self.client.decode_layer(**args)
        self.assertEqual(res.out.dtype, torch.bfloat16)
        self.check_layer(items, res.out.float().numpy())

    def test_transformers_layout_is_refused_and_nothing_stored(self):
        seq = self.id()
        self.client.create_sequence(seq)
        k = self.bf16(1, HKV, 6, D)  # [batch, Hkv, T, D]
        with self.assertRaises(ValueError) as cm:
            self.client.append_kv(seq, layer=0, start=0, k=k, v=k)
        self.assertIn(f"[6, {HKV}, {D}], got [1, {HKV}, 6, {D}]", str(cm.exception))
        with self.assertRaises(DecodeError) as cm:  # position 0 was never written
            self.client.decode(seq, layer=0, position=1, q=self.bf16(HQ, D), k=k[0, :, 0],
                               v=k[0, :, 0], gate=self.bf16(HQ, D), indices=[0])
        self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)

    def test_sequence_scope_releases_its_pages(self):
        free = self.client.model_info().free_pages
        with self.client.sequence(self.id(), reserve_tokens=5 * PAGE) as seq:
            self.assertEqual(self.client.model_info().free_pages, free - 5)
            self.client.append_kv(seq.id, layer=0, start=0, k=self.bf16(3, HKV, D),
                                  v=self.bf16(3, HKV, D))
        self.assertEqual(seq.freed_pages, 5)
        self.assertEqual(self.client.model_info().free_pages, free)
        with self.assertRaises(DecodeError) as cm:
            self.client.release_sequence(seq.id)
        self.assertEqual(cm.exception.code, grpc.StatusCode.NOT_FOUND)

    def test_reprefill_after_not_found(self):
        """The server loses a sequence (released here; a restart or an idle expiry looks
        the same: NOT_FOUND); decode_layer re-prefills it from the runner's K/V and the
        answer is the one the never-lost sequence gives."""
        seqs = [f"{self.id()}-{i}" for i in range(3)]
        for s in seqs:
            self.prefill(s)

        def kept(seq):  # the runner's own copy of every layer's K/V
            return {layer: (np.stack([r[0] for r in self.cache[(seq, layer)]]),
                            np.stack([r[1] for r in self.cache[(seq, layer)]]))
                    for layer in range(LAYERS)}

        self.client.release_sequence(seqs[1])
        args, items = self.layer_items(seqs, 0, PREFILL)
        with self.assertRaises(DecodeError) as cm:
            self.client.decode_layer(**args)
        self.assertEqual((cm.exception.index, cm.exception.code), (1, grpc.StatusCode.NOT_FOUND))
        res = self.client.decode_layer(**args, on_not_found=kept)
        self.check_layer(items, res.out)
        # Every layer is back: layer 1 decodes at PREFILL too.
        args, items = self.layer_items(seqs[1:2], 1, PREFILL)
        self.check_layer(items, self.client.decode_layer(**args).out)

    def test_wait_until_ready_while_the_server_starts(self):
        argv = [SERVER, "--backend=cpu", f"--num_layers={LAYERS}", f"--num_q_heads={HQ}",
                f"--num_kv_heads={HKV}", f"--head_dim={D}", "--cache_pages=16",
                f"--metrics_listen=127.0.0.1:{free_port()}"]
        server = ServerProcess(argv, ready=lambda address: True, name="decode_server")
        try:
            with DecodeClient(server.address) as c:
                info = c.wait_until_ready(timeout=60)  # sent before the server listens
                self.assertEqual(info.num_q_heads, HQ)
        finally:
            server.stop()

    def test_readme_example(self):
        """The top README's Python lifecycle runs as written (against this server)."""
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                               "README.md")) as f:
            readme = f.read()
        section = readme[readme.index("## A model runner in Python"):]
        start = section.index("```python\n") + 10
        code = section[start:section.index("\n```", start)]
        code = code.replace("127.0.0.1:50051", self.server.address)
        code += "\nassert out.shape == (B, hq, d) and np.isfinite(out.astype(np.float32)).all()\n"
        free = self.client.model_info().free_pages
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertEqual(self.client.model_info().free_pages, free, "sequences left behind")

    def test_asyncio_client(self):
        seqs = [f"{self.id()}-{i}" for i in range(4)]
        for s in seqs:
            self.prefill(s)
        steps = [self.layer_items(seqs[m::2], 0, PREFILL) for m in range(2)]

        async def run():
            async with AsyncDecodeClient(self.server.address, timeout=30) as c:
                await c.wait_until_ready(timeout=10)
                # Two micro-batches in flight from one task.
                return await asyncio.gather(*(c.decode_layer(**args) for args, _ in steps))

        for (_, items), res in zip(steps, asyncio.run(run())):
            self.check_layer(items, res.out)


class PerTokenHeadScales(RunnerApiTests, ServerCase):
    EXTRA_FLAGS = ["--scale_mode=per_token_head"]
    # scale = max|x|/448 is not a power of two: x / scale may round one FP8 value the
    # other way than x * (1 / scale) would; allow a little more.
    ULPS = 8.0


class ReferenceSelfTest(unittest.TestCase):
    """The reference's FP8 rounding on values whose answer is known by hand."""

    def test_e4m3(self):
        cases = {0.0: 0.0, 448.0: 448.0, 500.0: 448.0, -1e6: -448.0, 1.0: 1.0,
                 1.0625: 1.0,       # tie between 1 and 1.125: to even (1.0)
                 1.1875: 1.25,      # tie between 1.125 and 1.25: to even (1.25)
                 2.0 ** -9: 2.0 ** -9,   # smallest subnormal
                 2.0 ** -10: 0.0,        # tie between 0 and 2^-9: to even (0)
                 3 * 2.0 ** -10: 2.0 ** -8,
                 0.017578125: 0.017578125,  # 9 * 2^-9, subnormal
                 240.0: 240.0, 232.0: 224.0, 248.0: 256.0}
        for x, want in cases.items():
            self.assertEqual(ref.e4m3_round(x), want, f"e4m3({x})")

    def test_bf16_rne(self):
        x = np.array([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5], np.float32)
        np.testing.assert_array_equal(float32_to_bf16_bits(x), [0x3F80, 0x3F82, 0xC020])


def main():
    global SERVER
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True, help="path of decode_server")
    args, rest = p.parse_known_args()
    SERVER = args.server
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
