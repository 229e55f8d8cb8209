"""Host-side index math in numpy: on arrays of a few thousand ints, a numpy op costs a fraction of a
torch op's dispatch overhead, and it converts long lists of ints faster."""

from collections.abc import Sequence

import numpy as np


def repeat_each(values: Sequence[int] | np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """values[i] repeated counts[i] times, back to back (int64)."""
    return np.repeat(np.asarray(values, dtype=np.int64), counts)


def ragged_arange(starts: Sequence[int], lens: Sequence[int]) -> np.ndarray:
    """The ranges [starts[i], starts[i] + lens[i]) back to back (int64), without a Python loop
    over their elements."""
    lens_np = np.array(lens, dtype=np.int64)
    # output index k in range i holds starts[i] + (k - lens before range i)
    shifts = np.array(starts, dtype=np.int64) - (np.cumsum(lens_np) - lens_np)
    return np.arange(lens_np.sum()) + np.repeat(shifts, lens_np)
