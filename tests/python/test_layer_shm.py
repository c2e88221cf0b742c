#!/usr/bin/env python3
"""The shared-memory data plane against the real decode_server (cpu backend): DecodeLayer
with tensors in registered POSIX shared memory gives the bits DecodeBatch gives for the
same items, inline bytes too; every bad reference is refused with its code and writes
nothing; an unregistered region is never written; regions are per tenant, counted in
/metrics without their names, and off without --allow_client_shm.

    python3 test_layer_shm.py --server build/server/decode_server
"""
import argparse
import os
import subprocess
import sys
import textwrap
import time
import unittest
import urllib.request

import grpc
import numpy as np

import reference as ref
from sds_testutil import ServerProcess, free_port

from sparse_decode_client import DecodeClient, DecodeError, float32_to_bf16_bits
from sparse_decode_client._stubs import pb

SERVER = None
BACKEND = "cpu"  # --cuda: the CUDA backend, and CUDA regions (torch tensors) as well
PREFILL = 37  # not a page multiple: new tokens land mid-page and at page 3's start
PAGE = 16
POISON = 0xFFFF  # a NaN pattern no output holds
SKIP = 77  # the exit status ctest reports as skipped (SKIP_RETURN_CODE)


def start_server(hq, hkv, d, extra=()):
    metrics_port = free_port()
    argv = [SERVER, f"--backend={BACKEND}", "--num_layers=2", f"--num_q_heads={hq}",
            f"--num_kv_heads={hkv}", f"--head_dim={d}", f"--page_size={PAGE}",
            "--cache_pages=512", "--max_batch_size=16", "--max_queue_delay_us=300",
            "--cpu_threads=2", f"--metrics_listen=127.0.0.1:{metrics_port}", *extra]

    def ready(address):
        with DecodeClient(address, timeout=2) as c:
            c.model_info()
        return True

    server = ServerProcess(argv, ready, name="decode_server")
    server.metrics_port = metrics_port
    return server


