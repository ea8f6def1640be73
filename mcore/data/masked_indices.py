"""Sample index of Megatron's masked-LM datasets (BERT, T5): groups of consecutive sentences.

Megatron builds it with the C++ helper ``build_mapping``; :func:`build_sentence_sample_index` gives the
identical array (same dtype, same random streams), checked against megatron-core's compiled helper in
the tests.

The input is a sentence-level dataset: document ``d`` holds sentences ``[docs[d], docs[d + 1])`` with
``sizes[s]`` tokens each. A document takes part when it has at least ``min_sentences`` sentences and,
if it has more than one, none longer than :data:`LONG_SENTENCE_LEN` tokens. Within a document, samples
are runs of consecutive sentences: a run ends at the first sentence where the run has reached its target
length, has ``min_sentences`` sentences and leaves at least two sentences in the document, or at the
document's last sentence. Each run's target length is ``max_length``, except with probability about
``short_seq_prob`` (``r % round(1 / p) == 0`` for a raw 32-bit draw ``r``) where it is
``2 + r % (max_length - 1)``. The draws come from one ``std::mt19937(seed)`` stream: one when a
document starts and one after each run (no draws at all when ``short_seq_prob`` is 0). Epochs repeat the
pass over the documents (the stream continues) until ``num_samples`` runs exist. The rows
``(first sentence, end sentence, target length)`` are then shuffled by a Fisher-Yates pass driven by
``std::mt19937_64(seed + 1)``: for ``i = n-1 .. 1``, swap rows ``i`` and ``r_i % (i + 1)``.

The per-run walk is sequential by nature (each run's end decides which draw the next run gets); it walks
runs, not sentences (a binary search finds each run's end), so the cost is one Python step per sample
plus one per document (about 3 s for a million samples on one CI core, against 0.15 s for the C++).
The shuffle is vectorized (:func:`fisher_yates_permutation`).
"""

from __future__ import annotations

import bisect

import numpy as np

LONG_SENTENCE_LEN = 512
"""A document with more than one sentence and a sentence longer than this is left out (Megatron's rule)."""

_U64 = np.uint64


def mt19937_raw(seed: int, count: int) -> np.ndarray:
    """The first ``count`` outputs of ``std::mt19937(seed)`` (uint64 array of 32-bit values).

    numpy's legacy ``RandomState(seed)`` seeds MT19937 exactly as ``std::mt19937(seed)`` does
    (``init_genrand``); its bit generator's raw outputs are the untempered-then-tempered 32-bit words.
    """
    generator = np.random.MT19937()
    generator.state = np.random.RandomState(seed).get_state(legacy=False)
    return generator.random_raw(count)


class MT19937_64:
    """``std::mt19937_64``: the 64-bit Mersenne Twister (Matsumoto and Nishimura 2004), vectorized.

    State: 312 words; a twist regenerates all of them (in three vectorized steps that respect the
    in-place order of the reference algorithm), then each word is tempered into one output.
    """

    _N, _M = 312, 156
    _MATRIX_A = _U64(0xB5026F5AA96619E9)
    _UPPER, _LOWER = _U64(0xFFFFFFFF80000000), _U64(0x7FFFFFFF)

    def __init__(self, seed: int) -> None:
        state = [seed & 0xFFFFFFFFFFFFFFFF]
        for i in range(1, self._N):
            prev = state[-1]
            state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & 0xFFFFFFFFFFFFFFFF)
        self._state = np.array(state, dtype=_U64)
        self._buffer = np.zeros(0, dtype=_U64)

    def _mix(self, upper_from: np.ndarray, lower_from: np.ndarray, far: np.ndarray) -> np.ndarray:
        x = (upper_from & self._UPPER) | (lower_from & self._LOWER)
        return far ^ (x >> _U64(1)) ^ np.where((x & _U64(1)) == 1, self._MATRIX_A, _U64(0))

    def _twist(self) -> None:
        mt, n, m = self._state.copy(), self._N, self._M
        # i in [0, n-m): reads the old mt[i+1] and mt[i+m].
        mt[: n - m] = self._mix(mt[: n - m], mt[1 : n - m + 1], mt[m:n])
        # i in [n-m, n-1): reads the old mt[i+1] and the new mt[i+m-n].
        mt[n - m : n - 1] = self._mix(mt[n - m : n - 1], mt[n - m + 1 : n], mt[: m - 1])
        # i = n-1: reads the new mt[0] and mt[m-1].
        mt[n - 1 :] = self._mix(mt[n - 1 :], mt[:1], mt[m - 1 : m])
        self._state = mt

    def _temper(self, y: np.ndarray) -> np.ndarray:
        y = y ^ ((y >> _U64(29)) & _U64(0x5555555555555555))
        y = y ^ ((y << _U64(17)) & _U64(0x71D67FFFEDA60000))
        y = y ^ ((y << _U64(37)) & _U64(0xFFF7EEE000000000))
        return y ^ (y >> _U64(43))

    def draw(self, count: int) -> np.ndarray:
        """The next ``count`` outputs (uint64)."""
        parts, have = [self._buffer], len(self._buffer)
        while have < count:
            self._twist()
            parts.append(self._temper(self._state))
            have += self._N
        out = np.concatenate(parts)
        self._buffer = out[count:]
        return out[:count]


