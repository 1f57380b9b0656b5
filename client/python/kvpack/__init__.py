"""kvpack: Python client for the kvpackd attention daemon.

    import kvpack
    with kvpack.Client("unix:///run/kvpackd/kvpackd.sock") as c:
        print(c.status())

kvpack.Client (gRPC, kvpack.v1), kvpack.Range / Rope / Sparse / LayerOptions / RegionSlice (values;
kvpack.as_sparse and kvpack.leading_text build the sparse option and text-first ranges),
kvpack.KvpackError and its subclasses (gRPC code + message), kvpack.torch (PyTorch adapter),
kvpack.comfy (ComfyUI attention override), kvpack.testing (start a local daemon).
"""

__version__ = "0.1.0"
__all__ = ["Client", "LayerOptions", "LayerOutput", "Range", "RegionSlice", "Rope", "Sparse",
           "Weights", "as_sparse", "leading_text",
           "KvpackError", "Cancelled", "DeadlineExceeded", "FailedPrecondition", "InvalidArgument",
           "NotFound", "PermissionDenied", "ResourceExhausted", "Unauthenticated", "Unavailable"]

from kvpack.types import (  # noqa: F401
    LayerOptions, LayerOutput, Range, RegionSlice, Rope, Sparse, Weights, as_sparse, leading_text)
from kvpack.errors import (  # noqa: F401
    Cancelled, DeadlineExceeded, FailedPrecondition, InvalidArgument, KvpackError, NotFound,
    PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable)


def __getattr__(name):
    # The client imports the generated kvpack.v1 modules (generating them in a source
    # checkout); load it on first use so kvpack.testing and kvpack.types need neither.
    if name in ("Client", "client"):
        import importlib
        module = importlib.import_module("kvpack.client")
        return module if name == "client" else module.Client
    raise AttributeError(f"module 'kvpack' has no attribute {name!r}")
