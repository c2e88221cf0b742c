#!/usr/bin/env python3
"""The Python client against an in-process fake server (no decode_server needed): checks
that do not need the real maths.

    python3 test_client_unit.py      (with the package installed; torch tests skip without torch)
"""
import asyncio
import importlib.resources
import importlib.util
import os
import threading
import time
import unittest

import grpc
import ml_dtypes
import numpy as np

import fake_server
from sds_testutil import free_port
from sparse_decode_client import AsyncDecodeClient, DecodeClient, DecodeError
from sparse_decode_client._stubs import pb
from sparse_decode_client.tensors import (bf16_bits, float32_to_bf16_bits, int32_tensor,
                                          read_tensor)

HQ, HKV, D = 4, 2, 8
HAVE_TORCH = importlib.util.find_spec("torch") is not None
REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


class DecodeBatchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server, cls.fake, address = fake_server.start(HQ, HKV, D)
        cls.client = DecodeClient(address, timeout=10)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop(None)

    def requests(self, n):
        z = np.zeros
        return [dict(sequence_id="s", layer=0, position=3, q=z((HQ, D), np.float32),
                     k=z((HKV, D), np.float32), v=z((HKV, D), np.float32),
                     gate=z((HQ, D), np.float32), indices=[0, 1], request_id=i + 1)
                for i in range(n)]

    def test_as_many_responses_as_requests(self):
        self.fake.drop = 0
        results = self.client.decode_batch(self.requests(3))
        self.assertEqual([r.request_id for r in results], [1, 2, 3])

    def test_fewer_or_more_responses_raise(self):
        for drop in (1, 3, -1):
            with self.subTest(drop=drop):
                self.fake.drop = drop
                with self.assertRaises(DecodeError) as e:
                    self.client.decode_batch(self.requests(3))
                self.assertEqual(e.exception.code, grpc.StatusCode.INTERNAL)
                self.assertIn(f"{3 - drop} responses to 3 requests", e.exception.message)


    def test_async_calls_are_in_flight_together(self):
        self.fake.drop = 0
        self.fake.release = threading.Event()
        try:
            calls = [self.client.decode_batch_async(self.requests(n)) for n in (1, 2, 3)]
            # All three wait in the fake at once: none can be done before the release.
            self.assertFalse(any(c.done() for c in calls))
            with self.assertRaises(TimeoutError):
                calls[0].result(timeout=0.05)
            self.fake.release.set()
            for n, c in zip((1, 2, 3), calls):
                self.assertEqual([r.request_id for r in c.result()], list(range(1, n + 1)))
                self.assertTrue(c.done())
        finally:
            self.fake.release = None

    def test_async_errors_are_raised_by_result(self):
        self.fake.drop = 1
        with self.assertRaises(DecodeError) as e:
            self.client.decode_batch_async(self.requests(3)).result()
        self.assertEqual(e.exception.code, grpc.StatusCode.INTERNAL)
        self.assertIn("2 responses to 3 requests", e.exception.message)
        self.fake.drop = 0
        self.fake.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
        try:
            with self.assertRaises(DecodeError) as e:
                self.client.decode_batch_async(self.requests(2)).result()
            self.assertEqual(e.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
        finally:
            self.fake.fail_with = None
        self.fake.release = threading.Event()
        try:
            call = self.client.decode_batch_async(self.requests(2))
            self.assertTrue(call.cancel())
            with self.assertRaises(DecodeError) as e:
                call.result()
            self.assertEqual(e.exception.code, grpc.StatusCode.CANCELLED)
        finally:
            self.fake.release.set()
            self.fake.release = None


class Int32TensorTest(unittest.TestCase):
    def test_round_trip(self):
        for values in ([0, -1, 5], np.array([[1, 2], [3, 2**31 - 1]], np.int64),
                       np.array([7], np.uint32), [], [-(2**31)]):
            with self.subTest(values=values):
                t = int32_tensor(values)
                self.assertEqual(t.dtype, pb.INT32)
                a = read_tensor(t)
                np.testing.assert_array_equal(a.reshape(np.shape(values)),
                                              np.asarray(values, np.int64))

    def test_out_of_range_is_rejected_not_wrapped(self):
        # 2**32 - 1 wraps to -1 ("skip") under a plain cast.
        for values in ([0, 2**32 - 1], np.array([2**31], np.int64),
                       np.array([2**32 - 1], np.uint32), [-(2**31) - 1]):
            with self.subTest(values=values):
                with self.assertRaises(ValueError) as e:
                    int32_tensor(values)
                self.assertIn("outside int32", str(e.exception))

    def test_non_integers_are_rejected(self):
        for values in ([1.5], np.array([True])):
            with self.subTest(values=values):
                with self.assertRaises(TypeError):
                    int32_tensor(values)


def bf16_arrays(rng, *shape):
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


class FakeCase(unittest.TestCase):
    """A fresh fake server and client per test."""

    def setUp(self):
        self.server, self.fake, self.address = fake_server.start(HQ, HKV, D)
        self.client = DecodeClient(self.address, timeout=10)
        self.rng = np.random.default_rng(5)

    def tearDown(self):
        self.client.close()
        self.server.stop(None)

    def layer_args(self, b=3, **kw):
        r = self.rng
        args = dict(layer=0, sequence_ids=[f"s{i}" for i in range(b)], positions=[4] * b,
                    q=bf16_arrays(r, b, HQ, D), gate=bf16_arrays(r, b, HQ, D),
                    k=bf16_arrays(r, b, HKV, D), v=bf16_arrays(r, b, HKV, D),
                    indices=np.zeros((b, 3), np.int32))
        args.update(kw)
        return args


class ShapeTest(FakeCase):
    """Shapes are checked exactly, with both shapes and the likely mistake named."""

    def test_transformers_cache_layout_is_refused_by_append_kv(self):
        self.client.create_sequence("s")
        t = 5
        k = bf16_arrays(self.rng, 1, HKV, t, D)  # transformers' [batch, Hkv, T, D]
        with self.assertRaises(ValueError) as cm:
            self.client.append_kv("s", layer=0, start=0, k=k, v=k)
        msg = str(cm.exception)
        self.assertIn(f"[n, Hkv, D] = [{t}, {HKV}, {D}]", msg)
        self.assertIn(f"got [1, {HKV}, {t}, {D}]", msg)
        self.assertIn("transformers", msg)
        self.assertNotIn("AppendKV", self.fake.calls, "nothing may be sent")
        # [T, Hkv, D] (the fix the message asks for) is taken.
        fixed = np.ascontiguousarray(k[0].transpose(1, 0, 2))
        self.assertEqual(self.client.append_kv("s", layer=0, start=0, k=fixed, v=fixed), t)

    def test_transposed_k_is_refused(self):
        self.client.create_sequence("s")
        k = bf16_arrays(self.rng, 6, HKV, D)
        with self.assertRaises(ValueError) as cm:
            self.client.append_kv("s", layer=0, start=0, k=k.transpose(1, 0, 2), v=k)
        self.assertIn(f"[n, Hkv, D] = [6, {HKV}, {D}], got [{HKV}, 6, {D}]", str(cm.exception))
        self.assertIn("transposed", str(cm.exception))
        with self.assertRaises(ValueError) as cm:  # k and v must agree too
            self.client.append_kv("s", layer=0, start=0, k=k, v=k[:5])
        self.assertIn("v: shape must be", str(cm.exception))

    def test_decode_shapes(self):
        a = self.layer_args(b=1)
        item = dict(layer=0, position=4, q=a["q"][0], gate=a["gate"][0], k=a["k"][0],
                    v=a["v"][0], indices=[0])
        for name, bad in (("q", a["q"]), ("gate", a["gate"][0].T), ("k", a["q"][0]),
                          ("v", a["v"].reshape(1, HKV, 1, D))):
            with self.subTest(name=name):
                with self.assertRaises(ValueError) as cm:
                    self.client.decode("s", **dict(item, **{name: bad}))
                self.assertIn(f"{name}: shape must be", str(cm.exception))
                self.assertIn(f"got {list(bad.shape)}", str(cm.exception))
        with self.assertRaises(ValueError):
            self.client.decode("s", **dict(item, indices=np.zeros((3, 2), np.int32)))

    def test_decode_layer_refuses_a_4d_q(self):
        a = self.layer_args()
        with self.assertRaises(ValueError) as cm:
            self.client.decode_layer(**dict(a, q=a["q"].reshape(3, HQ, 1, D)))
        self.assertIn(f"[B, Hq, D] = [3, {HQ}, {D}], got [3, {HQ}, 1, {D}]", str(cm.exception))

    def test_arguments_are_keyword_only(self):
        a = self.layer_args(b=1)
        with self.assertRaises(TypeError):
            self.client.decode("s", 0, 4, a["q"][0], a["k"][0], a["v"][0], a["gate"][0], [0])
        with self.assertRaises(TypeError):
            self.client.append_kv("s", 0, 0, a["k"], a["v"])


class Bf16Test(FakeCase):
    """bf16 in and out: the fake answers out = q, so out must be q's bits, in q's kind."""

    def test_float32_rounds_to_nearest_even_like_ml_dtypes(self):
        x = np.array([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, np.inf, 3.4e38], np.float32)
        np.testing.assert_array_equal(float32_to_bf16_bits(x),
                                      [0x3F80, 0x3F82, 0xC020, 0x7F80, 0x7F80])
        self.assertTrue(np.isnan(float32_to_bf16_bits([np.nan]).view(ml_dtypes.bfloat16)).all())

    def test_ml_dtypes_round_trip(self):
        a = self.layer_args()
        res = self.client.decode_layer(**a)
        self.assertEqual(res.out.dtype, ml_dtypes.bfloat16)
        np.testing.assert_array_equal(res.out.view(np.uint16), a["q"].view(np.uint16))
        one = self.client.decode("s", layer=0, position=4, q=a["q"][0], gate=a["gate"][0],
                                 k=a["k"][0], v=a["v"][0], indices=[0])
        np.testing.assert_array_equal(one.out_bf16.view(np.uint16), a["q"][0].view(np.uint16))
        np.testing.assert_array_equal(one.out, a["q"][0].astype(np.float32))

    def test_uint16_bits_round_trip(self):
        a = self.layer_args()
        a = {k: (v.view(np.uint16) if isinstance(v, np.ndarray) and v.dtype == ml_dtypes.bfloat16
                 else v) for k, v in a.items()}
        out = self.client.decode_layer(**a).out
        self.assertEqual(out.dtype, np.uint16)
        np.testing.assert_array_equal(out, a["q"])

    @unittest.skipUnless(HAVE_TORCH, "torch is not installed")
    def test_torch_round_trip(self):
        import torch
        a = self.layer_args()
        t = {k: torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16)
             for k, v in a.items() if k in ("q", "gate", "k", "v")}
        res = self.client.decode_layer(**dict(a, **t))
        self.assertIsInstance(res.out, torch.Tensor)
        self.assertEqual(res.out.dtype, torch.bfloat16)
        self.assertTrue(torch.equal(res.out, t["q"]))
        one = self.client.decode("s", layer=0, position=4, q=t["q"][0], gate=t["gate"][0],
                                 k=t["k"][0], v=t["v"][0], indices=torch.zeros(2, dtype=torch.int32))
        self.assertTrue(torch.equal(one.out_torch(), t["q"][0]))
        # float32 tensors are rounded by torch, to the same bits as ml_dtypes rounds them.
        f = torch.randn(HKV, D) * 1e3
        np.testing.assert_array_equal(bf16_bits(f), float32_to_bf16_bits(f.numpy()))
        with self.assertRaises(TypeError):
            self.client.decode_layer(**dict(a, q=t["q"].to(torch.float32)))  # exact dtype