def fisher_yates_permutation(count: int, seed: int) -> np.ndarray:
    """The row order Megatron's shuffle leaves: ``perm[p]`` = the original row that ends at ``p`` (int64).

    The pass swaps positions ``i`` and ``j_i = r_i % (i + 1)`` for ``i = n-1 .. 1`` (``r`` from
    ``std::mt19937_64(seed)``). Rather than swap one by one, it is solved in vectorized form. Position
    ``i`` is final once step ``i`` ran, and holds what position ``j_i`` held just before. A position
    ``p <= i`` was last written (before step ``i``) by the earliest later step ``k > i`` with ``j_k = p``,
    which put there ``V(k)``, the value position ``k`` held before step ``k``; with no such step it still
    holds ``p``. So ``perm[i] = V(succ(i))`` (``succ(i)``: the next step after ``i`` with the same ``j``),
    else ``j_i``; and ``V(k) = V(m(k))`` with ``m(k)`` the first step after ``k`` whose ``j`` is ``k``,
    else ``k``: chains towards larger indices, resolved by pointer jumping (``O(n log n)``).
    Position 0 counts as a step with ``j_0 = 0``.
    """
    index = np.arange(count, dtype=np.int64)
    if count <= 1:
        return index
    j = np.zeros(count, dtype=np.int64)
    draws = MT19937_64(seed).draw(count - 1)  # one per i = count-1 .. 1
    j[count - 1 : 0 : -1] = (draws % np.arange(count, 1, -1, dtype=_U64)).astype(np.int64)
    order = np.lexsort((index, j))  # by j, then by step
    sorted_j = j[order]
    same = sorted_j[1:] == sorted_j[:-1]
    succ = np.full(count, -1, dtype=np.int64)
    succ[order[:-1][same]] = order[1:][same]
    first_with_j = np.full(count, -1, dtype=np.int64)
    group_starts = np.concatenate(([True], ~same))
    first_with_j[sorted_j[group_starts]] = order[group_starts]
    # m(k): steps with j = k are all >= k, so the first of them after k is succ(k) when j_k = k itself.
    m = np.where(j == index, succ, first_with_j)
    root = np.where(m >= 0, m, index)
    while True:
        jumped = root[root]
        if np.array_equal(jumped, root):
            break
        root = jumped
    return np.where(succ >= 0, root[np.maximum(succ, 0)], j)


class _TargetLengths:
    """Target lengths from the ``std::mt19937(seed)`` stream, drawn in blocks."""

    _BLOCK = 1 << 16

    def __init__(self, seed: int, max_length: int, short_seq_ratio: int) -> None:
        self.max_length, self.ratio = max_length, short_seq_ratio
        self._generator = np.random.MT19937()
        self._generator.state = np.random.RandomState(seed).get_state(legacy=False)
        self._values: list[int] = []
        self._position = 0

    def next(self) -> int:
        if self.ratio == 0:  # Megatron draws nothing then
            return self.max_length
        if self._position == len(self._values):
            raw = self._generator.random_raw(self._BLOCK)
            short = raw % _U64(self.ratio) == 0
            lengths = np.where(short, _U64(2) + raw % _U64(self.max_length - 1), _U64(self.max_length))
            self._values, self._position = lengths.astype(np.int64).tolist(), 0
        value = self._values[self._position]
        self._position += 1
        return value