class LayerCase(unittest.TestCase):
    HQ, HKV, D = 8, 2, 64
    B = 5  # odd, and at least 5 (test_each_item_fails_alone)
    CUDA = False  # regions in CUDA memory (torch), read and written by the device

    def new_region(self, name, size):
        if self.CUDA:
            import torch
            memory = torch.empty(size, dtype=torch.uint8, device="cuda")
            return self.client.register_cuda_region(name, memory)
        return self.client.register_system_region(name, size)

    def view(self, region, shape, dtype, fill=None):
        """A view of fresh bytes of `region`, optionally holding `fill` (numpy)."""
        if not self.CUDA:
            v = region.numpy(shape, dtype)
            if fill is not None:
                v[...] = fill
            return v
        import torch
        tdtype = {np.dtype(np.uint16): torch.bfloat16, np.dtype(np.int32): torch.int32,
                  np.dtype(np.float32): torch.float32}[np.dtype(dtype)]
        v = region.torch(shape, tdtype)
        if fill is not None:
            host = np.ascontiguousarray(fill)
            if tdtype == torch.bfloat16:
                t = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
            else:
                t = torch.from_numpy(host)
            v.copy_(t.to(v.device))
        return v

    @staticmethod
    def host(v):
        """A view's values as numpy (bf16 as uint16 bits)."""
        if isinstance(v, np.ndarray):
            return v
        import torch
        t = v.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    @classmethod
    def setUpClass(cls):
        if cls is LayerCase:
            raise unittest.SkipTest("base class")
        cls.server = start_server(cls.HQ, cls.HKV, cls.D, ["--allow_client_shm"])
        cls.client = DecodeClient(cls.server.address, timeout=30)
        cls.rng = np.random.default_rng()
        cls.mirror = {}  # (seq, layer) -> [(k_bits, v_bits)] per position

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def bf16(self, *shape, scale=1.0):
        return float32_to_bf16_bits(self.rng.standard_normal(shape).astype(np.float32) * scale)

    def prefill(self, seq, n=PREFILL):
        self.client.create_sequence(seq, reserve_tokens=n + 4)
        for layer in range(2):
            k, v = self.bf16(n, self.HKV, self.D, scale=2.0), self.bf16(n, self.HKV, self.D)
            self.assertEqual(self.client.append_kv(seq, layer=layer, start=0, k=k, v=v), n)
            self.mirror[(seq, layer)] = [(k[t], v[t]) for t in range(n)]

    def batch_inputs(self, per_head, k=20):
        b, hq, hkv, d = self.B, self.HQ, self.HKV, self.D
        idx_shape = (b, hkv, k) if per_head else (b, k)
        idx = self.rng.integers(0, PREFILL + 1, size=idx_shape).astype(np.int32)
        flat = idx.reshape(b, -1)
        flat[:, 0] = PREFILL   # the new token itself
        flat[:, 1] = -1        # padding
        flat[:, 2] = flat[:, 3]  # a duplicate
        flat[:, 4] = PAGE - 1  # the last slot of page 0
        flat[:, 5] = PAGE      # the first of page 1
        return dict(q=self.bf16(b, hq, d), gate=self.bf16(b, hq, d),
                    k=self.bf16(b, hkv, d, scale=2.0), v=self.bf16(b, hkv, d), indices=idx)

    def forked(self, tag):
        """B prefilled sequences, each forked into an 'a' and a 'b' copy."""
        base = [f"{self.id()}-{tag}-{i}" for i in range(self.B)]
        for s in base:
            self.prefill(s)
            for side in "ab":
                self.client.fork_sequence(s, f"{s}-{side}")
                for layer in range(2):
                    self.mirror[(f"{s}-{side}", layer)] = list(self.mirror[(s, layer)])
        return [f"{s}-a" for s in base], [f"{s}-b" for s in base]

    def bytes_path(self, seqs, layer, x, topk=None):
        reqs = []
        for i, s in enumerate(seqs):
            idx = x["indices"][i]
            if topk is not None:
                idx = idx[..., :topk[i]]
            reqs.append(dict(sequence_id=s, layer=layer, position=PREFILL, q=x["q"][i],
                             k=x["k"][i], v=x["v"][i], gate=x["gate"][i],
                             indices=np.ascontiguousarray(idx), return_lse=True))
        return self.client.decode_batch(reqs, raise_on_error=True)

    def reference(self, seq, layer, x, i, topk=None):
        rows = self.mirror[(seq, layer)][:PREFILL] + [(x["k"][i], x["v"][i])]
        info = self.client.model_info()
        ks = info.k_scales[layer] if info.k_scales else 1.0
        vs = info.v_scales[layer] if info.v_scales else 1.0
        k_dq = ref.dequantised(np.stack([r[0] for r in rows]), info.scale_mode, ks)
        v_dq = ref.dequantised(np.stack([r[1] for r in rows]), info.scale_mode, vs)
        idx = x["indices"][i] if topk is None else x["indices"][i][..., :topk[i]]
        return ref.decode(x["q"][i], x["gate"][i], k_dq, v_dq, idx)

    def poisoned_region(self, name, x, extra_bytes=0):
        """A region holding copies of the inputs `x` and poisoned out / lse."""
        b, hq, d = self.B, self.HQ, self.D
        size = sum(a.nbytes for a in x.values()) + b * hq * d * 2 + b * hq * 4 + 4096 + extra_bytes
        region = self.new_region(name, size)
        views = {key: self.view(region, a.shape, a.dtype, a) for key, a in x.items()}
        views["out"] = self.view(region, (b, hq, d), np.uint16,
                                 np.full((b, hq, d), POISON, np.uint16))
        views["lse"] = self.view(region, (b, hq), np.float32,
                                 np.full((b, hq), 0xFFFFFFFF, np.uint32).view(np.float32))
        return region, views

    # -- the same bits through both paths ----------------------------------------------
    def check_same_bits(self, per_head, topk=None):
        a, b = self.forked(f"bits{int(per_head)}{int(topk is not None)}")
        layer = 1
        x = self.batch_inputs(per_head)
        want = self.bytes_path(a, layer, x, topk)
        region, views = self.poisoned_region(f"r-{per_head}-{topk is not None}", x)
        try:
            res = self.client.decode_layer(layer=layer, sequence_ids=b, positions=[PREFILL] * self.B,
                                           q=views["q"], gate=views["gate"], k=views["k"],
                                           v=views["v"], indices=views["indices"], topk=topk,
                                           out=views["out"], lse=views["lse"])
            self.assertTrue(res.ok)
            self.assertIs(res.out, views["out"])
            out, lse = self.host(views["out"]), self.host(views["lse"])
            self.assertFalse((out == POISON).any(), "an output element was not written")
            for i in range(self.B):
                np.testing.assert_array_equal(out[i], want[i].out_bits, f"item {i}")
                np.testing.assert_array_equal(lse[i].view(np.uint32),
                                              want[i].lse.view(np.uint32), f"lse of item {i}")
                # ... and both against the float64 reference.
                want_out, _ = self.reference(b[i], layer, x, i, topk)
                got = ref.bf16_to_f64(out[i])
                floor = 0.01 * np.max(np.abs(want_out), axis=1, keepdims=True)
                tol = 2 * ref.bf16_ulp(np.maximum(np.abs(want_out), floor)) + 1e-30
                self.assertFalse((np.abs(got - want_out) > tol).any(), f"item {i} off the reference")
        finally:
            region.close()

    def test_same_bits_shared_indices(self):
        self.check_same_bits(per_head=False)

    def test_same_bits_per_kv_head_indices_and_topk(self):
        self.check_same_bits(per_head=True, topk=[[20, 7, 0, 13, 1][i % 5] for i in range(self.B)])

    def test_inline_bytes_give_the_same_bits(self):
        a, b = self.forked("inline")
        x = self.batch_inputs(per_head=False)
        want = self.bytes_path(a, 0, x)
        res = self.client.decode_layer(layer=0, sequence_ids=b, positions=[PREFILL] * self.B,
                                       q=x["q"], gate=x["gate"], k=x["k"], v=x["v"],
                                       indices=x["indices"], return_lse=True)
        for i in range(self.B):
            np.testing.assert_array_equal(res.out[i], want[i].out_bits)
            np.testing.assert_array_equal(res.lse[i], want[i].lse)

    def test_layer_stream_answers_every_message(self):
        """DecodeLayerStream: several layer messages in flight, each answered once (by
        request_id) with the bits DecodeLayer gives; a bad message gets its error_code and
        the stream goes on."""
        a, b = self.forked("stream")
        x = self.batch_inputs(per_head=False)
        want = self.bytes_path(a, 0, x)
        region, views = self.poisoned_region("stream", x)
        try:
            def message(layer, request_id, positions=None):
                req = pb.DecodeLayerRequest(layer=layer, sequence_ids=b,
                                            positions=positions or [PREFILL] * self.B,
                                            request_id=request_id)
                for key in ("q", "gate", "k", "v", "indices", "out"):
                    by_ref = self.client._packed(
                        getattr(req, key), key, views[key], "int32" if key == "indices" else "bf16",
                        tuple(views[key].shape), "", output=key == "out")
                    self.assertTrue(by_ref, key)
                return req

            bad = message(0, 2, positions=[PREFILL] * (self.B - 1))
            good = message(0, 1)
            answers = {r.request_id: r for r in self.client._stub.DecodeLayerStream(
                iter([good, bad]), metadata=self.client._metadata, timeout=30)}
            self.assertEqual(sorted(answers), [1, 2])
            self.assertEqual(answers[2].error_code, grpc.StatusCode.INVALID_ARGUMENT.value[0])
            self.assertIn("positions", answers[2].error_message)
            self.assertEqual(list(answers[1].error_codes), [0] * self.B)
            self.assertEqual(answers[1].error_code, 0)
            out = self.host(views["out"])
            for i in range(self.B):
                np.testing.assert_array_equal(out[i], want[i].out_bits, f"item {i}")
        finally:
            region.close()

    def test_layer_stream_helper_keeps_micro_batches_in_flight(self):
        """LayerStream (the Python helper): two micro-batches of one layer step sent before
        either is read back, each answered with the bits the bytes path gives."""
        a, b = self.forked("helper")
        x = self.batch_inputs(per_head=True)
        want = self.bytes_path(a, 1, x)
        region, views = self.poisoned_region("helper", x)
        halves = [slice(0, self.B // 2), slice(self.B // 2, self.B)]
        try:
            with self.client.layer_stream() as stream:
                ids = [stream.send(layer=1, sequence_ids=b[h], positions=[PREFILL] * len(b[h]),
                                   q=views["q"][h], gate=views["gate"][h], k=views["k"][h],
                                   v=views["v"][h], indices=views["indices"][h],
                                   out=views["out"][h]) for h in halves]
                results = [stream.result(i) for i in reversed(ids)]
            self.assertTrue(all(r.ok for r in results))
            out = self.host(views["out"])
            for i in range(self.B):
                np.testing.assert_array_equal(out[i], want[i].out_bits, f"item {i}")
        finally:
            region.close()

    def test_each_item_fails_alone(self):
        seqs = [f"{self.id()}-{i}" for i in range(self.B)]
        for s in seqs:
            self.prefill(s)
        x = self.batch_inputs(per_head=False)
        x["q"][1, 0, 0] = 0x7FC0  # NaN
        x["indices"][3, 0] = PREFILL + 3  # past the position
        positions = [PREFILL] * self.B
        positions[4] = PREFILL + 2  # a gap
        region, views = self.poisoned_region("items", x)
        try:
            res = self.client.decode_layer(layer=0, sequence_ids=seqs, positions=positions,
                                           q=views["q"], gate=views["gate"], k=views["k"],
                                           v=views["v"], indices=views["indices"], out=views["out"],
                                           raise_on_error=False)
            if self.CUDA:  # checked on the device: the same codes, other words
                for i in (1, 3):
                    self.assertIn("on the device", res.errors[i].message)
            codes = [None if e is None else e.code for e in res.errors]
            self.assertEqual(codes, [None, grpc.StatusCode.INVALID_ARGUMENT, None,
                                     grpc.StatusCode.INVALID_ARGUMENT,
                                     grpc.StatusCode.FAILED_PRECONDITION] + [None] * (self.B - 5))
            out = self.host(views["out"])
            for i in (1, 3, 4):
                self.assertTrue((out[i] == POISON).all(), f"failed item {i} wrote out")
            for i in (0, 2):
                self.assertFalse((out[i] == POISON).any())
            # Nothing stored for the failed ones: position PREFILL is still free for them.
            for i in (1, 3):
                with self.assertRaises(DecodeError) as cm:
                    self.client.decode(seqs[i], layer=0, position=PREFILL + 1, q=x["q"][0],
                                       k=x["k"][0], v=x["v"][0], gate=x["gate"][0],
                                       indices=np.zeros(1, np.int32))
                self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        finally:
            region.close()


class Heads8over2(LayerCase):
    HQ, HKV, D = 8, 2, 64


class Heads32over8(LayerCase):
    HQ, HKV, D, B = 32, 8, 128, 5


class Heads8over1(LayerCase):
    HQ, HKV, D, B = 8, 1, 64, 7


class CudaHeads32over8(LayerCase):
    HQ, HKV, D, B, CUDA = 32, 8, 128, 5, True


class CudaHeads8over2(LayerCase):
    HQ, HKV, D, B, CUDA = 8, 2, 64, 7, True


class CudaHeads64over8(LayerCase):
    HQ, HKV, D, B, CUDA = 64, 8, 128, 5, True


class BadReferences(unittest.TestCase):
    """Every bad reference is answered with its code and nothing is written anywhere."""
    HQ, HKV, D, B = 8, 2, 64, 3

    @classmethod
    def setUpClass(cls):
        cls.server = start_server(cls.HQ, cls.HKV, cls.D, ["--allow_client_shm",
                                                           "--max_queue_delay_us=200000"])
        cls.client = DecodeClient(cls.server.address, timeout=30, tenant_id="alice")
        cls.other = DecodeClient(cls.server.address, timeout=30, tenant_id="bob")
        cls.rng = np.random.default_rng()
        cls.seqs = [f"bad-{i}" for i in range(cls.B)]
        for s in cls.seqs:
            cls.client.create_sequence(s)
            for layer in range(2):
                k = float32_to_bf16_bits(cls.rng.standard_normal((8, cls.HKV, cls.D)))
                cls.client.append_kv(s, layer=layer, start=0, k=k, v=k)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.other.close()
        cls.server.stop()

    def make(self, name):
        b, hq, hkv, d = self.B, self.HQ, self.HKV, self.D
        region = self.client.register_system_region(name, 1 << 20)
        v = dict(q=region.numpy((b, hq, d), np.uint16), gate=region.numpy((b, hq, d), np.uint16),
                 k=region.numpy((b, hkv, d), np.uint16), v=region.numpy((b, hkv, d), np.uint16),
                 indices=region.numpy((b, 4), np.int32), out=region.numpy((b, hq, d), np.uint16))
        for key in ("q", "gate", "k", "v"):
            v[key][...] = float32_to_bf16_bits(self.rng.standard_normal(v[key].shape))
        v["indices"][...] = np.arange(4, dtype=np.int32)
        v["out"][...] = POISON
        return region, v

    def request(self, region, v):
        req = pb.DecodeLayerRequest(layer=0, sequence_ids=self.seqs, positions=[8] * self.B,
                                    request_id=7)
        for key in ("q", "gate", "k", "v", "indices", "out"):
            a = v[key]
            t = getattr(req, key)
            t.dtype = pb.INT32 if key == "indices" else pb.BF16
            t.shape.extend(a.shape)
            t.ref.CopyFrom(region.ref(a.ctypes.data, a.nbytes))
        return req

    def code_of(self, req, client=None):
        client = client or self.client
        with self.assertRaises(grpc.RpcError) as cm:
            client._stub.DecodeLayer(req, metadata=client._metadata, timeout=30)
        self.assertTrue(cm.exception.details(), "an error without a message")
        return cm.exception.code()

    def assert_nothing_happened(self, v):
        self.assertTrue((v["out"] == POISON).all(), "out was written")
        for s in self.seqs:  # position 8 is still the next one of every sequence
            with self.assertRaises(DecodeError) as cm:
                self.client.decode(s, layer=0, position=9, q=v["q"][0], k=v["k"][0],
                                   v=v["v"][0], gate=v["gate"][0], indices=np.zeros(1, np.int32))
            self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)

    def test_bad_references(self):
        region, v = self.make("bad")
        try:
            def with_ref(key, **changes):
                req = self.request(region, v)
                ref_ = getattr(req, key).ref
                for field, value in changes.items():
                    setattr(ref_, field, value)
                return req

            size = region.byte_size
            cases = [
                ("offset past the region", with_ref("q", offset=size - 10),
                 grpc.StatusCode.INVALID_ARGUMENT),
                ("offset overflowing", with_ref("k", offset=2**64 - 8),
                 grpc.StatusCode.INVALID_ARGUMENT),
                ("size not the shape's", with_ref("gate", byte_size=v["gate"].nbytes - 2),
                 grpc.StatusCode.INVALID_ARGUMENT),
                ("unregistered region", with_ref("v", region="nope"), grpc.StatusCode.NOT_FOUND),
                ("out over an input", with_ref("out", offset=v["q"].ctypes.data - region.base),
                 grpc.StatusCode.INVALID_ARGUMENT),
            ]
            wrong_shape = self.request(region, v)
            del wrong_shape.q.shape[:]
            wrong_shape.q.shape.extend([self.B, 1, self.HQ, self.D])
            cases.append(("[B, 1, Hq, D]", wrong_shape, grpc.StatusCode.INVALID_ARGUMENT))
            wrong_dtype = self.request(region, v)
            wrong_dtype.indices.dtype = pb.FP32
            cases.append(("fp32 indices", wrong_dtype, grpc.StatusCode.INVALID_ARGUMENT))
            short = self.request(region, v)
            del short.positions[:]
            short.positions.extend([8] * (self.B - 1))
            cases.append(("B-1 positions", short, grpc.StatusCode.INVALID_ARGUMENT))
            for what, req, code in cases:
                with self.subTest(what):
                    self.assertEqual(self.code_of(req), code, what)
                    self.assert_nothing_happened(v)
            # Another tenant's region is not found (and not written).
            self.assertEqual(self.code_of(self.request(region, v), client=self.other),
                             grpc.StatusCode.NOT_FOUND)
            self.assert_nothing_happened(v)
            self.assertEqual(self.other.list_regions(), [])
            self.assertEqual([r["name"] for r in self.client.list_regions()], ["bad"])
        finally:
            region.close()

    def test_client_side_shape_checks(self):
        region, v = self.make("shapes")
        try:
            with self.assertRaises(ValueError) as cm:
                self.client.decode_layer(layer=0, sequence_ids=self.seqs, positions=[8] * self.B,
                                         q=v["q"].reshape(self.B, self.HQ, 1, self.D),
                                         gate=v["gate"], k=v["k"], v=v["v"], indices=v["indices"])
            self.assertIn("[B, Hq, D]", str(cm.exception))
            with self.assertRaises(TypeError):
                self.client.decode_layer(layer=0, sequence_ids=self.seqs, positions=[8] * self.B,
                                         q=v["q"].astype(np.float32), gate=v["gate"], k=v["k"],
                                         v=v["v"], indices=v["indices"])
        finally:
            region.close()

    def test_unregistered_while_queued_writes_nothing(self):
        region, v = self.make("going")
        req = self.request(region, v)
        call = self.client._stub.DecodeLayer.future(req, metadata=self.client._metadata, timeout=30)
        time.sleep(0.05)  # < the 200 ms queue delay: the items wait in the queue
        resp = self.client._stub.UnregisterRegion(pb.UnregisterRegionRequest(name="going"),
                                                   metadata=self.client._metadata)
        self.assertEqual(resp.unregistered, 1)
        answer = call.result()
        self.assertEqual(list(answer.error_codes),
                         [grpc.StatusCode.FAILED_PRECONDITION.value[0]] * self.B)
        self.assertIn("unregistered", answer.error_messages[0])
        self.assert_nothing_happened(v)
        region._open = False  # unregistered above
        region._free()

    def test_shrunk_object_fails_the_call_not_the_server(self):
        """A runner that truncates its shm object under a registered region: the server's
        reads (admission) and writes (answers) of the lost pages fail the items with
        FAILED_PRECONDITION instead of killing it with SIGBUS; nothing is stored."""
        inputs, v = self.make("shrink-in")
        outputs = self.client.register_system_region("shrink-out", 1 << 20)
        try:
            out = outputs.numpy((self.B, self.HQ, self.D), np.uint16)
            req = self.request(inputs, v)
            req.out.ref.CopyFrom(outputs.ref(out.ctypes.data, out.nbytes))
            # The outputs' object shrinks: every answer fails, nothing is committed.
            os.ftruncate(outputs._shm._fd, 0)
            answer = self.client._stub.DecodeLayer(req, metadata=self.client._metadata,
                                                   timeout=30)
            self.assertEqual(list(answer.error_codes),
                             [grpc.StatusCode.FAILED_PRECONDITION.value[0]] * self.B)
            self.assertIn("shrunk", answer.error_messages[0])
            self.assert_nothing_happened(v)
            # The inputs' object shrinks: admission cannot read them.
            os.ftruncate(inputs._shm._fd, 0)
            answer = self.client._stub.DecodeLayer(self.request(inputs, v),
                                                   metadata=self.client._metadata, timeout=30)
            self.assertEqual(list(answer.error_codes),
                             [grpc.StatusCode.FAILED_PRECONDITION.value[0]] * self.B)
            self.assertIn("shrunk", answer.error_messages[0])
            self.assertEqual(self.client.model_info().num_q_heads, self.HQ)  # still serving
        finally:
            inputs.close()
            outputs.close()

    def test_metrics_count_regions_not_names(self):
        region = self.client.register_system_region("secret-name", 12345)
        try:
            body = urllib.request.urlopen(
                f"http://127.0.0.1:{self.server.metrics_port}/metrics").read().decode()
            self.assertIn('sds_shm_regions{kind="system"} 1', body)
            self.assertIn('sds_shm_region_bytes{kind="system"} 12345', body)
            self.assertNotIn("secret-name", body)
        finally:
            region.close()

    def test_register_errors(self):
        def code(req):
            with self.assertRaises(grpc.RpcError) as cm:
                self.client._stub.RegisterRegion(req, metadata=self.client._metadata)
            return cm.exception.code()
        self.assertEqual(code(pb.RegisterRegionRequest(name="x", system=pb.SystemRegion(
            shm_name="/sds-no-such-object", byte_size=64))), grpc.StatusCode.NOT_FOUND)
        self.assertEqual(code(pb.RegisterRegionRequest(name="x", system=pb.SystemRegion(
            shm_name="../etc/passwd", byte_size=64))), grpc.StatusCode.INVALID_ARGUMENT)
        region = self.client.register_system_region("dup", 4096)
        try:
            self.assertEqual(code(pb.RegisterRegionRequest(name="y", system=pb.SystemRegion(
                shm_name="/" + region._shm.name, offset=4000, byte_size=200))),
                grpc.StatusCode.INVALID_ARGUMENT)
            self.assertEqual(code(pb.RegisterRegionRequest(name="dup", system=pb.SystemRegion(
                shm_name="/" + region._shm.name, byte_size=64))), grpc.StatusCode.ALREADY_EXISTS)
        finally:
            region.close()
        with self.assertRaises(grpc.RpcError) as cm:
            self.client._stub.UnregisterRegion(pb.UnregisterRegionRequest(name="dup"),
                                               metadata=self.client._metadata)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_client_killed_with_a_region_registered(self):
        script = textwrap.dedent(f"""
            import os, signal, numpy as np
            from sparse_decode_client import DecodeClient
            c = DecodeClient("{self.server.address}", tenant_id="carol")
            r = c.register_system_region("doomed", 1 << 16)
            r.numpy((16,), np.uint8)[...] = 1
            print("registered", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=60)
        self.assertIn("registered", proc.stdout, proc.stderr)
        self.assertEqual(proc.returncode, -9)
        # The server serves on; the dead client's region is still its tenant's to drop.
        carol = DecodeClient(self.server.address, timeout=10, tenant_id="carol")
        self.assertEqual([r["name"] for r in carol.list_regions()], ["doomed"])
        resp = carol._stub.UnregisterRegion(pb.UnregisterRegionRequest(name=""),
                                            metadata=carol._metadata)
        self.assertEqual(resp.unregistered, 1)
        carol.close()
        self.client.model_info()


class ShmOff(unittest.TestCase):
    def test_regions_need_the_flag(self):
        server = start_server(8, 2, 64)
        try:
            with DecodeClient(server.address, timeout=10) as c:
                with self.assertRaises(DecodeError) as cm:
                    c.register_system_region("r", 4096)
                self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
                self.assertIn("--allow_client_shm", cm.exception.message)
        finally:
            server.stop()


def load_tests(loader, tests, pattern):
    """The CUDA cases only with --cuda (a GPU and torch); the others either way."""
    suite = unittest.TestSuite()
    for case in tests:
        for test in case:
            cuda_case = getattr(test, "CUDA", False)
            if cuda_case and BACKEND != "cuda":
                continue
            suite.addTest(test)
    return suite


def main():
    global SERVER, BACKEND
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True, help="path of decode_server")
    p.add_argument("--cuda", action="store_true",
                   help="run the server on the CUDA backend and add the CUDA-region cases")
    args, rest = p.parse_known_args()
    SERVER = args.server
    BACKEND = "cuda" if args.cuda else "cpu"
    if args.cuda:
        try:
            import torch
            usable = torch.cuda.is_available()
        except ImportError:
            usable = False
        if not usable:
            print("skipped: --cuda needs a GPU and torch with CUDA")
            sys.exit(SKIP)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
