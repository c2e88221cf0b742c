#!/usr/bin/env python3
"""The Python client against an in-process fake server (no decode_server needed): checks
that do not need the real maths.

    python3 test_client_unit.py
"""
import threading
import unittest
from concurrent import futures

import grpc
import numpy as np

from sparse_decode_client import DecodeClient, DecodeError
from sparse_decode_client._stubs import pb, pb_grpc
from sparse_decode_client.tensors import int32_tensor, read_tensor

HQ, HKV, D = 4, 2, 8


class FakeServer(pb_grpc.DecodeServiceServicer):
    """Answers DecodeBatch with `drop` responses fewer than it was sent (or more, < 0)."""

    def __init__(self):
        self.drop = 0
        self.fail_with = None  # a grpc.StatusCode: DecodeBatch aborts with it
        self.release = None    # a threading.Event: DecodeBatch waits for it

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(num_layers=1, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)

    def DecodeBatch(self, request, context):
        if self.release is not None:
            self.release.wait(10)
        if self.fail_with is not None:
            context.abort(self.fail_with, "refused by the fake")
        out = pb.Tensor(dtype=pb.BF16, shape=[HQ, D], data=bytes(2 * HQ * D))
        n = len(request.requests) - self.drop
        reqs = list(request.requests) + [request.requests[0]] * max(0, n - len(request.requests))
        return pb.DecodeBatchResponse(
            responses=[pb.DecodeResponse(request_id=r.request_id, out=out) for r in reqs[:n]])


class DecodeBatchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.fake = FakeServer()
        cls.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_DecodeServiceServicer_to_server(cls.fake, cls.server)
        port = cls.server.add_insecure_port("127.0.0.1:0")
        cls.server.start()
        cls.client = DecodeClient(f"127.0.0.1:{port}", timeout=10)

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


if __name__ == "__main__":
    unittest.main(verbosity=2)
