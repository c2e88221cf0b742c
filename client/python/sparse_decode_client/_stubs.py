"""The gRPC stubs, generated into the package when it is built (setup.py)."""
try:
    from ._proto import decode_pb2 as pb
    from ._proto import decode_pb2_grpc as pb_grpc
except ImportError as e:  # the source tree has no stubs: it is never written to
    if e.name and not e.name.endswith("_proto"):
        raise  # a missing or mismatched grpcio/protobuf: its own message says which
    raise ImportError("sparse_decode_client has no generated stubs: import the installed "
                      "package (pip install ./client/python), not the source folder") from e

__all__ = ["pb", "pb_grpc"]
