"""Generates the gRPC stubs for sparse_decode/v1/decode.proto into sparse_decode_client/_proto.

    python -m sparse_decode_client.generate [--proto_dir DIR]

Used by setup.py at build time, and on first import in a source checkout (dev mode).
"""
import argparse
import os
import re
import shutil
import sys
import tempfile

PKG_DIR = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(PKG_DIR, "_proto")
PROTO_REL = os.path.join("sparse_decode", "v1", "decode.proto")


def default_proto_dir():
    # client/python/sparse_decode_client -> repository root/proto
    return os.path.normpath(os.path.join(PKG_DIR, "..", "..", "..", "proto"))


def generate(proto_dir=None, out_dir=OUT_DIR):
    proto_dir = proto_dir or default_proto_dir()
    proto_file = os.path.join(proto_dir, PROTO_REL)
    if not os.path.exists(proto_file):
        raise FileNotFoundError(
            f"{proto_file} not found: set SDS_PROTO_DIR or pass --proto_dir to the folder "
            "holding sparse_decode/v1/decode.proto")
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise ImportError("generating the stubs needs grpcio-tools: pip install grpcio-tools") from e
    import importlib.resources as resources
    well_known = str(resources.files("grpc_tools") / "_proto")
    tmp = tempfile.mkdtemp(prefix="sds_stubs_")
    try:
        rc = protoc.main(["grpc_tools.protoc", f"-I{proto_dir}", f"-I{well_known}",
                          f"--python_out={tmp}", f"--grpc_python_out={tmp}", proto_file])
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed with {rc} on {proto_file}")
        gen = os.path.join(tmp, "sparse_decode", "v1")
        staged = tempfile.mkdtemp(prefix="_proto_", dir=os.path.dirname(out_dir))
        for name in ("decode_pb2.py", "decode_pb2_grpc.py"):
            with open(os.path.join(gen, name)) as f:
                text = f.read()
            # Flat package: make the grpc module import its sibling relatively.
            text = re.sub(r"^from sparse_decode\.v1 import decode_pb2",
                          "from . import decode_pb2", text, flags=re.M)
            with open(os.path.join(staged, name), "w") as f:
                f.write(text)
        with open(os.path.join(staged, "__init__.py"), "w") as f:
            f.write('"""Generated from sparse_decode/v1/decode.proto; do not edit."""\n')
        # Replace atomically so concurrent importers never see half a package.
        old = None
        if os.path.exists(out_dir):
            old = out_dir + f".old{os.getpid()}"
            os.rename(out_dir, old)
        try:
            os.rename(staged, out_dir)
        except OSError:
            shutil.rmtree(staged, ignore_errors=True)
            if not os.path.exists(out_dir):
                raise
        if old:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--proto_dir", default=None, help="folder holding sparse_decode/v1/decode.proto")
    p.add_argument("--out_dir", default=OUT_DIR)
    args = p.parse_args(argv)
    print(generate(args.proto_dir, args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
