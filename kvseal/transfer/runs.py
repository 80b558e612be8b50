"""Page runs: the unit every transport copies, so consecutive pages move as one chunk."""

from __future__ import annotations


def chunks(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """(src_page, dst_page, n) runs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
