"""kvpack.timeline's arithmetic (the GPU-free part): what the FIGURE timeline fields say, from raw
times made up here; the GPU loop itself runs in test_torch_cuda_gpu.py."""

from types import SimpleNamespace

import pytest

from kvpack import timeline


def result(project_s, attend_s, queue_s):
    return SimpleNamespace(seconds=SimpleNamespace(project=project_s, attend=attend_s, queue=queue_s))


def raw():
    synced = [(result(0.0100, 0.0170, 0.0004), False, False),
              (result(0.0102, 0.0171, 0.0006), False, False),
              (result(0.0098, 0.0169, 0.0005), False, False)]
    ordered = [(result(0.0100, 0.0020, 0.0003), True, True),
               (result(0.0100, 0.0020, 0.0003), True, False),
               (result(0.0100, 0.0020, 0.0003), True, True),
               (result(0.0100, 0.0020, 0.0003), True, True)]
    return [3.5, 3.6], {
        "synchronised": {"per_call": [32.6, 32.8], "span": [28.9, 29.3, 29.1], "results": synced},
        "stream_ordered": {"per_call": [30.9, 31.1], "span": [27.4, 27.5, 27.6], "results": ordered},
    }


def test_idle_and_call_over_daemon_are_against_the_callers_kernels_plus_the_daemons_time():
    caller, per_mode = raw()
    m = timeline.summarise(caller, per_mode)
    assert m["caller_ms"] == pytest.approx(3.55)
    # the daemon's own time comes from the synchronised calls only (stream-ordered attend ends at
    # the last launch): medians of project + attend, 27.0 ms
    assert m["daemon_ms"] == pytest.approx(27.0)
    assert m["daemon_project_ms"] == pytest.approx(10.0)
    assert m["daemon_attend_ms"] == pytest.approx(17.0)
    so, sy = m["stream_ordered"], m["synchronised"]
    assert so["per_call_ms"] == pytest.approx(31.0)
    assert so["idle_ms"] == pytest.approx(31.0 - 3.55 - 27.0)
    assert so["call_over_daemon"] == pytest.approx((31.0 - 3.55) / 27.0)
    assert sy["idle_ms"] == pytest.approx(32.7 - 3.55 - 27.0)
    assert so["span_ms"] == pytest.approx(27.5)
    assert so["queue_ms"] == pytest.approx(0.3)
    assert so["answered_early"] and not sy["answered_early"]
    assert so["answer_ahead"] == pytest.approx(0.75) and sy["answer_ahead"] == 0


def test_figure_lines_name_every_field_once_per_mode():
    caller, per_mode = raw()
    m = dict(timeline.summarise(caller, per_mode), tokens=32760, heads=12, head_dim=128, blocks=12)
    lines = timeline.figure_lines(m)
    assert [line.split()[2] for line in lines] == ["mode=synchronised", "mode=stream_ordered"]
    fields = dict(f.split("=", 1) for f in lines[1].split()[2:])
    assert fields["tokens"] == "32760" and fields["heads"] == "12x128"
    assert float(fields["call_over_daemon"]) == pytest.approx((31.0 - 3.55) / 27.0, abs=1e-4)
    assert fields["answered_early"] == "True" and fields["answer_ahead"] == "0.75"
    for key in ("per_call_ms", "caller_ms", "daemon_ms", "idle_ms", "span_ms", "queue_ms"):
        float(fields[key])


def test_no_calls_are_not_answered_early():
    caller, per_mode = raw()
    per_mode["stream_ordered"]["results"] = []
    per_mode["stream_ordered"]["span"] = []
    m = timeline.summarise(caller, per_mode)
    assert not m["stream_ordered"]["answered_early"]


def test_a_label_goes_first():
    caller, per_mode = raw()
    m = dict(timeline.summarise(caller, per_mode), tokens=4096, heads=12, head_dim=128, blocks=12)
    assert all(line.startswith("FIGURE timeline label=base mode=")
               for line in timeline.figure_lines(m, label="base"))
