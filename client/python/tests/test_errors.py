"""kvpack.errors: gRPC failures become exceptions carrying the code and the daemon's message."""

import grpc

import kvpack.errors as errors


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_code_maps_to_subclass():
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "needs 3 GiB"),
                              "AttentionLayer")
    assert isinstance(e, errors.ResourceExhausted) and isinstance(e, errors.KvpackError)
    assert e.code is grpc.StatusCode.RESOURCE_EXHAUSTED and e.code_name == "RESOURCE_EXHAUSTED"
    assert e.details == "needs 3 GiB" and e.method == "AttentionLayer"
    assert str(e) == "AttentionLayer: RESOURCE_EXHAUSTED: needs 3 GiB"


def test_unmapped_code_is_the_base_class():
    e = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "boom"))
    assert type(e) is errors.KvpackError and str(e) == "INTERNAL: boom"
    assert isinstance(errors.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, None)),
                      errors.Unavailable)
