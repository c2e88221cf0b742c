"""DecodeStream and LayerStream: one bidirectional stream kept open across a model's layer
loop, answers matched to requests by request_id."""
import queue
import threading

import grpc

from .errors import DecodeError, first_error
from .results import parse_response

_CLOSE = object()


class ResponseStream:
    """A bidirectional call whose answers are matched to requests by request_id: queued
    requests go out in order, a reader thread files the answers. `method` is the stub's
    streaming method (DecodeStream, DecodeLayerStream)."""

    def __init__(self, client, method, timeout=None):
        self._client = client
        self._outbox = queue.Queue()
        self._results = {}
        self._cv = threading.Condition()
        self._error = None
        self._done = False
        self._call = method(self._requests(), timeout=timeout, metadata=client._metadata)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self):
        while True:
            item = self._outbox.get()
            if item is _CLOSE:
                return
            yield item

    def _read(self):
        try:
            for resp in self._call:
                with self._cv:
                    self._results[resp.request_id] = resp
                    self._cv.notify_all()
        except grpc.RpcError as e:
            with self._cv:
                if e.code() != grpc.StatusCode.CANCELLED or self._error is None:
                    self._error = DecodeError.from_rpc(e)
        finally:
            with self._cv:
                self._done = True
                self._cv.notify_all()

    def _put(self, request):
        """Queues `request` (its request_id set); raises when the stream has ended."""
        with self._cv:
            if self._done:
                raise self._error or DecodeError(grpc.StatusCode.FAILED_PRECONDITION,
                                                 "stream closed")
        self._outbox.put(request)

    def _answer(self, request_id, timeout=None):
        """Waits for the raw response to request_id; raises DecodeError when none comes."""
        timeout = timeout if timeout is not None else self._client.timeout
        with self._cv:
            ok = self._cv.wait_for(lambda: request_id in self._results or self._done, timeout)
            if request_id in self._results:
                return self._results.pop(request_id)
            if not ok:
                raise DecodeError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"no response to request {request_id} within {timeout} s")
            raise self._error or DecodeError(
                grpc.StatusCode.UNAVAILABLE,
                f"stream ended without a response to request {request_id}")

    def call(self, *args, timeout=None, **kwargs):
        return self.result(self.send(*args, **kwargs), timeout)

    def close(self):
        self._outbox.put(_CLOSE)
        self._reader.join(timeout=self._client.timeout)
        if self._reader.is_alive():
            self._call.cancel()
            self._reader.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DecodeStream(ResponseStream):
    """Send requests (per layer), get each result by request_id.

        with client.stream() as s:
            for layer in range(L):
                res = s.call(seq, layer=layer, position=pos, q=q, k=k, v=v, gate=gate,
                             indices=idx)
    """

    def __init__(self, client, timeout=None):
        super().__init__(client, client._stub.DecodeStream, timeout)

    def send(self, sequence_id, *, layer, position, q, k, v, gate, indices, return_lse=False,
             request_id=0):
        """Queues one request (decode()'s arguments); returns its request_id (assigned
        when 0)."""
        rid = request_id or self._client.next_request_id()
        self._put(self._client.make_request(sequence_id, layer=layer, position=position, q=q,
                                            k=k, v=v, gate=gate, indices=indices,
                                            return_lse=return_lse, request_id=rid))
        return rid

    def result(self, request_id, timeout=None):
        """Waits for the response to request_id; raises DecodeError on failure."""
        res = parse_response(self._answer(request_id, timeout))
        first_error([res])
        return res


class LayerStream(ResponseStream):
    """DecodeLayerStream: layer messages in flight on one stream, answered by request_id.

        with client.layer_stream() as s:
            ids = [s.send(layer=layer, sequence_ids=seqs[m], positions=positions[m], q=q[m],
                          gate=gate[m], k=k[m], v=v[m], indices=idx[m], out=out[m])
                   for m in range(micro_batches)]
            results = [s.result(i) for i in ids]
    """

    def __init__(self, client, timeout=None):
        super().__init__(client, client._stub.DecodeLayerStream, timeout)
        self._contexts = {}

    def send(self, *, raise_on_error=True, **layer_args):
        """Queues one layer message (decode_layer's keyword arguments, without timeout and
        on_not_found); returns its request_id."""
        req, ctx = self._client._layer_request(**layer_args)
        ctx["raise_on_error"] = raise_on_error
        self._contexts[req.request_id] = ctx
        self._put(req)
        return req.request_id

    def result(self, request_id, timeout=None):
        """The LayerResult of message request_id (raises as decode_layer does)."""
        ctx = self._contexts.pop(request_id)
        res = self._client._layer_result(self._answer(request_id, timeout), ctx)
        if ctx["raise_on_error"]:
            first_error(res.errors)
        return res
