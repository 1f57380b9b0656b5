"""Builds the kvpack package; generates kvpack/v1/*_pb2*.py from proto/ first (kvpack._gen).

    pip install client/python          # from the repository root
"""

import importlib.util
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent


class BuildWithStubs(build_py):
    def run(self):
        spec = importlib.util.spec_from_file_location("kvpack_gen", HERE / "kvpack" / "_gen.py")
        gen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gen)
        if gen.default_proto_root() is not None:
            gen.generate()
        elif gen.is_stale():
            raise RuntimeError("kvpack/v1 stubs are missing and proto/ is not beside this tree")
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