def build_sentence_sample_index(
    docs: np.ndarray,
    sizes: np.ndarray,
    num_epochs: int | None,
    num_samples: int | None,
    max_length: int,
    short_seq_prob: float,
    seed: int,
    min_sentences: int,
) -> np.ndarray:
    """``[n, 3]`` rows ``(first sentence, end sentence, target length)``, shuffled (see module doc).

    Args:
        docs: int64 sentence boundaries of the documents, ``len = documents + 1``.
        sizes: int32 tokens per sentence (the whole dataset's; ``docs`` indexes into it).
        num_epochs: passes over the documents at most (None: as many as ``num_samples`` needs).
        num_samples: stop starting new epochs once this many samples exist (None: no limit).
        max_length: the longest target length (Megatron passes ``seq_length - 3`` for BERT).
        short_seq_prob: probability of a shorter random target length.
        seed: the random seed (> 0).
        min_sentences: sentences a sample needs at least (2 with BERT's binary head, else 1).

    Returns:
        uint32 rows (uint64 when the dataset has more than 2**32 - 1 sentences).

    Raises:
        ValueError: bad arguments, or ``num_samples`` asked of documents that yield no sample.
    """
    _check_index_args(max_length, short_seq_prob, seed)
    docs = np.asarray(docs, dtype=np.int64)
    sizes = np.asarray(sizes)
    short_seq_ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0
    doc_bounds = _eligible_documents(docs, sizes, min_sentences)
    cumulative = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))).tolist()
    targets = _TargetLengths(seed, max_length, short_seq_ratio)
    first, end, length = [], [], []
    epochs = num_epochs if num_epochs is not None else np.iinfo(np.int32).max - 1
    for _ in range(epochs):
        if num_samples is not None and len(first) >= num_samples:
            break
        before = len(first)
        for lo, hi in doc_bounds:
            _add_document_samples(lo, hi, cumulative, targets, min_sentences, (first, end, length))
        if len(first) == before:
            if num_samples:
                raise ValueError(
                    f"no document yields a sample (each needs >= {min_sentences} sentences, none over "
                    f"{LONG_SENTENCE_LEN} tokens), but {num_samples} samples were asked"
                )
            break
    dtype = np.uint64 if len(sizes) > np.iinfo(np.uint32).max else np.uint32
    rows = np.stack(
        [np.asarray(first, np.int64), np.asarray(end, np.int64), np.asarray(length, np.int64)], axis=1
    ).reshape(-1, 3)
    return rows[fisher_yates_permutation(len(rows), seed + 1)].astype(dtype)


def _check_index_args(max_length: int, short_seq_prob: float, seed: int) -> None:
    """Raise ``ValueError`` for a target length below 2, a probability outside [0, 1] or a seed <= 0."""
    if max_length < 2:
        raise ValueError(f"max_length={max_length} must be > 1")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(f"short_seq_prob={short_seq_prob} must be in [0, 1]")
    if seed <= 0:
        raise ValueError(f"seed={seed} must be > 0 (Megatron's build_mapping asserts it)")


def _eligible_documents(docs: np.ndarray, sizes: np.ndarray, min_sentences: int) -> list[tuple[int, int]]:
    """``(first sentence, end sentence)`` of the documents that take part: enough sentences, and no
    over-long sentence unless there is only one."""
    starts, ends = docs[:-1], docs[1:]
    counts = ends - starts
    long_sentence = sizes > LONG_SENTENCE_LEN
    long_before = np.concatenate(([0], np.cumsum(long_sentence, dtype=np.int64)))
    has_long = (long_before[ends] - long_before[starts]) > 0
    eligible = np.flatnonzero((counts >= min_sentences) & ~((counts > 1) & has_long))
    return [(int(starts[d]), int(ends[d])) for d in eligible]


def _add_document_samples(
    lo: int, hi: int, cumulative: list[int], targets, min_sentences: int, rows: tuple[list, list, list]
) -> None:
    """Append the samples of document ``[lo, hi)`` (one epoch's pass) to ``rows`` = ``(first, end,
    length)``: runs of sentences reaching a random target length each."""
    first, end, length = rows
    last_allowed = hi - 3  # a run may end early only if two sentences remain after it
    begin, target = lo, targets.next()
    while True:
        # First sentence at which the run from `begin` has reached `target` tokens ...
        reach = bisect.bisect_left(cumulative, cumulative[begin] + target, begin + 1) - 1
        stop = max(reach, begin + min_sentences - 1)
        if stop > last_allowed:  # ... unless that leaves fewer than two: take the rest
            stop = hi - 1
        first.append(begin)
        end.append(stop + 1)
        length.append(target)
        begin = stop + 1
        target = targets.next()
        if begin == hi:
            break
