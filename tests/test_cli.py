import json
import subprocess
import sys

import pytest

from bonsai_core.cli import main
from bonsai_core.graph import load_graph
from bonsai_core.schedule import load_schedule, simulate


@pytest.fixture(scope="module")
def gpt_graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "g.json"
    assert main(["trace", "gpt", "--layers", "2", "-o", str(path)]) == 0
    return path


def test_trace_solve_simulate_agree(gpt_graph, tmp_path, capsys):
    load_graph(gpt_graph)  # validates
    out = tmp_path / "s.json"
    assert main(["solve", str(gpt_graph), "--budget", "100%", "--method", "none", "-o", str(out), "--json"]) == 0
    solved = json.loads(capsys.readouterr().out)
    assert main(["simulate", str(gpt_graph), str(out), "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    for key in ("peak", "compute_cost", "overhead"):
        assert solved[key] == simulated[key]
    assert simulated["feasible"] is True
    sim = simulate(load_graph(gpt_graph), load_schedule(out))
    assert sim.peak == solved["peak"]


def test_zoo_lists_models_and_options(capsys):
    assert main(["zoo", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert {"mlp", "vgg", "resnet", "unet", "gpt"} <= set(listing)
    assert listing["gpt"]["options"]["layers"] == 2


def test_user_errors_exit_1_with_one_message(gpt_graph, tmp_path, capsys):
    assert main(["solve", str(gpt_graph), "--budget", "10%", "-o", str(tmp_path / "s.json")]) == 1
    err = capsys.readouterr().err
    assert "Raise the budget" in err and "Traceback" not in err
    assert main(["trace", "nosuch", "-o", str(tmp_path / "x.json")]) == 1
    assert "Unknown model" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["simulate", str(bad), str(bad)]) == 1
    assert "not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("budget", ["abc", "-1", "0", "0%", "1e400", "12 GB GB"])
def test_nonsense_budget_exits_2(gpt_graph, tmp_path, budget, capsys):
    with pytest.raises(SystemExit) as info:
        main(["solve", str(gpt_graph), "--budget", budget, "-o", str(tmp_path / "s.json")])
    assert info.value.code == 2
    assert "budget" in capsys.readouterr().err


def test_installed_command_prints_no_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe\x00binary")
    proc = subprocess.run([sys.executable, "-m", "bonsai_core.cli", "simulate", str(bad), str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "not text" in proc.stderr
