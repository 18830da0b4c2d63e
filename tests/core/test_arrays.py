"""core/arrays.py: the validation layer every user array passes (dtype, shape, finiteness,
range, integral labels, lengths), each refusal naming the array and the problem."""
import numpy as np
import pytest

from core.arrays import check_finite, check_labels, check_matrix, check_numeric, check_rankable
from core.errors import UserError


@pytest.mark.parametrize("a, message", [
    (np.array(["1.0", "2.0"]), r"F.npy must hold numbers, got dtype <U3"),
    (np.array([{}, 1], dtype=object), r"F.npy must hold numbers, got dtype object"),
    (np.array([True, False]), r"F.npy must hold numbers, got dtype bool"),
])
def test_only_numbers_are_data(a, message):
    with pytest.raises(UserError, match=message):
        check_numeric(a, "F.npy")


@pytest.mark.parametrize("a, kw, message", [
    (np.zeros((1, 4, 2)), {"allow_1d": True}, r"must be 1-D \(d\) or 2-D \(n × d\), got shape \(1, 4, 2\)"),
    (np.zeros(4), {}, r"must be 2-D \(n × d\), got shape \(4,\)"),
    (np.zeros((0, 4)), {}, r"has 0 rows; at least 1 needed"),
    (np.zeros((2, 3)), {"cols": 4}, r"has 3 columns; 4 expected"),
    (np.array([[1.0, 2.0], [3.0, np.nan]]), {}, r"contains NaN or infinite values \(first at row 1\)"),
    (np.array([[1.0, -np.inf]]), {}, r"contains NaN or infinite values \(first at row 0\)"),
    (np.array([[1e39, 1.0]]), {}, r"has values beyond the float32 range"),
])
def test_check_matrix_refusals(a, kw, message):
    with pytest.raises(UserError, match=r"^Q.npy " + message):
        check_matrix(a, "Q.npy", **kw)


def test_check_matrix_returns_contiguous_float32_and_takes_a_vector_as_one_row():
    out = check_matrix(np.arange(6, dtype=np.int64).reshape(2, 3)[:, ::-1], "x")
    assert out.dtype == np.float32 and out.flags.c_contiguous and out.tolist() == [[2, 1, 0], [5, 4, 3]]
    assert check_matrix(np.ones(3), "x", allow_1d=True).shape == (1, 3)


def test_check_finite_reads_a_memory_map_in_chunks(tmp_path):
    a = np.ones((10, 3), dtype=np.float32)
    a[7, 2] = np.nan
    np.save(tmp_path / "a.npy", a)
    with pytest.raises(UserError, match=r"first at row 7"):
        check_finite(np.load(tmp_path / "a.npy", mmap_mode="r"), "a", chunk=3)
    check_finite(np.ones(5), "a", chunk=2)


def test_labels_must_be_integral_and_one_per_row():
    assert check_labels(np.array([1.0, 2.0, -1.0]), "L", 3).tolist() == [1, 2, -1]
    assert check_labels(np.array([3, 4], dtype=np.int32), "L").dtype == np.int64
    with pytest.raises(UserError, match=r"^L.npy must be integer class labels; entry 1 is 2.5$"):
        check_labels(np.array([1.0, 2.5]), "L.npy")
    with pytest.raises(UserError, match=r"^L.npy has 2 labels for 3 rows$"):
        check_labels(np.array([1, 2]), "L.npy", 3)
    with pytest.raises(UserError, match=r"must be 1-D \(one label per row\)"):
        check_labels(np.zeros((2, 2), dtype=int), "L.npy")
    with pytest.raises(UserError, match=r"must hold numbers"):
        check_labels(np.array(["cat", "dog"]), "L.npy")
    with pytest.raises(UserError, match=r"NaN"):
        check_labels(np.array([1.0, np.nan]), "L.npy")


def test_rows_that_cannot_be_ranked_by_are_refused():
    check_rankable(np.ones((2, 3), dtype=np.float32), "q")
    with pytest.raises(UserError, match=r"^q: row 1 is all zeros: every item would score the same$"):
        check_rankable(np.array([[1, 0], [0, 0]], dtype=np.float32), "q")
    with pytest.raises(UserError, match=r"^q: row 0 is too large: its norm overflows float32$"):
        check_rankable(np.full((1, 4), 1e30, dtype=np.float32), "q")
