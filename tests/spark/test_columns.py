"""Multi-input rows without a cluster: column specs, stacking, slicing, tensors per input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paraloom.spark.data import Columns, Features, join_chunks, num_rows, take
from paraloom.spark.data.partitions import chunk_rows
from paraloom.spark.data.rows import partition_arrays, row_pair


def test_column_specs_name_every_column_once_and_reject_bad_ones():
    cols = Columns.of(inputs=("img", ["a", "b"]), label=("y", ["a", "z"]))
    assert cols.features == ("img", ["a", "b"]) and cols.label == ("y", ["a", "z"])
    assert cols.names() == ["img", "a", "b", "y", "z"]
    assert (cols.inputs(), cols.outputs()) == (2, 2)
    assert Columns.of().features == "features"  # the default is today's single input
    assert Columns.of(features=("x1", "x2")).features == ["x1", "x2"]  # columns assembled
    assert Columns.of(inputs={"q": "a", "k": ["b"]}).features == {"q": "a", "k": ["b"]}
    with pytest.raises(ValueError, match="either features="):
        Columns.of(features="x", inputs=("a", "b"))
    with pytest.raises(TypeError, match=r"inputs\[1\]=\[\]"):
        Columns.of(inputs=("a", []))
    with pytest.raises(TypeError, match="expected a tuple of column specs"):
        Columns.of(inputs="a")


def test_multi_datasets_stack_slice_and_join_per_input():
    g = np.random.default_rng(0)
    rows = [row_pair(((g.normal(size=(2, 3)), g.normal(size=4)), (i % 3, float(i))))
            for i in range(10)]
    x, y = partition_arrays(rows)
    assert [a.shape for a in x] == [(10, 2, 3), (10, 4)]
    assert [a.shape for a in y] == [(10,), (10,)] and y[0].dtype.kind == "i"
    keyed = [((0, i), r) for i, r in enumerate(rows)]
    joined_x, joined_y = join_chunks(chunk_rows(keyed, size=3))  # 4 chunks, joined back
    np.testing.assert_array_equal(joined_x[1], x[1])
    np.testing.assert_array_equal(joined_y[1], y[1])
    part = take(x, np.array([7, 2]))
    assert num_rows(part) == 2
    np.testing.assert_array_equal(part[0][1], rows[2][0][0])
    # a tuple of numbers is still one feature vector; a tuple label is several targets
    fx, fy = row_pair(((1.0, 2.0, 3.0), (1, 2)))
    assert fx.shape == (3,) and isinstance(fy, tuple) and len(fy) == 2
    with pytest.raises(ValueError, match="different numbers of arrays"):
        partition_arrays([((np.ones(2), np.ones(2)), 0), ((np.ones(2),), 0)])
    with pytest.raises(ValueError, match=r"feature 1 rows have different shapes"):
        partition_arrays([((np.ones(2), np.ones(2)), 0), ((np.ones(2), np.ones(3)), 0)])


def test_features_give_one_tensor_per_input_in_the_models_dtype_and_shapes():
    f = Features(shape=((1, 2, 2), None), dtype="float64")
    x = (np.arange(8, dtype=np.float32).reshape(2, 4), np.arange(6).reshape(2, 3))
    a, b = f.features(x)
    assert a.shape == (2, 1, 2, 2) and a.dtype == torch.float64
    assert b.shape == (2, 3) and b.dtype == torch.float64
    named = Features(shape={"img": (2, 2)}).features({"img": x[0], "extra": x[1]})
    assert named["img"].shape == (2, 2, 2) and named["extra"].shape == (2, 3)
    targets = f.labels((np.array([1, 2]), np.array([0.5, 1.5], np.float32)))
    assert targets[0].dtype == torch.int64 and targets[1].dtype == torch.float64
    with pytest.raises(ValueError, match="gives 2 shapes but the rows hold 3 inputs"):
        f.features((*x, x[1]))
    with pytest.raises(ValueError, match="row of input 0 has 4 values but feature_shape"):
        Features(shape=((3,), None)).features(x)
    with pytest.raises(ValueError, match="gives 2 shapes but the rows hold one input"):
        f.features(x[0])
    # one shape per input, for one input, is that input's shape; one shape is not everyone's
    assert Features(shape=((2, 2),)).features(x[0]).shape == (2, 2, 2)
    with pytest.raises(ValueError, match=r"feature_shape=\(2, 2\) but the rows hold 2 positional"):
        Features(shape=(2, 2)).features((x[0], x[0]))
    with pytest.raises(ValueError, match=r"names inputs \['nope'\]"):
        Features(shape={"nope": (4,)}).features({"img": x[0]})


def test_arrow_batches_decode_to_the_same_arrays_as_rows_and_travel_without_pickle():
    import pyarrow as pa

    from paraloom.spark.data.arrow import batch_pair, decode_chunk, encode_chunk

    g = np.random.default_rng(1)
    img = g.normal(size=(5, 2, 3)).astype(np.float32)
    batch = pa.RecordBatch.from_pydict({
        "img": pa.array(img.tolist(), pa.list_(pa.list_(pa.float32()))),
        "a": pa.array([1.0, 2.0, 3.0, 4.0, 5.0]), "b": pa.array([5, 4, 3, 2, 1]),
        "y": pa.array([0, 1, 0, 1, 1]), "ok": pa.array([True, False, True, True, False])})
    cols = Columns.of(inputs=("img", ["a", "b"]), label=("y", "ok"))
    x, y = batch_pair(batch, cols)
    np.testing.assert_array_equal(x[0], img)
    np.testing.assert_array_equal(x[1], [[1, 5], [2, 4], [3, 3], [4, 2], [5, 1]])
    assert y[1].tolist() == [1, 0, 1, 1, 0]
    back = decode_chunk(encode_chunk((x, y)))
    assert isinstance(back[0], tuple) and len(back[0]) == 2
    np.testing.assert_array_equal(back[0][0], img)
    named = decode_chunk(encode_chunk(({"q": x[1], "k": x[0]}, y[0])))
    assert list(named[0]) == ["q", "k"] and named[1].tolist() == [0, 1, 0, 1, 1]
    with pytest.raises(ValueError, match="arrays of different lengths"):
        batch_pair(pa.RecordBatch.from_pydict({"f": pa.array([[1.0], [1.0, 2.0]]),
                                               "label": pa.array([0, 1])}), Columns.of("f"))
    with pytest.raises(ValueError, match="null value"):
        batch_pair(pa.RecordBatch.from_pydict({"f": pa.array([1.0, None]),
                                               "label": pa.array([0, 1])}), Columns.of("f"))
