"""Build hook: generates the gRPC stubs from ../../proto before the package is built.

The stubs are never committed. Set SDS_PROTO_DIR to the folder holding
sparse_decode/v1/decode.proto when building from somewhere else.
"""
import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = os.path.join(HERE, "sparse_decode_client", "_proto", "decode_pb2_grpc.py")


def generate_stubs():
    # Load generate.py by path: importing the package would need grpc and numpy, which
    # an isolated build environment does not have.
    path = os.path.join(HERE, "sparse_decode_client", "generate.py")
    spec = importlib.util.spec_from_file_location("_sds_generate", path)
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    generate.generate(proto_dir=os.environ.get("SDS_PROTO_DIR"))


class BuildWithStubs(build_py):
    def run(self):
        generate_stubs()  # always fresh from the proto when building
        super().run()


# Metadata steps (egg_info, dist_info) already list the _proto package.
if not os.path.exists(STUBS):
    generate_stubs()

setup(cmdclass={"build_py": BuildWithStubs})
