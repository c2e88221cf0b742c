"""Build hook: generates the gRPC stubs into the build (never into the source tree) and
declares the grpcio/protobuf versions those stubs need.

Everything the build writes (stubs, build/, *.egg-info) goes to a temporary folder, so
that the package builds from a read-only checkout and from a copy of this folder.
"""
import atexit
import importlib.util
import os
import shutil
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # loading build_stubs.py must not write __pycache__ here

_spec = importlib.util.spec_from_file_location("_sds_build_stubs", os.path.join(HERE, "build_stubs.py"))
build_stubs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_stubs)

SCRATCH = tempfile.mkdtemp(prefix="sds_client_build_")
atexit.register(shutil.rmtree, SCRATCH, True)
STUBS = build_stubs.generate(os.path.join(SCRATCH, "stubs"))


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "sparse_decode_client", "_proto")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(STUBS, dest)


setup(
    install_requires=build_stubs.runtime_requirements(STUBS) + ["numpy>=1.22", "ml_dtypes>=0.2"],
    cmdclass={"build_py": BuildPyWithStubs},
    options={"build": {"build_base": os.path.join(SCRATCH, "build")},
             "egg_info": {"egg_base": SCRATCH}},
)
