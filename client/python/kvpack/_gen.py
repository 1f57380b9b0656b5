"""Generates the kvpack.v1 protobuf and gRPC modules from proto/kvpack/v1/kvpack.proto.

    python -m kvpack._gen [--proto-root DIR]

The generated files are build products (not committed): kvpack/v1/kvpack_pb2.py and
kvpack/v1/kvpack_pb2_grpc.py, inside this package, so the generated `from kvpack.v1 import ...`
lines resolve to it. setup.py runs this when the package is built; importing kvpack.client runs
it on first use when the modules are missing or older than the .proto (a source checkout).
"""

import argparse
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent          # client/python/kvpack
OUT_ROOT = PACKAGE.parent                                   # client/python
PROTO_REL = pathlib.Path("kvpack/v1/kvpack.proto")
GENERATED = [PACKAGE / "v1" / "kvpack_pb2.py", PACKAGE / "v1" / "kvpack_pb2_grpc.py"]


def default_proto_root():
    """The repository's proto/ folder (a source checkout), or None."""
    candidate = PACKAGE.parents[2] / "proto"
    return candidate if (candidate / PROTO_REL).is_file() else None


def is_stale(proto_root=None):
    proto_root = proto_root or default_proto_root()
    if not all(p.is_file() for p in GENERATED):
        return True
    if proto_root is None:
        return False        # an installed package: the generated modules are all there is
    src = (pathlib.Path(proto_root) / PROTO_REL).stat().st_mtime
    return any(p.stat().st_mtime < src for p in GENERATED)


def generate(proto_root=None):
    """Runs grpc_tools.protoc; raises RuntimeError with protoc's message on failure."""
    proto_root = pathlib.Path(proto_root) if proto_root else default_proto_root()
    if proto_root is None:
        raise RuntimeError("proto/kvpack/v1/kvpack.proto not found: pass --proto-root")
    from grpc_tools import protoc
    import importlib.resources

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    (PACKAGE / "v1").mkdir(exist_ok=True)
    (PACKAGE / "v1" / "__init__.py").touch()
    rc = protoc.main(["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}",
                      f"--python_out={OUT_ROOT}", f"--grpc_python_out={OUT_ROOT}",
                      str(PROTO_REL)])
    if rc != 0:
        raise RuntimeError(f"protoc failed ({rc}) on {proto_root / PROTO_REL}")
    return GENERATED


def ensure():
    """Generates the modules when missing or stale; a no-op for an installed package.

    Without grpcio-tools (a machine that has only grpcio, e.g. a GPU host), modules generated
    elsewhere are used as they are, stale or not: copy kvpack/v1/ (made by `python -m kvpack._gen`
    on a machine that has grpcio-tools) next to this file. Only when there are none is it an error."""
    if not is_stale():
        return
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        if all(p.is_file() for p in GENERATED):
            return      # pre-generated stubs: the proto may be newer only by its mtime after a copy
        raise RuntimeError(
            "kvpack/v1/kvpack_pb2*.py are missing and grpcio-tools is not installed: run "
            "`python -m kvpack._gen` where grpcio-tools is, and copy client/python/kvpack/v1/ here")
    generate()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proto-root", help="folder holding kvpack/v1/kvpack.proto")
    args = ap.parse_args(argv)
    for path in generate(args.proto_root):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
