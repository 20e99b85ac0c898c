"""``bench cluster``: a launch whose processes all ended well but left no result is reported
as a failed launch with its cause (its logs and stacks), not lost with its directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvd_compress.bench.cluster import LaunchError, _rows


def test_rows_of_a_launch_that_wrote_them(tmp_path: Path) -> None:
    (tmp_path / "rows.json").write_text('[{"scheme": "powersgd"}]')
    assert _rows(tmp_path) == [{"scheme": "powersgd"}]


@pytest.mark.parametrize("written", [None, '[{"scheme": "powe'])
def test_a_launch_without_a_readable_result_says_why(tmp_path: Path,
                                                     written: str | None) -> None:
    if written is not None:
        (tmp_path / "rows.json").write_text(written)
    (tmp_path / "mpirun.log").write_text("x" * 5000 + "\nrank 2: Horovod has been shut down")
    (tmp_path / "stacks-rank1.txt").write_text("File \"cluster_rank.py\", line 9, in main")
    with pytest.raises(LaunchError) as caught:
        _rows(tmp_path)
    message = str(caught.value)
    assert message.startswith("the launch ended without a result (")
    assert "mpirun.log" in message and "rank 2: Horovod has been shut down" in message
    assert "x" * 4001 not in message  # the log's tail only
    assert "stacks-rank1" in message and "cluster_rank.py" in message
