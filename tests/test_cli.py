import json
import re
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


def test_solve_defaults_to_bonsai_like_the_app(gpt_graph, tmp_path, capsys):
    assert main(["solve", str(gpt_graph), "--budget", "70%", "-o", str(tmp_path / "s.json"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["method"] == "bonsai" and stats["peak"] <= stats["budget"] < stats["no_remat_peak"]


def test_a_method_option_reaches_the_method_typed(tmp_path, capsys):
    from bonsai_core.graph import save_graph
    from tests.graphs import chain

    save_graph(chain(4), tmp_path / "g.json")
    args = ["solve", str(tmp_path / "g.json"), "--budget", "30", "--method", "moccasin", "-o", str(tmp_path / "s.json")]
    assert main(args) == 1  # two computations per node cannot fit 30 bytes (test_moccasin)
    assert "copies" in capsys.readouterr().err
    assert main(args + ["--option", "copies=3", "--option", "num_workers=1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["copies"] == 3


@pytest.mark.parametrize("option, words", [
    ("copise=3", r"no option 'copise'; its options are: time_limit \(default None\), copies \(default 2\)"),
    ("copies=three", "copies='three' of method 'moccasin': expected int"),
    ("copies", "not name=value"),
])
def test_a_wrong_option_exits_1_naming_what_the_method_takes(gpt_graph, tmp_path, capsys, option, words):
    assert main(["solve", str(gpt_graph), "--budget", "70%", "--method", "moccasin", "--option", option,
                 "-o", str(tmp_path / "s.json")]) == 1
    err = capsys.readouterr().err
    assert re.search(words, err) and "Traceback" not in err


def test_the_library_refuses_an_undeclared_option():
    from bonsai_core.errors import SolverError
    from bonsai_core.solvers import solve
    from tests.graphs import chain

    with pytest.raises(SolverError, match=r"'checkmate' has no option 'time_limt'.*time_limit \(default None\)"):
        solve(chain(2), None, "checkmate", time_limt=5)


def test_methods_lists_each_methods_options(capsys):
    assert main(["methods", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert set(listing) == {"none", "bonsai", "chen", "dtr", "coop", "checkmate", "moccasin"}
    copies = {o["name"]: o for o in listing["moccasin"]["options"]}["copies"]
    assert copies["default"] == 2 and copies["type"] == "int" and "per node" in copies["help"]


def test_bench_with_an_unknown_method_is_an_argument_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--methods", "foo", "-o", str(tmp_path / "b")])
    assert info.value.code == 2 and "unknown method 'foo'" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and re.fullmatch(r"bonsai \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)
