"""Images between the model's range and pixels: the one float -> uint8 conversion.

The networks see images in [-1, 1] (background -1; `dataset.mnist.to_model_range` makes them from
MNIST's uint8). Everything that turns a generated image back into pixels (the web page's tiles,
`ddm-fleet generate`'s PNG grids, the evaluation's saved uint8 images) uses `to_uint8`, so one
image gives the same pixels everywhere. numpy only (the web viewer's install has no torch).
"""

from __future__ import annotations

import numpy as np


def to_uint8(x) -> np.ndarray:
    """Model range -> pixels: floats in [-1, 1], any shape -> uint8 in [0, 255], the same shape.

    p = clip(rint((x + 1) * 127.5), 0, 255), computed in float32. `rint` rounds a half to even
    (127.5 -> 128, 254.5 -> 254); values outside [-1, 1] clip to 0 / 255. Non-finite values (a
    diverging trajectory) do not break the caller: NaN and -Inf give 0, +Inf gives 255.
    The evaluation reads saved pixels back as p / 127.5 - 1 (`evaluation.rescore`), within half a
    level (1 / 255) of x.
    """
    a = np.asarray(x, dtype=np.float32)
    a = np.nan_to_num(a, nan=-1.0, posinf=1.0, neginf=-1.0)
    return np.clip(np.rint((a + 1.0) * 127.5), 0, 255).astype(np.uint8)
