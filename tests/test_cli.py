import json
import re
import subprocess
import sys

import pytest

from bonsai_core.cli import main
from bonsai_core.graph import load_graph
from bonsai_core.schedule import load_schedule, none_schedule, simulate


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
    # the allocator's replay adds its own numbers and leaves the simulator's peak alone
    assert main(["simulate", str(gpt_graph), str(out), "--allocator", "--json"]) == 0
    with_allocator = json.loads(capsys.readouterr().out)
    assert with_allocator["peak"] == solved["peak"]
    assert with_allocator["allocator_live_peak"] > 0 and with_allocator["reserved_peak"] >= with_allocator["allocator_live_peak"]
    sim = simulate(load_graph(gpt_graph), load_schedule(out))
    assert sim.peak == solved["peak"]


def test_a_plan_solved_for_reserved_bytes_simulates_to_the_reserved_peak_it_was_solved_to(gpt_graph, tmp_path, capsys):
    """One meaning of a plan's reserved peak: `bonsai simulate --allocator` replays a plan solved with
    --reserved as its budget bounded it, so both commands name the same bytes."""
    out = tmp_path / "s.json"
    assert main(["solve", str(gpt_graph), "--budget", "100%", "--method", "chen", "--reserved", "-o", str(out),
                 "--json"]) == 0
    solved = json.loads(capsys.readouterr().out)
    assert main(["simulate", str(gpt_graph), str(out), "--allocator", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["reserved_peak"] == solved["reserved_peak"] and simulated["allocator"] == "caching"


def test_trace_records_the_kernels_of_the_device_it_names(tmp_path):
    """`bonsai trace --kernels`: GPT-2's dropout as CUDA runs it by default (a bool mask), as the CPU runs it
    (float noise from bernoulli) with ``--kernels cpu``."""
    def dropout_ops(*kernels: str) -> set[str]:
        path = tmp_path / f"g{''.join(kernels)}.json"
        assert main(["trace", "hf:gpt2", "--layers", "1", *kernels, "-o", str(path)]) == 0
        return {op for op in load_graph(path).ops if "dropout" in op or "bernoulli" in op}

    assert dropout_ops() == {"aten.native_dropout.default", "aten.native_dropout_backward.default"}
    on_cpu = dropout_ops("--kernels", "cpu")
    assert "aten.bernoulli.p" in on_cpu and "aten.native_dropout.default" not in on_cpu


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


@pytest.mark.parametrize("budget", ["abc", "-1", "-5%", "0", "0%", "1e400", "12 GB GB"])
def test_nonsense_budget_exits_2(gpt_graph, tmp_path, budget, capsys):
    with pytest.raises(SystemExit) as info:
        main(["solve", str(gpt_graph), "--budget", budget, "-o", str(tmp_path / "s.json")])
    assert info.value.code == 2
    assert f"budget '{budget}'" in capsys.readouterr().err  # the value named, not "expected one argument"


def test_bench_budgets_are_percentages(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--budgets", "0.8", "--models", "mlp", "--methods", "none", "--peers", "-o", str(tmp_path)])
    assert info.value.code == 2 and "'0.8' reads as 0.8%" in capsys.readouterr().err


def test_solve_stops_at_a_default_time_limit_that_0_removes(gpt_graph, tmp_path, monkeypatch):
    """An exact method on a large graph must not run for hours unseen: `bonsai solve` gives every
    method SOLVE_TIME_LIMIT seconds unless told otherwise; 0 means no limit, as in the app."""
    import bonsai_core.solvers as solvers
    from bonsai_core.arguments import SOLVE_TIME_LIMIT

    asked = []
    real = solvers.solve
    monkeypatch.setattr(solvers, "solve", lambda g, b, method, **options: asked.append(options) or real(g, b, method, **options))
    for argv in ([], ["--time-limit", "0"], ["--time-limit", "7.5"], ["--option", "time_limit=3"]):
        assert main(["solve", str(gpt_graph), "--budget", "70%", *argv, "-o", str(tmp_path / "s.json"), "--json"]) == 0
    assert [o["time_limit"] for o in asked] == [SOLVE_TIME_LIMIT, None, 7.5, 3.0]


def test_simulate_fails_a_schedule_over_its_own_budget(gpt_graph, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["solve", str(gpt_graph), "--budget", "70%", "-o", str(out)]) == 0
    schedule = json.loads(out.read_text())
    schedule["budget"] //= 2
    over = tmp_path / "over.json"
    over.write_text(json.dumps(schedule))
    capsys.readouterr()
    assert main(["simulate", str(gpt_graph), str(over), "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["feasible"] is False and "exceeds its budget" in captured.err


def test_solve_prints_no_solver_banner(gpt_graph, tmp_path):
    """HiGHS announces itself when a process makes its first solver object: not on a user's terminal,
    and never inside --json output."""
    proc = subprocess.run([sys.executable, "-m", "bonsai_core.cli", "solve", str(gpt_graph), "--budget", "70%",
                           "-o", str(tmp_path / "s.json"), "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["method"] == "bonsai"
    assert "HiGHS" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


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
    assert set(listing) == {"none", "bonsai", "chen", "dtr", "coop", "checkmate", "moccasin", "torchtitan-full",
                            "torchtitan-selective"}
    assert listing["torchtitan-selective"]["options"][1]["name"] == "release"
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


def test_the_wheel_lists_every_package_of_the_library_and_the_explorer():
    """pyproject names its packages one by one (the explorer's folders are mapped under
    bonsai_explorer/): a new bonsai_core subpackage must be added there too, or the wheel lacks it."""
    import tomllib
    from pathlib import Path

    from setuptools import find_packages

    root = Path(__file__).resolve().parent.parent
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(find_packages(str(root), include=["bonsai_core*"])) <= set(tool["packages"])
    for package, folder in tool["package-dir"].items():
        assert package in tool["packages"] and (root / folder).is_dir()
    assert (root / tool["package-dir"]["bonsai_explorer.explorer"] / "app.py").is_file()


def test_app_passes_the_streamlit_config_as_flags(capsys):
    assert main(["app", "--print-command", "--server.port", "8599"]) == 0
    command = capsys.readouterr().out.split()
    assert "--browser.gatherUsageStats=false" in command
    app = next(i for i, word in enumerate(command) if word.endswith("explorer/app.py"))
    assert command.index("--browser.gatherUsageStats=false") < app and command[app + 1:] == ["--server.port", "8599"]


@pytest.mark.slow
def test_app_runs_from_an_installed_wheel(tmp_path):
    """Build the wheel, install it into a bare folder, and start the explorer's entry script from there."""
    from pathlib import Path

    import shutil

    source = tmp_path / "src"  # a copy: building in place would leave build/ and *.egg-info in the checkout
    shutil.copytree(Path(__file__).resolve().parent.parent, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache", "docs", "tests"))
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, cwd=tmp_path, timeout=300)
    wheel = next((tmp_path / "dist").glob("*.whl"))
    subprocess.run(pip + ["install", "--no-deps", "-q", "--target", str(tmp_path / "site"), str(wheel)], check=True,
                   timeout=300)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path / "site")}
    shown = subprocess.run([sys.executable, "-m", "bonsai_core.cli", "app", "--print-command"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    app = tmp_path / "site" / "bonsai_explorer" / "explorer" / "app.py"
    assert shown.returncode == 0 and str(app) in shown.stdout.split() and "--client.toolbarMode=minimal" in shown.stdout
    check = ("from streamlit.testing.v1 import AppTest\n"
             f"at = AppTest.from_file({str(app)!r}, default_timeout=120).run()\n"
             "assert not at.exception, [e.value for e in at.exception]\n"
             "assert any('no-remat peak' in m.value for m in at.markdown)\n")
    ran = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]


@pytest.mark.parametrize("method", ["none", "bonsai", "chen", "dtr", "coop", "checkmate", "moccasin"])
def test_every_declared_option_has_a_default_and_a_help_line(method):
    """The contract of solvers/__init__.py: keyword-only options, each with a default and a
    docstring line ``name: what it does`` (a method still on ``**kwargs`` declares none yet)."""
    import inspect

    from bonsai_core.solvers import method_options

    for option in method_options(method) or ():
        assert option.default is not inspect.Parameter.empty, f"{method}: option {option.name} has no default"
        assert option.help, f"{method}: option {option.name} has no 'name: help' line in its docstring"


def test_errors_in_user_input_name_the_cause_without_a_traceback(gpt_graph, tmp_path, capsys):
    """A factory's own exception (file and line named), a device verify cannot measure on, a budget in
    bytes that was meant as a share."""
    from bonsai_core.errors import ModelError
    from bonsai_core.export.verify import measuring_device

    assert main(["trace", "tests.user_model:make_raising", "-o", str(tmp_path / "g.json")]) == 1
    err = capsys.readouterr().err
    assert "user_model.py:" in err and "ValueError: no layer of width 16" in err and "Traceback" not in err, err
    for device in ("tpu", "mps", ""):
        with pytest.raises(ModelError, match="cpu or cuda"):
            measuring_device(device)
    assert measuring_device("cpu").type == "cpu"
    assert main(["solve", str(gpt_graph), "--budget", "70", "-o", str(tmp_path / "s.json")]) == 1
    assert "write 70%" in capsys.readouterr().err
    # an option given twice, differently; option values no method can use
    for argv, said in ((["--granularity", "5", "--option", "granularity=10"], "disagree"),
                       (["--method", "chen", "--option", "segments=0"], "segments=0"),
                       (["--method", "checkmate", "--option", "max_nodes=-1"], "max_nodes=-1")):
        assert main(["solve", str(gpt_graph), "--budget", "70%", *argv, "-o", str(tmp_path / "s.json")]) == 1
        assert said in capsys.readouterr().err


def test_a_budget_bonsai_misses_names_the_method_that_meets_it(tmp_path, capsys):
    """A small U-Net: bonsai's checkpoint regions reach 99.3% of the no-remat peak at best; halfway
    between the per-op bound and the peak, moccasin meets the budget by recomputing a backward op, and
    so does bonsai's default (its op-level plan), which prints the lower bound."""
    graph = tmp_path / "unet.json"
    assert main(["trace", "unet", "--batch", "1", "--image", "4", "--layers", "1", "--width", "16", "-o", str(graph)]) == 0
    g = load_graph(graph)
    half = (g.peak_lower_bound + simulate(g, none_schedule(g)).peak) // 2
    capsys.readouterr()
    regions = ["--option", "space=regions"]
    assert main(["solve", str(graph), "--budget", str(half), *regions, "-o", str(tmp_path / "s.json")]) == 1
    err = capsys.readouterr().err
    assert "smallest budget it can guarantee" in err and "moccasin meets this budget" in err, err
    assert "--method moccasin" in err and "Traceback" not in err
    assert main(["solve", str(graph), "--budget", str(half), "--method", "moccasin", "-o", str(tmp_path / "s.json")]) == 0
    capsys.readouterr()
    assert main(["solve", str(graph), "--budget", str(half), "-o", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "lower bound: no schedule within the budget computes less than" in out and "(ops plan" in out
