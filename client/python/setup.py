"""Builds the kvpack package; generates kvpack/v1/*_pb2*.py from proto/ first (kvpack._gen).

    pip install client/python          # from the repository root, also in a fresh clone

The stubs are generated when this file is run, before setup() looks at its packages: setuptools
checks that every listed package folder exists while it reads its configuration, before any build
command runs, so generating them in build_py (as before) failed in a fresh clone with "package
directory 'kvpack/v1' does not exist". pyproject.toml's build requirements bring grpcio-tools into
the build environment before this file runs. scripts/check_python_install.sh (part of
scripts/test.sh) installs from a copy of the clean tree into a fresh venv to prove it.
"""

import importlib.util
import pathlib

from setuptools import setup

HERE = pathlib.Path(__file__).resolve().parent


def generate_stubs():
    spec = importlib.util.spec_from_file_location("kvpack_gen", HERE / "kvpack" / "_gen.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    if gen.default_proto_root() is not None:
        gen.generate()      # a source checkout: always from the .proto beside it
    elif gen.is_stale():    # an sdist carries the generated modules; anything else is an error
        raise RuntimeError("kvpack/v1 stubs are missing and proto/ is not beside this tree")


generate_stubs()
setup()
