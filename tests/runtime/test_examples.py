"""The README's walk-through, ``examples/tree_round_by_hand.py``, runs as shipped and shows a consistent round."""

import runpy
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tree_round_by_hand.py"


def test_tree_round_by_hand_runs_and_its_accepted_paths_are_chains(capsys):
    g = runpy.run_path(str(EXAMPLE), run_name="__main__")
    printed = capsys.readouterr().out
    assert "accepted path:" in printed and "tree attention out:" in printed
    batch, path, accept_len = g["batch"], g["path"], g["accept_len"]
    for b in range(g["B"]):
        n = int(accept_len[b])
        assert n >= 2  # the toy target agrees with node 1, the root's first child, in every request
        accepted = path[b, :n].tolist()
        assert accepted[0] == 0
        assert all(int(batch.parents[b, node]) == prev for prev, node in zip(accepted, accepted[1:]))
    assert g["out"].shape == (g["B"], g["N"], 4, 64) and torch.isfinite(g["out"]).all()
