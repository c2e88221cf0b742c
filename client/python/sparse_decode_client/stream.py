"""DecodeStream: one bidirectional stream kept open across a model's layer loop."""
import queue
import threading

import grpc

from ._stubs import pb
from .client import DecodeError, _parse_response

_CLOSE = object()


class DecodeStream:
    """Send requests (per layer), get each result by request_id.

        with client.stream() as s:
            for layer in range(L):
                res = s.call(seq, layer, pos, q, k, v, gate, idx)
    """

    def __init__(self, client, timeout=None):
        self._client = client
        self._outbox = queue.Queue()
        self._results = {}
        self._cv = threading.Condition()
        self._error = None
        self._done = False
        self._call = client._stub.DecodeStream(self._requests(), timeout=timeout,
                                               metadata=client._metadata)
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

    def send(self, sequence_id, layer, position, q, k, v, gate, indices, return_lse=False,
             request_id=0):
        """Queues one request; returns its request_id (assigned when 0)."""
        with self._cv:
            if self._done:
                raise self._error or DecodeError(grpc.StatusCode.FAILED_PRECONDITION,
                                                 "stream closed")
        rid = request_id or self._client.next_request_id()
        self._outbox.put(self._client.make_request(sequence_id, layer, position, q, k, v, gate,
                                                   indices, return_lse, rid))
        return rid

    def result(self, request_id, timeout=None):
        """Waits for the response to request_id; raises DecodeError on failure."""
        timeout = timeout if timeout is not None else self._client.timeout
        with self._cv:
            ok = self._cv.wait_for(lambda: request_id in self._results or self._done, timeout)
            if request_id in self._results:
                res = _parse_response(self._results.pop(request_id))
            elif not ok:
                raise DecodeError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"no response to request {request_id} within {timeout} s")
            else:
                raise self._error or DecodeError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"stream ended without a response to request {request_id}")
        if isinstance(res, DecodeError):
            raise res
        return res

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
