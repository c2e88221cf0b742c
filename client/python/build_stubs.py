"""Build-time code generation: the gRPC stubs of the packaged proto, and the runtime
versions they need.

    python build_stubs.py OUT_DIR       # writes OUT_DIR/decode_pb2.py, decode_pb2_grpc.py

setup.py runs it into the build directory only, never into the source tree, so that a
read-only checkout (or a copy of this folder) builds. The proto travels inside the
package (sparse_decode_client/proto/), a copy of the repository's proto/ that the unit
tests compare with it.
"""
import os
import re
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.join(HERE, "sparse_decode_client", "proto")
PROTO_REL = os.path.join("sparse_decode", "v1", "decode.proto")
STUB_FILES = ("decode_pb2.py", "decode_pb2_grpc.py")


def generate(out_dir, proto_root=PROTO_ROOT):
    """Writes the stubs (a flat package: the grpc module imports its sibling relatively)
    into out_dir and returns it."""
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise ImportError("building sparse-decode-client needs grpcio-tools "
                          "(pip install grpcio-tools)") from e
    import importlib.resources as resources
    well_known = str(resources.files("grpc_tools") / "_proto")
    proto_file = os.path.join(proto_root, PROTO_REL)
    tmp = tempfile.mkdtemp(prefix="sds_stubs_")
    try:
        rc = protoc.main(["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}",
                          f"--python_out={tmp}", f"--grpc_python_out={tmp}", proto_file])
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed with {rc} on {proto_file}")
        os.makedirs(out_dir, exist_ok=True)
        for name in STUB_FILES:
            with open(os.path.join(tmp, "sparse_decode", "v1", name)) as f:
                text = f.read()
            text = re.sub(r"^from sparse_decode\.v1 import decode_pb2",
                          "from . import decode_pb2", text, flags=re.M)
            with open(os.path.join(out_dir, name), "w") as f:
                f.write(text)
        with open(os.path.join(out_dir, "__init__.py"), "w") as f:
            f.write('"""Generated from sparse_decode/v1/decode.proto at build time; do not edit."""\n')
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def runtime_requirements(stub_dir):
    """The grpcio and protobuf versions the generated code checks on import.

    protobuf's gencode refuses a runtime of another major version, or an older one
    (ValidateProtobufRuntimeVersion); the grpc stub refuses grpcio older than the
    grpcio-tools that generated it. Declaring exactly that range makes pip refuse an
    environment the import would fail in.
    """
    with open(os.path.join(stub_dir, "decode_pb2.py")) as f:
        pb2 = f.read()
    with open(os.path.join(stub_dir, "decode_pb2_grpc.py")) as f:
        grpc_stub = f.read()
    m = re.search(r"ValidateProtobufRuntimeVersion\(\s*[\w.]+,\s*(\d+),\s*(\d+),\s*(\d+),", pb2)
    reqs = []
    if m:
        major, minor, patch = (int(x) for x in m.groups())
        reqs.append(f"protobuf>={major}.{minor}.{patch},<{major + 1}")
    else:  # gencode older than protobuf 5 has no check: any runtime of its era
        reqs.append("protobuf>=4.21,<5")
    g = re.search(r"^GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub, flags=re.M)
    reqs.append(f"grpcio>={g.group(1)}" if g else "grpcio>=1.51")
    return reqs


if __name__ == "__main__":
    out = generate(sys.argv[1] if len(sys.argv) > 1 else "stubs_out")
    print(out, *runtime_requirements(out))