class ErrorTest(FakeCase):
    def test_batch_errors_raise_with_index_code_and_sequence(self):
        self.fake.item_errors = {1: (grpc.StatusCode.FAILED_PRECONDITION.value[0], "gap at 9")}
        a = self.layer_args()
        items = [dict(sequence_id=s, layer=0, position=4, q=a["q"][i], gate=a["gate"][i],
                      k=a["k"][i], v=a["v"][i], indices=[0]) for i, s in enumerate(a["sequence_ids"])]
        for call in (lambda: self.client.decode_batch(items),
                     lambda: self.client.decode_batch_async(items).result(),
                     lambda: self.client.decode_layer(**a)):
            with self.assertRaises(DecodeError) as cm:
                call()
            e = cm.exception
            self.assertEqual((e.index, e.sequence_id, e.code, e.message),
                             (1, "s1", grpc.StatusCode.FAILED_PRECONDITION, "gap at 9"))
            self.assertEqual(str(e), "item 1 (s1): FAILED_PRECONDITION: gap at 9")
        # Opt-in: per-item results.
        results = self.client.decode_batch(items, raise_on_error=False)
        self.assertIsInstance(results[1], DecodeError)
        self.assertEqual(results[1].index, 1)
        self.assertEqual(results[0].out_bits.shape, (HQ, D))
        res = self.client.decode_layer(**a, raise_on_error=False)
        self.assertEqual([e is None for e in res.errors], [True, False, True])
        self.assertFalse(res.ok)


