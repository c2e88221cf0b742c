"""Loads the generated stubs, generating them first in a source checkout (dev mode)."""
import os

from . import generate as _generate

if not os.path.exists(os.path.join(_generate.OUT_DIR, "decode_pb2_grpc.py")):
    _generate.generate(os.environ.get("SDS_PROTO_DIR"))

from ._proto import decode_pb2 as pb  # noqa: E402
from ._proto import decode_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["pb", "pb_grpc"]
