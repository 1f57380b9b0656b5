import pathlib
import sys

# The package is importable from the source tree, without installing it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


import pytest  # noqa: E402

import kvpack  # noqa: E402
from fake_daemon import FakeDaemon  # noqa: E402
from kvpack import testing  # noqa: E402


def _daemons():
    """The in-process fake daemon always; the real kvpackd when a build has one."""
    yield "fake", FakeDaemon
    if testing.find_kvpackd() is not None:
        yield "kvpackd", testing.LocalDaemon


@pytest.fixture(params=[name for name, _ in _daemons()])
def each_daemon_client(request):
    """A client of each available daemon in turn (tests run once per daemon)."""
    with dict(_daemons())[request.param]() as d, kvpack.Client(d.target, timeout=60) as c:
        yield c
