"""Data sets: scikit-learn's digits (ships with the package) and an MNIST IDX reader."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["digits", "read_idx", "mnist", "load_dataset"]

# The fixed split: the last 20% of a seeded permutation is the test set.
_DIGITS_SEED = 0
_DIGITS_TEST_FRACTION = 0.2


def digits(split: str = "train") -> TensorDataset:
    """scikit-learn's 1,797 handwritten digits as (1x8x8 float32 in [0, 1], int64 label) pairs.

    ``split`` is "train" (1,438 images), "test" (359) or "all". The split is fixed, so every
    run, worker and process sees the same images.
    """
    if split not in ("train", "test", "all"):
        raise ValueError(f"split={split!r}; expected 'train', 'test' or 'all'")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)
    y = torch.from_numpy(bunch.target.astype(np.int64))
    if split == "all":
        return TensorDataset(x, y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(_DIGITS_SEED))
    n_test = int(round(len(y) * _DIGITS_TEST_FRACTION))
    idx = order[n_test:] if split == "train" else order[:n_test]
    idx, _ = idx.sort()
    return TensorDataset(x[idx], y[idx])


_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (the MNIST format), gzip-compressed or raw, into a numpy array."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"IDX file {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"{path} is a folder, not an IDX file; put MNIST's file there")
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":  # gzip's magic number, whatever the file is called
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise ValueError(f"{path} is a damaged gzip file ({e}); download it again") from e
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file: it must start with two zero bytes")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX data type 0x{code:02x}")
    if len(data) < 4 + 4 * ndim:
        raise ValueError(f"{path}: the header names {ndim} dimensions but the file ends within "
                         "them; the file is truncated")
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(dims)) * dtype.itemsize
    body = data[4 + 4 * ndim:]
    if len(body) != expected:
        raise ValueError(f"{path}: header says {dims} ({expected} bytes) but the file holds "
                         f"{len(body)} bytes; the file may be truncated")
    return np.frombuffer(body, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


def mnist(root: str | Path, split: str = "train") -> TensorDataset:
    """MNIST from the four IDX files in ``root`` (``.gz`` or raw): 1x28x28 float32, int64 labels."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}; expected 'train' or 'test'")
    prefix = "train" if split == "train" else "t10k"
    root = Path(root).expanduser()

    def find(stem: str) -> Path:
        for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"),
                     stem.replace("-idx", ".idx") + ".gz"):
            if (root / name).exists():
                return root / name
        raise FileNotFoundError(f"no {stem}[.gz] in {str(root)!r}; download MNIST's IDX "
                                "files there")

    images = read_idx(find(f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(find(f"{prefix}-labels-idx1-ubyte"))
    if images.ndim != 3 or labels.ndim != 1:
        raise ValueError(f"MNIST in {root}: images of shape {images.shape} (expected 3 "
                         f"dimensions: count, height, width) and labels of shape {labels.shape} "
                         "(expected 1); are the image and label files swapped?")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels in {root}")
    if images.shape[0] == 0:
        raise ValueError(f"MNIST's {split} files in {root} hold no images; download them again")
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    return TensorDataset(x, y)


def load_dataset(name: str, split: str, data_dir: str | Path | None = None) -> TensorDataset:
    """A data set by name, as the command line names them: "digits", or "mnist" with data_dir."""
    if name == "digits":
        if data_dir:
            raise ValueError(f"data_dir={str(data_dir)!r} (--data-dir) is for the mnist data "
                             "set, and digits ships with scikit-learn: add --dataset mnist, "
                             "or leave --data-dir out")
        return digits(split)
    if name == "mnist":
        if not data_dir:
            raise ValueError("the mnist data set needs data_dir= (--data-dir): a folder with "
                             "MNIST's four IDX files")
        return mnist(data_dir, split)
    raise ValueError(f"unknown data set {name!r}; expected 'digits' or 'mnist'")