class LifecycleTest(FakeCase):
    def test_sequence_scope_releases_on_exit_and_on_error(self):
        with self.client.sequence("a", reserve_tokens=16) as seq:
            self.assertEqual(seq.id, "a")
            self.assertIn("a", self.fake.sequences)
        self.assertNotIn("a", self.fake.sequences)
        self.assertEqual(seq.freed_pages, 3)
        with self.assertRaises(KeyError):
            with self.client.sequence("b"):
                raise KeyError("the runner's own error")
        self.assertNotIn("b", self.fake.sequences)
        # Gone already (a restart): leaving the block is not an error.
        with self.client.sequence("c"):
            self.fake.sequences.discard("c")
        self.assertEqual(self.fake.calls.count("ReleaseSequence"), 3)

    def test_wait_until_ready(self):
        port = free_port()
        client = DecodeClient(f"127.0.0.1:{port}", timeout=10)
        try:
            t0 = time.monotonic()
            with self.assertRaises(DecodeError) as cm:
                client.wait_until_ready(timeout=0.5)
            self.assertEqual(cm.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
            self.assertIn("not ready within 0.5 s", cm.exception.message)
            self.assertLess(time.monotonic() - t0, 3)
            # A server that comes up later, then answers UNAVAILABLE twice (draining).
            late = []

            def start_late():
                time.sleep(0.4)
                late.append(fake_server.start(HQ, HKV, D, port=port))
                late[0][1].unavailable = 2

            threading.Thread(target=start_late).start()
            info = client.wait_until_ready(timeout=20)
            self.assertEqual(info.num_q_heads, HQ)
            self.assertEqual(late[0][1].calls.count("GetModelInfo"), 3)
        finally:
            client.close()
            for server, _, _ in late:
                server.stop(None)

    def test_reprefill_after_not_found(self):
        """The runner keeps each layer's K/V; an item answered NOT_FOUND (the server lost
        the sequence) has it re-prefilled from there and the call sent again."""
        self.fake.check_sequences = True
        a = self.layer_args()
        kept = {s: {layer: (bf16_arrays(self.rng, 4, HKV, D), bf16_arrays(self.rng, 4, HKV, D))
                    for layer in (0, 1)} for s in a["sequence_ids"]}
        for s in ("s0", "s2"):
            self.fake.sequences.add(s)
        asked = []

        def kv_of(seq):
            asked.append(seq)
            return kept[seq]

        res = self.client.decode_layer(**a, on_not_found=kv_of)
        self.assertTrue(res.ok)
        self.assertEqual(asked, ["s1"])
        self.assertEqual(self.fake.calls.count("DecodeLayer"), 2)
        for layer in (0, 1):
            rows = self.fake.rows[("s1", layer)]
            self.assertEqual(sorted(rows), [0, 1, 2, 3])
            k, v = kept["s1"][layer]
            self.assertEqual(b"".join(rows[t][0] for t in range(4)), k.tobytes())
            self.assertEqual(b"".join(rows[t][1] for t in range(4)), v.tobytes())
        # Without the helper, NOT_FOUND is raised with the item.
        self.fake.sequences.discard("s2")
        with self.assertRaises(DecodeError) as cm:
            self.client.decode_layer(**a)
        self.assertEqual((cm.exception.index, cm.exception.code), (2, grpc.StatusCode.NOT_FOUND))


class AsyncClientTest(FakeCase):
    def test_async_client(self):
        a = self.layer_args()
        self.fake.item_errors = {2: (grpc.StatusCode.INVALID_ARGUMENT.value[0], "NaN in q")}

        async def run():
            async with AsyncDecodeClient(self.address, timeout=10) as c:
                info = await c.wait_until_ready(timeout=5)
                self.assertEqual(c.shape, (HQ, HKV, D))
                async with c.sequence("x", reserve_tokens=8) as seq:
                    self.assertIn(seq.id, self.fake.sequences)
                    k = bf16_arrays(self.rng, 3, HKV, D)
                    self.assertEqual(await c.append_kv(seq.id, layer=1, start=0, k=k, v=k), 3)
                self.assertNotIn("x", self.fake.sequences)
                res = await c.decode_layer(**a, raise_on_error=False)
                np.testing.assert_array_equal(res.out.view(np.uint16), a["q"].view(np.uint16))
                with self.assertRaises(DecodeError) as cm:
                    await c.decode_layer(**a)
                self.assertEqual(cm.exception.index, 2)
                # Several calls in flight from one task.
                self.fake.item_errors = {}
                many = await asyncio.gather(*(c.decode_layer(**a) for _ in range(4)))
                self.assertTrue(all(r.ok for r in many))
                with self.assertRaises(ValueError):
                    await c.append_kv("x", layer=0, start=0, k=k[None].transpose(0, 2, 1, 3), v=k)
                return info

        self.assertEqual(asyncio.run(run()).num_kv_heads, HKV)


class PackageTest(unittest.TestCase):
    def test_the_proto_travels_inside_and_matches_the_repository(self):
        packaged = importlib.resources.files("sparse_decode_client").joinpath(
            "proto/sparse_decode/v1/decode.proto").read_text()
        repo = os.path.join(REPO, "proto", "sparse_decode", "v1", "decode.proto")
        if not os.path.exists(repo):
            self.skipTest("not run from a checkout")
        with open(repo) as f:
            self.assertEqual(packaged, f.read(), "client/python/sparse_decode_client/proto/ is "
                             "a copy of proto/: copy the changed file there")

    def test_typed(self):
        self.assertTrue(importlib.resources.files("sparse_decode_client").joinpath(
            "py.typed").is_file())


if __name__ == "__main__":
    unittest.main(verbosity=2)
