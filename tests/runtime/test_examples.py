"""The examples a user copies from must run."""

import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def test_tree_round_by_hand_runs():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "tree_round_by_hand.py")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "accepted path: [0, 1, 2, 3]" in out.stdout  # the toy target agrees with the best path for 3 tokens
    assert "positions after compaction: [7, 8, 9, 10]" in out.stdout
