import json

import pytest
from hypothesis import given, settings

from bonsai_core.errors import GraphError
from bonsai_core.graph import Graph, load_graph, save_graph

from tests.graphs import chain
from tests.strategies import graphs


def test_derived_properties_of_a_chain():
    g = chain(3)
    assert g.n == 6 and g.num_edges == 2 + 3 + 2
    assert g.outputs.tolist() == [5]
    assert g.users(0).tolist() == [1, 5]
    assert g.is_forward.tolist() == [True] * 3 + [False] * 3
    # the largest step: b0 reads f0 and b1 -> three tensors of 10 bytes
    assert g.peak_lower_bound == 30


def test_json_round_trip_preserves_everything(tmp_path):
    g = chain(4, fixed_mem=7)
    path = tmp_path / "g.json"
    save_graph(g, path)
    h = load_graph(path)
    assert h.to_dict() == g.to_dict() and h.hash == g.hash


def _doc(**node_overrides):
    nodes = [{"id": 0, "name": "a", "op": "x", "phase": "forward", "cost": 1.0, "mem": 4, "deps": [], "alias_of": None},
             {"id": 1, "name": "b", "op": "x", "phase": "forward", "cost": 1.0, "mem": 4, "deps": [0], "alias_of": None}]
    nodes[1].update(node_overrides)
    return {"format": "bonsai-graph", "version": 1, "name": "t", "fixed_mem": 0, "nodes": nodes}


@pytest.mark.parametrize("override, words", [
    ({"deps": [1]}, "not an earlier node"),
    ({"deps": [5]}, "not an earlier node"),
    ({"deps": [-1]}, "'deps' holds -1; it must be a node id"),
    ({"deps": [0, 0]}, "'deps' lists the same id twice"),
    ({"mem": -3}, "mem"),
    ({"mem": "big"}, "'mem'"),
    ({"cost": float("nan")}, "'cost'"),
    ({"cost": 0}, "cost 0"),
    ({"alias_of": 0, "mem": 4}, "must be 0"),
    ({"alias_of": 0, "mem": 0, "deps": []}, "must be one of its deps"),
    ({"alias_of": 7}, "alias_of"),
    ({"id": 0}, "ids must be 0, 1, 2"),
    ({"phase": "sideways"}, "phase"),
    ({"held": [0], "deps": []}, "not in its 'deps'"),
    ({"held": 0}, "'held'"),
])
def test_each_defect_names_the_node_and_the_problem(override, words):
    with pytest.raises(GraphError, match=words) as info:
        Graph.from_dict(_doc(**override))
    assert "1" in str(info.value)


@pytest.mark.parametrize("field", ["id", "name", "phase", "cost", "mem", "deps"])
def test_a_node_missing_a_required_field_is_refused_naming_node_and_field(field):
    doc = _doc()
    del doc["nodes"][1][field]
    with pytest.raises(GraphError, match=rf"Node at position 1 .*has no '{field}'"):
        Graph.from_dict(doc)


def test_optional_fields_may_be_left_out():
    doc = _doc()
    for nd in doc["nodes"]:
        del nd["op"], nd["alias_of"]
    nd = doc["nodes"][1]
    nd["module"] = "model.h.0.attn"  # a field a later version adds is ignored, not refused
    g = Graph.from_dict(doc)
    assert g.ops == ("", "") and not g.is_view.any() and g.deps(1).tolist() == [0]


def test_what_the_code_holds_is_a_dep_for_memory_and_none_for_the_data_flow(tmp_path):
    doc = _doc()
    doc["nodes"].append({"id": 2, "name": "c", "op": "x", "phase": "forward", "cost": 1.0, "mem": 4, "deps": [0, 1],
                         "alias_of": None, "held": [0]})  # Python holds a until c ran; c reads only b
    g = Graph.from_dict(doc)
    assert g.deps(2).tolist() == [0, 1] and g.held[2] == (0,)
    save_graph(g, tmp_path / "g.json")
    assert load_graph(tmp_path / "g.json").hash == g.hash
    flow = g.without_held()
    assert flow.deps(2).tolist() == [1] and flow.users(0).tolist() == [1] and not any(flow.held)
    plain = chain(2)
    assert plain.without_held() is plain  # nothing held: the graph itself


def test_a_graph_without_fixed_mem_is_refused():
    doc = _doc()
    del doc["fixed_mem"]
    with pytest.raises(GraphError, match="no 'fixed_mem'"):
        Graph.from_dict(doc)


