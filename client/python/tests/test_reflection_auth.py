"""Server reflection needs the bearer token when kvpackd requires one (issue 16: it answered every
caller with the whole API). Raw bytes over grpcio: no reflection stubs are needed."""

import grpc
import pytest

from kvpack import testing

pytestmark = pytest.mark.skipif(
    testing.find_kvpackd() is None,
    reason="no kvpackd binary: build the daemon (scripts/build.sh) or set KVPACK_BUILD_DIR")

TOKEN = "reflection-test-token-0123456789"
METHOD = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
LIST_SERVICES = b"\x3a\x00"  # ServerReflectionRequest{list_services: ""} (field 7, empty string)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    with testing.LocalDaemon(budget_bytes=64 << 20, extra_args=[f"--auth_token_file={tokens}"]) as d:
        yield d


def reflect(daemon, metadata, received):
    """Sends list_services; appends each response's bytes to `received` (also when it then fails)."""
    with grpc.insecure_channel(daemon.target) as channel:
        call = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)
        for response in call(iter([LIST_SERVICES]), metadata=metadata, timeout=10):
            received.append(response)


@pytest.mark.parametrize("metadata", [[], [("authorization", "Bearer wrong-token-0123456789")]])
def test_reflection_without_a_valid_token_is_refused_and_reveals_nothing(daemon, metadata):
    received = []
    with pytest.raises(grpc.RpcError) as e:
        reflect(daemon, metadata, received)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
    assert not any(b"kvpack" in r for r in received), received


def test_reflection_with_the_token_lists_the_services(daemon):
    received = []
    reflect(daemon, [("authorization", f"Bearer {TOKEN}")], received)
    assert any(b"kvpack.v1.Kvpack" in r for r in received), received
