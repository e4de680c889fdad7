"""Checks of exactness several test files make."""

from __future__ import annotations

import torch


def assert_verification_rows_equal_steps(model, ids: list[int], kv_dtype: torch.dtype | None = None,
                                         rows: int = 7) -> None:
    """`rows` new tokens after `ids` in one forward give, row by row, the logits of as many 1-token
    steps bit for bit (the few-row paths sum in one order whatever the rows beside)."""
    from bench.cuda_exactness import rows_against_steps

    rows = rows_against_steps(model, ids, kv_dtype, rows)
    assert rows["bit_equal"], f"a verification's logits differ from steps' by up to {rows['max_abs_diff']:.3g}"