@pytest.mark.parametrize("content, words", [
    (b"", "empty"),
    (b"\x89PNG\r\n\x1a\n\x00\xff", "not text"),
    (b"{\"format\": ", "not valid JSON"),
    (b"[1, 2]", "one JSON object"),
    (json.dumps({"format": "bonsai-schedule"}).encode(), "not a bonsai-graph"),
    (json.dumps({"format": "bonsai-graph", "version": 9}).encode(), "version"),
    (json.dumps({"format": "bonsai-graph", "version": 1, "fixed_mem": 0, "nodes": []}).encode(), "non-empty"),
])
def test_broken_files_get_a_clear_error(tmp_path, content, words):
    path = tmp_path / "g.json"
    path.write_bytes(content)
    with pytest.raises(GraphError, match=words):
        load_graph(path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(GraphError, match="No such graph file"):
        load_graph(tmp_path / "nope.json")


def test_a_view_chain_ends_at_the_storage_and_the_backward_reads_are_known_once():
    """A view of a view keeps both bases (``view_chain``, what ``storage_of`` and ``with_view_bases`` read);
    ``read_by_backward`` marks what backward nodes read."""
    import numpy as np

    g = Graph.from_nodes("views", 0, [
        dict(name="a", op="x", cost=1, mem=8, deps=[]),
        dict(name="va", op="view", cost=0, mem=0, deps=[0], alias_of=0),
        dict(name="vva", op="view", cost=0, mem=0, deps=[1], alias_of=1),
        dict(name="b", op="x", cost=1, mem=4, deps=[2]),
        dict(name="gb", op="x", phase="backward", cost=1, mem=4, deps=[1, 3]),
    ])
    assert g.view_chain(2) == [2, 1, 0] and g.view_chain(3) == [3]
    assert g.storage_of(2) == 0 and g.storage_of(2, stop_before=np.array([True, False, False, False, False])) == 1
    assert g.with_view_bases({2, 3}) == {0, 1, 2, 3}
    assert g.read_by_backward.tolist() == [False, True, False, True, False]


def test_the_formats_schemas_are_the_ones_docs_design_shows_and_name_what_the_code_reads():
    """docs/DESIGN.md shows each file format's JSON Schema as shipped; the kinds of ops and the FSDP dtypes
    the schemas allow are the simulator's and fsdp.py's."""
    from pathlib import Path

    from bonsai_core.fsdp import DTYPE_BYTES
    from bonsai_core.schedule import KINDS
    from bonsai_core.schema import SCHEMAS, schema

    design = (Path(__file__).resolve().parent.parent / "docs" / "DESIGN.md").read_text()
    for fmt in ("graph", "schedule"):
        text = (SCHEMAS / f"{fmt}.schema.json").read_text()
        assert f"<summary>bonsai_core/schemas/{fmt}.schema.json</summary>\n\n```json\n{text}```" in design
    assert tuple(schema("schedule")["properties"]["ops"]["items"]["prefixItems"][0]["enum"]) == KINDS
    assert schema("graph")["properties"]["fsdp"]["properties"]["param_dtype"]["enum"] == list(DTYPE_BYTES)


def _largest_step_by_sets(g: Graph) -> int:
    """The per-op lower bound by its definition: each node's output and inputs with their views' bases, as a set."""
    best = 0
    for v in range(g.n):
        live = g.with_view_bases({v, *g.deps(v).tolist()})
        written = int(g.mem[g.inplace_of[v]]) if g.inplace_of[v] >= 0 else 0
        best = max(best, int(g.mem[list(live)].sum()) - written)
    return max(g.fixed_mem + best, g.optimizer_peak)


@settings(max_examples=150, deadline=None)
@given(graphs(max_nodes=20))
def test_peak_lower_bound_is_the_largest_step_by_its_definition(g):
    assert g.peak_lower_bound == _largest_step_by_sets(g)


def test_peak_lower_bound_counts_a_shared_base_once_and_an_inplace_write_once():
    nodes = [dict(name="a", op="x", phase="forward", cost=1.0, mem=8, deps=[]),
             dict(name="va", op="aten.view.default", phase="forward", cost=0.0, mem=0, deps=[0], alias_of=0),
             dict(name="vva", op="aten.view.default", phase="forward", cost=0.0, mem=0, deps=[1], alias_of=1),
             dict(name="b", op="x", phase="forward", cost=1.0, mem=8, deps=[0, 2], inplace_of=0),
             dict(name="c", op="x", phase="forward", cost=1.0, mem=3, deps=[3])]
    g = Graph.from_nodes("views", 5, nodes)
    # b reads a and a view of a view of a (a's 8 bytes once) and writes a in place: 8 + 8 - 8; c: 8 + 3
    assert g.peak_lower_bound == 5 + 11 == _largest_step_by_sets(g)


def _same_graph(a: Graph, b: Graph) -> None:
    assert a.to_dict() == b.to_dict() and a.hash == b.hash and a.peak_lower_bound == b.peak_lower_bound
    for field in ("cost", "mem", "alias_of", "inplace_of", "dep_ptr", "dep_idx", "user_ptr", "user_idx", "is_output",
                  "is_forward", "is_view", "output_of"):
        assert (getattr(a, field) == getattr(b, field)).all(), field
    assert (a.fixed_tensors, a.modules, a.optimizer, a.fsdp, a.parallel, a.grads_set_to_none, a.total_cost,
            a.activation_bytes) == (b.fixed_tensors, b.modules, b.optimizer, b.fsdp, b.parallel, b.grads_set_to_none,
                                    b.total_cost, b.activation_bytes)


def test_with_fields_is_the_graph_rebuilt_from_the_edited_document():
    g = chain(4, fixed_mem=7)
    _ = g.hash, g.peak_lower_bound  # cached on g: the new graph computes its own
    edits = {"name": "renamed", "fixed_mem": 1007, "fixed_tensors": [["w", 1000, "param"], ["x", 7, "input"]],
             "modules": [["layers.0", 0, 1]], "optimizer": {"name": "adamw", "step_bytes": 500},
             "grads": {"set_to_none": True, "bytes": 3}, "parallel": {"layout": {"fsdp": 1, "tp": 2}}}
    new = g.with_fields(**edits)
    _same_graph(new, Graph.rebuilt({**g.to_dict(), **edits}))
    assert new.peak_lower_bound == 1007 + 500 + 3 and g.peak_lower_bound == 7 + 30
    _same_graph(new.with_fields(optimizer=None, grads=None), Graph.rebuilt({**g.to_dict(), **{
        k: v for k, v in edits.items() if k not in ("optimizer", "grads")}}))


def test_with_fields_checks_the_fields_as_the_document_does():
    g = chain(3, fixed_mem=7)
    with pytest.raises(GraphError, match="add up to"):
        g.with_fields(fixed_tensors=[["w", 3, "param"]])
    with pytest.raises(GraphError, match="'modules' entry"):
        g.with_fields(modules=[["m", 0, 5]])
    with pytest.raises(ValueError, match="not nodes"):
        g.with_fields(nodes=[])
