"""kvpack.types: the sparse option from its text / mapping forms (as_sparse, the ComfyUI node's
setting), the range-flag check and leading_text ranges. No daemon, no torch."""

import pytest

from kvpack.types import Range, Sparse, as_sparse, check_range_flags, leading_text


def test_as_sparse_reads_the_cli_words():
    assert as_sparse(None) is None
    for dense in ("", "off", " Dense ", "none"):
        assert as_sparse(dense) is None
    assert as_sparse("topk=0.3") == Sparse(topk_ratio=0.3)
    assert as_sparse("tau=1.5,no_tail,sink_pages=2,min_exact_pages=5") == Sparse(
        rel_tau=1.5, tail=False, sink_pages=2, min_exact_pages=5)
    assert as_sparse("topk_ratio=0.25, tail=on") == Sparse(topk_ratio=0.25, tail=True)
    assert as_sparse({"topk_ratio": 0.1, "tail": False}) == Sparse(topk_ratio=0.1, tail=False)
    s = Sparse(rel_tau=0.5)
    assert as_sparse(s) is s


@pytest.mark.parametrize("value,field", [
    ("topk=0", "sparse.topk_ratio"), ("topk=1.5", "sparse.topk_ratio"),
    ("topk=x", "sparse.topk_ratio"), ("tau=-1", "sparse.rel_tau"), ("tau=nan", "sparse.rel_tau"),
    ("topk=0.2,sink_pages=2000", "sparse.sink_pages"),
    ("topk=0.2,sink_pages=1.5", "sparse.sink_pages"),
    ("topk=0.2,min_exact_pages=-1", "sparse.min_exact_pages"), ("tail=maybe", "sparse.tail"),
    ("topk=0.2,tau=1", "topk_ratio or rel_tau"), ("half", "is not topk=R"),
    ({"topk": 0.2}, "unknown fields"), ({"topk_ratio": 2.0}, "sparse.topk_ratio"),
])
def test_bad_values_name_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        as_sparse(value)


def test_other_types_are_refused():
    with pytest.raises(TypeError, match="kvpack.Sparse"):
        as_sparse(0.2)


def test_leading_text_marks_the_first_tokens():
    assert leading_text(300, 0, ("int8",)) == [Range(0, 300, 0, ("int8",))]
    assert leading_text(300, 77, ("int8",)) == [
        Range(0, 77, 0, ("int8",), always_attend=True), Range(77, 300, 0, ("int8",))]
    assert leading_text(50, 77) == [Range(0, 50, 0, ("int4",), always_attend=True)]
    with pytest.raises(ValueError, match="text_tokens"):
        leading_text(50, -1)


def test_range_flags_need_sparse():
    flagged = [Range(0, 10), Range(10, 20, attend_densely=True)]
    check_range_flags(flagged, Sparse())
    check_range_flags([Range(0, 10)], None)
    with pytest.raises(ValueError, match=r"ranges\[1\]\.attend_densely needs sparse"):
        check_range_flags(flagged, None)
