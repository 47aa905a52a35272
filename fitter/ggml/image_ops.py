"""The ggml ops only the vision encoders build (fitter.mtmd's clip graphs): the patch unfold, pooling, resizing."""

from __future__ import annotations

from typing import Iterable

from fitter.ggml.tensor import Context, Tensor, new_tensor
from fitter.ggml.types import F32


def im2col(ctx: Context, a: Tensor, b: Tensor, s0: int, s1: int, type_: int, name: str = "") -> Tensor:
    """ggml_im2col, 2-D, no padding or dilation: [IC*KH*KW, OW, OH, N] of `type_` (F16 unless the kernel is BF16)."""
    ow = (b.ne[0] - a.ne[0]) // s0 + 1  # ggml_calc_conv_output_size
    oh = (b.ne[1] - a.ne[1]) // s1 + 1
    return new_tensor(ctx, "IM2COL", type_, (a.ne[2] * a.ne[1] * a.ne[0], ow, oh, b.ne[3]), (a, b), name)


def pool_2d(ctx: Context, a: Tensor, k: int, s: int, name: str = "") -> Tensor:  # ggml_pool_2d, no padding
    return new_tensor(ctx, "POOL_2D", F32, ((a.ne[0] - k) // s + 1, (a.ne[1] - k) // s + 1, a.ne[2], a.ne[3]), (a,), name)


def interpolate(ctx: Context, a: Tensor, ne: Iterable[int], name: str = "") -> Tensor:  # ggml_interpolate (UPSCALE)
    return new_tensor(ctx, "UPSCALE", a.type, ne, (a,), name)
