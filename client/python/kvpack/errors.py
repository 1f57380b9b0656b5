"""Errors raised by the kvpack client: one exception type carrying the gRPC status code and the
daemon's message, with subclasses for the codes callers branch on.

    try:
        client.attention_layer(...)
    except kvpack.ResourceExhausted as e:   # the layer does not fit the daemon's budget
        ...
    except kvpack.KvpackError as e:
        log(e.code_name, e.details)
"""

import grpc


class KvpackError(Exception):
    """A failed call. `code` is a grpc.StatusCode, `details` the daemon's message (it names the
    field for INVALID_ARGUMENT and gives the numbers for RESOURCE_EXHAUSTED), `method` the RPC."""

    def __init__(self, code, details, method=""):
        self.code = code
        self.details = details or ""
        self.method = method
        where = f"{method}: " if method else ""
        super().__init__(f"{where}{self.code_name}: {self.details}")

    @property
    def code_name(self):
        return self.code.name if isinstance(self.code, grpc.StatusCode) else str(self.code)


class InvalidArgument(KvpackError):
    pass


class NotFound(KvpackError):
    """An unknown, released or expired handle or region (or one of another tenant)."""


class ResourceExhausted(KvpackError):
    """The smallest plan exceeds the budget or quota, or the daemon's queue is full."""


class FailedPrecondition(KvpackError):
    pass


class DeadlineExceeded(KvpackError):
    pass


class Unavailable(KvpackError):
    """No daemon answers (not started, draining, or unreachable)."""


class Unauthenticated(KvpackError):
    pass


class PermissionDenied(KvpackError):
    pass


class Cancelled(KvpackError):
    pass


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def from_rpc_error(err, method=""):
    """The KvpackError subclass for a grpc.RpcError (or any object with code() and details())."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    return _BY_CODE.get(code, KvpackError)(code, details, method)
