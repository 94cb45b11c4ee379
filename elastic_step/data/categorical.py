"""Categorical features as integer ids, in numpy alone: one implementation for every front end.

A PyTorch and a Keras model definition feed the same batch through these layers and get the same
ids, on any backend (Keras' own Hashing and StringLookup need TensorFlow and do not run on the
torch backend). The semantics follow ElasticDL's `elasticdl_preprocessing` layers:

- `Hashing(num_bins, salt)`: id = hash64(value) mod num_bins, for ints and strings;
- `Lookup(vocabulary, num_oov_buckets)`: a value's index in the vocabulary, ids 0..V-1; a value
  outside it goes to one of the buckets V..V+num_oov_buckets-1 by its hash, or to `default`
  (-1, as ElasticDL returns) when there are no buckets;
- `Bucketize(boundaries)`: np.digitize — a bucket holds its left boundary, not its right one;
- `ConcatWithOffset(sizes)`: several fields' ids in one table, each field offset by the sizes of
  the fields before it, so that one embedding table serves them all.

The hash is our own and documented here, so ids are stable across processes, machines and
releases (Python's `hash()` is salted per process; pandas' hash may change with pandas):
- an int is its 64-bit two's complement value v: hash = fmix64(v ^ seed_int);
- a string is its UTF-8 bytes, cut into little-endian 64-bit words w_j (zero padded; the empty
  string is one zero word): hash = fmix64(sum_j fmix64(w_j ^ (seed_str + j * GOLDEN)) + len * GOLDEN),
  mod 2^64. A sum over the words, each mixed with its position, rather than a chain of them, lets
  numpy hash every string of a batch at once with one `add.reduceat`, whatever their lengths;
- fmix64 is MurmurHash3's 64-bit finaliser; the seed is 0, or the hash of the salt, and
  seed_int / seed_str are it XOR two constants (the first two words of SHA-512's initial value).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from elastic_step.errors import DataError

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# Without them, seed 0 would hash the int 0 and the empty string to 0.
_INT_DOMAIN = 0x6A09E667F3BCC908
_STRING_DOMAIN = 0xBB67AE8584CAA73B
_S33 = np.uint64(33)


def _fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's finaliser, in place on a uint64 array (numpy wraps array arithmetic mod 2^64)."""
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


def _as_strings(values) -> pa.LargeStringArray:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        array = values if values.type == pa.large_string() else values.cast(pa.large_string())
    else:
        array = pa.array(np.asarray(values, dtype=object).ravel(), type=pa.large_string())
    if array.null_count:
        raise DataError(f"{array.null_count} missing values among strings to hash — fill them first")
    return array


