"""Mutated graph and schedule files fed to the loaders and the CLI: every outcome is a result or a
typed, explained error — never a traceback."""

import copy
import json
import random

import pytest

from bonsai_core.cli import main
from bonsai_core.errors import BonsaiError
from bonsai_core.graph import Graph, parse_json_bytes
from bonsai_core.schedule import Schedule, none_schedule, simulate
from tests.graphs import chain

WEIRD = [None, True, -1, 0, 1, 2**70, -2**70, 1e400, float("nan"), "x", "", [], {}, [1, [2]], 0.5, 10**6]


def _mutate_doc(doc, rng: random.Random):
    """Replace, drop or add one field somewhere in a JSON document."""
    doc = copy.deepcopy(doc)
    containers = [doc]
    target = doc
    while True:
        kids = list(target.items()) if isinstance(target, dict) else list(enumerate(target))
        kids = [(k, v) for k, v in kids if isinstance(v, (dict, list)) and v]
        if not kids or rng.random() < 0.35:
            break
        _, target = rng.choice(kids)
        containers.append(target)
    keys = list(target.keys()) if isinstance(target, dict) else list(range(len(target)))
    if not keys:
        return doc
    key = rng.choice(keys)
    action = rng.random()
    if action < 0.6:
        target[key] = rng.choice(WEIRD)
    elif action < 0.8:
        del target[key]
    elif isinstance(target, list):
        target.append(copy.deepcopy(target[key]))
    else:
        target["extra_" + str(key)] = rng.choice(WEIRD)
    return doc


def _mutate_bytes(raw: bytes, rng: random.Random) -> bytes:
    raw = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        i = rng.randrange(len(raw))
        if choice < 0.4:
            raw[i] = rng.randrange(256)
        elif choice < 0.7:
            del raw[i:i + rng.randint(1, 20)]
        else:
            raw = raw[:i]
        if not raw:
            break
    return bytes(raw)


def _fuzz(rounds: int, tmp_path, seed: int = 0):
    rng = random.Random(seed)
    g = chain(4, fixed_mem=8)
    s = none_schedule(g)
    gdoc, sdoc = g.to_dict(), s.to_dict()
    gpath, spath = tmp_path / "g.json", tmp_path / "s.json"
    outcomes = {"ok": 0, "error": 0}
    for i in range(rounds):
        if i % 2:
            graw = json.dumps(_mutate_doc(gdoc, rng)).encode() if rng.random() < 0.7 else \
                _mutate_bytes(json.dumps(gdoc).encode(), rng)
            sraw = json.dumps(sdoc).encode()
        else:
            graw = json.dumps(gdoc).encode()
            sraw = json.dumps(_mutate_doc(sdoc, rng)).encode() if rng.random() < 0.7 else \
                _mutate_bytes(json.dumps(sdoc).encode(), rng)
        try:  # the Python API raises only typed errors
            graph = Graph.from_dict(parse_json_bytes(graw, "graph"))
            simulate(graph, Schedule.from_dict(parse_json_bytes(sraw, "schedule")))
            outcomes["ok"] += 1
        except BonsaiError:
            outcomes["error"] += 1
        gpath.write_bytes(graw)
        spath.write_bytes(sraw)
        assert main(["simulate", str(gpath), str(spath), "--json"]) in (0, 1)
    return outcomes


def test_mutated_files_never_crash(tmp_path, capsys):
    outcomes = _fuzz(150, tmp_path)
    assert outcomes["error"] > 0 and outcomes["ok"] > 0


@pytest.mark.slow
def test_a_thousand_mutated_files_never_crash(tmp_path, capsys):
    outcomes = _fuzz(1200, tmp_path, seed=1)
    assert sum(outcomes.values()) == 1200
