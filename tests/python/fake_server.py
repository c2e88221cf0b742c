"""An in-process fake decode server for the client's own tests and cost measurement: no
maths, but the contract's bookkeeping (sequences, K/V rows written, per-item errors).

Decode items answer `out` = the request's q bits (both [Hq, D]), so a round trip shows
exactly what the client sent and how it hands the answer back.
"""
import threading
from concurrent import futures

import grpc

from sparse_decode_client._stubs import pb, pb_grpc

NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


class FakeServer(pb_grpc.DecodeServiceServicer):
    def __init__(self, hq, hkv, d):
        self.shape = (hq, hkv, d)
        self.lock = threading.Lock()
        self.sequences = set()
        self.rows = {}           # (sequence, layer) -> {position: (k bytes, v bytes)}
        self.calls = []          # RPC names in order
        self.drop = 0            # DecodeBatch answers this many responses fewer (more, < 0)
        self.fail_with = None    # a grpc.StatusCode: DecodeBatch aborts with it
        self.release = None      # a threading.Event: DecodeBatch waits for it
        self.item_errors = {}    # index -> (code, message) for DecodeBatch / DecodeLayer items
        self.check_sequences = False  # decode items of unknown sequences fail NOT_FOUND
        self.unavailable = 0     # GetModelInfo answers UNAVAILABLE this many more times

    def _log(self, name):
        with self.lock:
            self.calls.append(name)

    def GetModelInfo(self, request, context):
        self._log("GetModelInfo")
        with self.lock:
            if self.unavailable > 0:
                self.unavailable -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, "draining (fake)")
        hq, hkv, d = self.shape
        return pb.ModelInfo(num_layers=2, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)

    def CreateSequence(self, request, context):
        self._log("CreateSequence")
        with self.lock:
            if request.sequence_id in self.sequences:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{request.sequence_id} exists")
            self.sequences.add(request.sequence_id)
        return pb.CreateSequenceResponse(reserved_pages=1)

    def ReleaseSequence(self, request, context):
        self._log("ReleaseSequence")
        with self.lock:
            if request.sequence_id not in self.sequences:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no sequence {request.sequence_id}")
            self.sequences.discard(request.sequence_id)
            for key in [k for k in self.rows if k[0] == request.sequence_id]:
                del self.rows[key]
        return pb.ReleaseSequenceResponse(freed_pages=3)

    def AppendKV(self, request, context):
        self._log("AppendKV")
        n, hkv, d = request.k.shape
        row = hkv * d * 2
        with self.lock:
            if request.sequence_id not in self.sequences:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no sequence {request.sequence_id}")
            rows = self.rows.setdefault((request.sequence_id, request.layer), {})
            for t in range(n):
                rows[request.start_position + t] = (request.k.data[t * row:(t + 1) * row],
                                                    request.v.data[t * row:(t + 1) * row])
            length = max(rows) + 1
        return pb.AppendKVResponse(length=length)

    def _item_error(self, i, sequence_id):
        if i in self.item_errors:
            return self.item_errors[i]
        if self.check_sequences and sequence_id not in self.sequences:
            return NOT_FOUND, f"no sequence {sequence_id}"
        return None

    def Decode(self, request, context):
        self._log("Decode")
        return self._answer(0, request)

    def _answer(self, i, r):
        err = self._item_error(i, r.sequence_id)
        if err:
            return pb.DecodeResponse(request_id=r.request_id, error_code=err[0],
                                     error_message=err[1])
        return pb.DecodeResponse(request_id=r.request_id, out=pb.Tensor(
            dtype=pb.BF16, shape=r.q.shape, data=r.q.data))

    def DecodeBatch(self, request, context):
        self._log("DecodeBatch")
        if self.release is not None:
            self.release.wait(10)
        if self.fail_with is not None:
            context.abort(self.fail_with, "refused by the fake")
        reqs = list(request.requests)
        n = len(reqs) - self.drop
        reqs += [reqs[0]] * max(0, n - len(reqs))
        return pb.DecodeBatchResponse(responses=[self._answer(i, r) for i, r in enumerate(reqs[:n])])

    def DecodeLayer(self, request, context):
        self._log("DecodeLayer")
        codes, messages = [], []
        for i, s in enumerate(request.sequence_ids):
            err = self._item_error(i, s) or (0, "")
            codes.append(err[0])
            messages.append(err[1])
        return pb.DecodeLayerResponse(
            request_id=request.request_id, error_codes=codes, error_messages=messages,
            out=pb.Tensor(dtype=pb.BF16, shape=request.q.shape, data=request.q.data))


def start(hq, hkv, d, port=0):
    """(grpc server, FakeServer, address)."""
    fake = FakeServer(hq, hkv, d)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_DecodeServiceServicer_to_server(fake, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, fake, f"127.0.0.1:{port}"