def hash_strings(values, seed: int = 0) -> np.ndarray:
    """The 64-bit hash (uint64) of each string of `values` (a sequence, numpy or Arrow array)."""
    array = _as_strings(values)
    n = len(array)
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int64)[array.offset: array.offset + n + 1]
    data = array.buffers()[2]
    chars = np.frombuffer(data, dtype=np.uint8) if data is not None else np.empty(0, dtype=np.uint8)
    lengths = np.diff(offsets)
    words_per = np.maximum((lengths + 7) // 8, 1)
    word_start = np.zeros(n, dtype=np.int64)
    np.cumsum(words_per[:-1], out=word_start[1:])
    padded = np.zeros(int(words_per.sum()) * 8, dtype=np.uint8)
    # Each string's bytes move from its offset to the start of its first word.
    shift = np.repeat(word_start * 8 - (offsets[:-1] - offsets[0]), lengths)
    padded[np.arange(len(shift), dtype=np.int64) + shift] = chars[offsets[0]:offsets[-1]]
    words = padded.view(np.dtype("<u8")).astype(np.uint64)
    position = (np.arange(len(words), dtype=np.int64) - np.repeat(word_start, words_per)).astype(np.uint64)
    keys = _fmix64(words ^ (position * _GOLDEN + np.uint64(seed ^ _STRING_DOMAIN)))
    total = np.add.reduceat(keys, word_start)
    total += lengths.astype(np.uint64) * _GOLDEN
    return _fmix64(total)


def hash_ints(values, seed: int = 0) -> np.ndarray:
    """The 64-bit hash (uint64) of each int of `values` (ints or bools; never floats)."""
    array = np.asarray(values)
    if array.dtype.kind not in "iub":
        raise DataError(f"cannot hash values of type {array.dtype} as ints — hash ints or strings, "
                        "and bucketize numbers with Bucketize")
    v = array.astype(np.int64).ravel().view(np.uint64)  # astype copies: the caller's array stays
    v ^= np.uint64(seed ^ _INT_DOMAIN)
    return _fmix64(v)


def hash_values(values, seed: int = 0) -> np.ndarray:
    """Ints by `hash_ints`, anything else (str, object arrays of str, Arrow strings) by `hash_strings`."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        if pa.types.is_integer(values.type) or pa.types.is_boolean(values.type):
            return hash_ints(values.to_numpy(zero_copy_only=False), seed)
        return hash_strings(values, seed)
    array = np.asarray(values)
    if array.dtype.kind in "iub":
        return hash_ints(array, seed)
    if array.dtype.kind == "f":
        hash_ints(array)  # raises the message for numbers
    return hash_strings(array, seed)


def salt_seed(salt: str | int | None) -> int:
    """The seed a salt stands for: 0 without one, else the hash of its text."""
    if salt is None or salt == "":
        return 0
    return int(hash_strings([str(salt)])[0])


def _shape(values) -> tuple[int, ...]:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return (len(values),)
    return np.shape(values)


class Hashing:
    """ids = hash64(value) mod num_bins; ints and strings; stable across processes and machines."""

    def __init__(self, num_bins: int, salt: str | int | None = None):
        if not isinstance(num_bins, int) or isinstance(num_bins, bool) or num_bins < 1:
            raise DataError(f"Hashing needs num_bins >= 1, got {num_bins!r}")
        self.num_bins, self.salt = num_bins, salt
        self._seed = salt_seed(salt)

    @property
    def num_ids(self) -> int:
        return self.num_bins

    def __call__(self, values) -> np.ndarray:
        ids = hash_values(values, self._seed) % np.uint64(self.num_bins)
        return ids.astype(np.int64).reshape(_shape(values))


class Lookup:
    """A value's index in `vocabulary` (ids 0..V-1); other values to V + hash mod num_oov_buckets,
    or to `default` when there are no out-of-vocabulary buckets.

    A lookup hashes the batch (see the module's hash), finds each hash among the vocabulary's
    sorted hashes, and confirms the value itself, so that a batch costs a hash and a binary
    search whatever the vocabulary's size."""

    def __init__(self, vocabulary, num_oov_buckets: int = 1, default: int = -1, salt: str | int | None = None):
        if not isinstance(num_oov_buckets, int) or isinstance(num_oov_buckets, bool) or num_oov_buckets < 0:
            raise DataError(f"Lookup needs num_oov_buckets >= 0, got {num_oov_buckets!r}")
        values = np.asarray(list(vocabulary) if not isinstance(vocabulary, np.ndarray) else vocabulary)
        self.ints = values.dtype.kind in "iub"
        if not self.ints and values.size and values.dtype.kind not in "OUS":
            raise DataError(f"a vocabulary holds ints or strings, not {values.dtype}")
        self.vocabulary = values.astype(np.int64) if self.ints else values.astype(object)
        if len(set(self.vocabulary.tolist())) != len(self.vocabulary):
            raise DataError("the vocabulary names a value twice; each value needs one id")
        self.num_oov_buckets, self.default = num_oov_buckets, default
        self._oov = Hashing(num_oov_buckets, salt) if num_oov_buckets else None
        keys = self.vocabulary if self.ints else hash_strings(self.vocabulary)
        self._order = np.argsort(keys, kind="stable")
        self._sorted = keys[self._order]
        if not self.ints and len(self._sorted) and np.any(self._sorted[1:] == self._sorted[:-1]):
            raise DataError("two values of the vocabulary share a 64-bit hash; salt-free lookup cannot tell them apart")

    @property
    def num_ids(self) -> int:
        return len(self.vocabulary) + self.num_oov_buckets

    def __call__(self, values) -> np.ndarray:
        shape = _shape(values)
        if isinstance(values, (pa.Array, pa.ChunkedArray)):
            values = values.to_numpy(zero_copy_only=False)
        flat = np.asarray(values).ravel()
        if self.ints and flat.dtype.kind not in "iub":
            raise DataError(f"this vocabulary holds ints; values of type {flat.dtype} cannot be looked up in it")
        ids = np.full(len(flat), -1, dtype=np.int64)
        if len(self._sorted):
            keys = flat.astype(np.int64) if self.ints else hash_strings(flat)
            at = np.minimum(np.searchsorted(self._sorted, keys), len(self._sorted) - 1)
            index = self._order[at]
            found = self._sorted[at] == keys
            if not self.ints:  # a hash is no proof: compare the values themselves
                found[found] = np.asarray(self.vocabulary[index[found]] == flat[found].astype(object), dtype=bool)
            ids[found] = index[found]
        missing = ids < 0
        if missing.any():
            if self._oov is None:
                ids[missing] = self.default
            else:
                ids[missing] = len(self.vocabulary) + self._oov(flat[missing])
        return ids.reshape(shape)


class Bucketize:
    """np.digitize: id i for boundaries[i-1] <= x < boundaries[i]; 0 below the first, len(boundaries)
    at or above the last (and for NaN)."""

    def __init__(self, boundaries):
        bounds = np.asarray(list(boundaries), dtype=np.float64)
        if bounds.ndim != 1 or not np.all(np.isfinite(bounds)) or np.any(np.diff(bounds) <= 0):
            raise DataError(f"bucket boundaries must be finite and strictly increasing, got {list(boundaries)}")
        self.boundaries = bounds

    @property
    def num_ids(self) -> int:
        return len(self.boundaries) + 1

    def __call__(self, values) -> np.ndarray:
        if isinstance(values, (pa.Array, pa.ChunkedArray)):
            values = values.to_numpy(zero_copy_only=False)
        array = np.asarray(values)
        if array.dtype.kind not in "iubf":
            raise DataError(f"cannot bucketize values of type {array.dtype}: boundaries cut numbers")
        return np.digitize(array, self.boundaries).astype(np.int64)


class ConcatWithOffset:
    """Fields' ids side by side, [n, fields], each offset by the sizes of the fields before it, so
    that field f's ids are [offsets[f], offsets[f] + sizes[f]) of one table of `num_ids` rows."""

    def __init__(self, sizes, names=None):
        self.sizes = [int(s) for s in sizes]
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise DataError(f"ConcatWithOffset needs one size >= 1 per field, got {list(sizes)}")
        self.names = list(names) if names is not None else [f"field {i}" for i in range(len(self.sizes))]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes[:-1])]).astype(np.int64)

    @property
    def num_ids(self) -> int:
        return int(sum(self.sizes))

    def __call__(self, fields) -> np.ndarray:
        if len(fields) != len(self.sizes):
            raise DataError(f"ConcatWithOffset has {len(self.sizes)} fields, was given {len(fields)}")
        columns = []
        for ids, size, offset, name in zip(fields, self.sizes, self.offsets, self.names):
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)
            bad = (ids < 0) | (ids >= size)
            if bad.any():
                raise DataError(f"ids of {name} must lie in [0, {size}), found {int(ids[bad][0])} — give the "
                                "lookup out-of-vocabulary buckets, or mask the default id before concatenating")
            columns.append(ids + offset)
        return np.stack(columns, axis=1)
