"""``tests/fuzz/lossless_fuzz.py`` keeps working: a short run logs every case and exits 0 when every output equals
HF greedy, and a logged case is drawn again, the same, from its seed."""

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

TOOL = Path(__file__).resolve().parents[1] / "fuzz" / "lossless_fuzz.py"


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("lossless_fuzz", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_short_run_logs_each_case_and_a_seed_replays_its_case(fuzz, tmp_path, capsys):
    log = tmp_path / "fuzz.jsonl"
    assert fuzz.main(["--seconds", "120", "--cases", "1", "--seed", "5", "--log", str(log)]) == 0
    cases = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["seed"] for c in cases] == [5]
    assert cases[0]["status"] == "ok" and cases[0]["requests"]
    assert all(q["status"] == "ok" for q in cases[0]["requests"])
    assert "1 cases" in capsys.readouterr().out
    assert json.loads(json.dumps(fuzz.run_case(5))) == cases[0]


def test_bad_arguments_are_refused(fuzz):
    with pytest.raises(SystemExit):
        fuzz.main(["--seconds", "0"])
