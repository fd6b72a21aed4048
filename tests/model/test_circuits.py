"""Circuits found by attribution and judged by exact patching (attnprobe edit --circuits,
analyses.circuits): every part patched is x', none is x; a planted circuit through an MLP is found
at its size, faithful and complete, and a smaller one is not; selection on the judged items
inflates the in-sample figure, which the held-out one does not share."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from attnprobe.analyses.circuits.edges import EdgeGraph
from attnprobe.analyses.circuits.graph import Graph, part_scores, size_ranks, top_parts
from attnprobe.analyses.circuits.runs import Masks, Patching, part_runs
from attnprobe.analyses.circuits.search import measure_run_circuits
from attnprobe.analyses.circuits.tables import agreement_table, circuits_table, parts_table
from attnprobe.analyses.senders import pair_frame, reference_pairs
from attnprobe.intervene.engine import record
from attnprobe.intervene.selection import folds, opposite
from tests.planted import planted_items, planted_mlp_model, planted_noisy_movers


def _inputs(model, items):
    """What measure_run_circuits reads of the edits' inputs (edits.inputs.Inputs)."""
    labels = torch.tensor([[list(i.positive), list(i.negative)] for i in items])
    of = folds(items)
    fold = np.array([of[i.item_id] for i in items])
    n_templates = len({i.template_id for i in items})
    return SimpleNamespace(
        items=items,
        bank=record(model, [i.x for i in items]),
        reference=record(model, [i.counterfactuals[0].x_cf for i in items]),
        labels=labels,
        fold=fold,
        training=lambda f: np.array([opposite(f, n_templates)]),
    )


def _tables(model, items):
    raw = measure_run_circuits(model, _inputs(model, items), "person")
    runs, attribution = (
        raw[raw["table"] == t].dropna(axis=1, how="all") for t in ("circuit_runs", "circuit_attribution")
    )
    return circuits_table(runs), parts_table(attribution), agreement_table(runs, parts_table(attribution))


def test_every_part_patched_gives_x_prime_and_none_gives_x_also_for_words_of_other_length():
    """The residual stream is the sum of the parts' outputs: from the occupation's last token on, x
    with every part's output from x' is x' there, whatever x' holds before (tests/test_paths items:
    every other x' has a slot of two tokens)."""
    from tests.model.test_paths import _items, _llama

    model, items = _llama(kv=2), _items()
    inputs = _inputs(model, items)
    pairs = reference_pairs(items, "person")
    base = pair_frame(items, inputs.bank, inputs.reference, pairs, inputs.labels)
    graph = Graph(3, 4, True)
    masks = Masks()
    plan = [
        (i, "", "", 0, masks.add(np.full(graph.size, every)))
        for every in (True, False)
        for i in range(len(pairs))
    ]
    y = part_runs(Patching(model, inputs.bank, inputs.reference, pairs, inputs.labels, graph), plan, masks)
    assert any(not p.same_length for p in pairs)
    np.testing.assert_allclose(y[: len(pairs)], base["y_cf"], atol=1e-5)
    np.testing.assert_allclose(y[len(pairs) :], base["y"], atol=1e-6)
    assert np.abs(base["y"] - base["y_cf"]).max() > 1e-2  # the two ends differ: the check can fail


def test_a_planted_circuit_through_an_mlp_is_found_at_its_size_faithful_and_complete():
    """tests/planted.planted_mlp_model: the attribution ranks MLP0 and the two movers first (the
    distractors read the same positions but nothing reads what they write); the circuit of those
    three parts restores all of the gradient on held-out items, none is left once it is knocked out,
    a circuit one part short is not faithful, random circuits of three parts fall short, and the
    attribution orders the parts as exact patching does."""
    circuits, parts, agreement = _tables(planted_mlp_model(), planted_items())
    for reference in ("person", "another occupation"):
        ranked = parts[(parts["reference"] == reference) & (parts["rank"] <= 3)]
        assert set(ranked["part"]) == {"MLP0", "L1H0", "L1H3"}
        distractors = parts[(parts["reference"] == reference) & parts["part"].isin(["MLP1", "L1H1"])]
        assert distractors["eap_ig_share"].abs().max() < 0.01  # through the final norm's scale only
        own = circuits[circuits["reference"] == reference]
        table = own[own["circuit"] == "top n by EAP-IG"].set_index("size")
        assert (
            table.loc[3, "held_out"] == pytest.approx(1.0, abs=0.01) and table.loc[3, "met"]
        )  # the norm: 0.4%
        assert table.loc[3, "left_after_knockout"] == pytest.approx(0.0, abs=0.01)
        assert not table.loc[[1, 2], "met"].any() and table.loc[2, "held_out"] < 0.7  # a mover: half
        # completeness over subsets: without one mover the 2-part circuit keeps nothing, the model half
        assert table.loc[2, "worst_subset_difference"] == pytest.approx(-0.5, abs=0.02)
        assert abs(table.loc[3, "worst_subset_difference"]) < 0.01
        assert table.loc[3, "greedy_searched"] and not table.loc[2, "greedy_searched"]  # only where met
        assert table.loc[2, "random_high"] < 0.8  # two parts of the right three by chance: not all
        smallest = table.index[table["met"]].min()
        assert smallest == 3
        area, chance = table["area_held_out"].iloc[0], table["area_random"].iloc[0]
        # the curve: 0 up to a tenth of the parts, half at two tenths, 1 from three tenths on
        assert area == pytest.approx(0.8, abs=0.01) and chance < 0.7
        assert agreement.loc[agreement["reference"] == reference, "eap_ig_spearman"].iloc[0] > 0.8


def test_a_circuit_takes_its_parts_in_the_order_the_parts_table_ranks_them():
    # parts 2 and 3 are one value computed two ways (last bits apart): tied, in index order, in both the
    # circuit chosen and the ranks printed; part 1's smaller value and part 4's NaN come after
    shares = np.array([0.0, 0.25, 0.5 + 1e-15, 0.5, np.nan])
    ranks = size_ranks(shares[1:])
    np.testing.assert_array_equal(ranks, [3, 1, 2, np.nan])
    np.testing.assert_array_equal(top_parts(shares, 1), [True, False, True, False, False])
    np.testing.assert_array_equal(top_parts(shares, 2), [True, False, True, True, False])
    # part 2 now a last bit below part 3: the exact order would take part 3; the tie keeps part 2 first
    shares[2] = 0.5 - 1e-15
    np.testing.assert_array_equal(top_parts(shares, 1), [True, False, True, False, False])
    np.testing.assert_array_equal(size_ranks(shares[1:]), [3, 1, 2, np.nan])


def test_check_counts_the_runs_the_circuit_search_plans():
    """`attnprobe check`'s circuit estimate counts runs as plan_runs makes them (parts: exactly, for
    any pairs and folds); on the gender suite it names both grains with their units and a time."""
    from click.testing import CliRunner

    from attnprobe.analyses.circuits.runs import plan_runs
    from attnprobe.analyses.circuits.search import planned_runs
    from attnprobe.cli import main

    graph, rng = Graph(3, 4, True), np.random.default_rng(0)
    fold = rng.integers(0, 4, 37)
    scores = {k: rng.normal(size=graph.size) for k in ("all", 0, 1, 2, 3)}
    hypothesis = {"h": {k: graph.of_heads([(0, 1), (2, 3)]) for k in ("all", 0, 1, 2, 3)}}
    assert len(plan_runs(graph, scores, fold, hypothesis).runs) == planned_runs(graph, 37)
    result = CliRunner().invoke(main, ["check", "probes/gender.yaml"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("edit --circuits")]
    assert (
        "301 parts" in lines[0] and "211,351 edges" in lines[1] and all(" min on 2 CPU" in x for x in lines)
    )


def test_the_report_draws_the_smallest_circuit_meeting_the_target(tmp_path):
    """write_circuits' tables of the planted MLP model, read back as the report reads them: each
    comparison's drawn circuit is the smallest meeting the target (MLP0 and the two movers), and the
    graph is a figure of one panel per comparison; `edit` saves that circuit as a knockout of those
    parts, one file per comparison, after removing a circuit an earlier search saved."""
    from attnprobe.analyses.circuits.tables import write_circuits
    from attnprobe.plotting import plots
    from attnprobe.report.edit_sweep import _drawn_circuits

    model, items = planted_mlp_model(), planted_items()
    lines = write_circuits(tmp_path, measure_run_circuits(model, _inputs(model, items), "person"))
    assert all(
        "the smallest meeting the target has 3 of" in line and "greedy searched" in line for line in lines
    )
    chosen = _drawn_circuits(tmp_path, pd.read_csv(tmp_path / "circuits.csv"))
    assert [reference for reference, _, _ in chosen] == ["person", "another occupation"]
    for _, title, rows in chosen:
        assert title.startswith("the smallest meeting the target\n3 parts")
        assert set(rows["part"]) == {"MLP0", "L1H0", "L1H3"}
    assert len(plots.circuit_graph(chosen).axes) == 2
    # saved as an edit: the planted circuit knocked out by its parts' means over the reference prompts
    from attnprobe.edits import load_edit
    from attnprobe.edits.sweep.fitted import save_circuits
    from attnprobe.edits.sweep.options import EditOptions
    from attnprobe.model import from_pretrained_objects

    manifest = SimpleNamespace(
        model=SimpleNamespace(n_layers=2, n_heads=4),
        fingerprint="",
        suite=SimpleNamespace(path="", sha256=""),
    )
    sweep = SimpleNamespace(
        directory=tmp_path,
        manifest=manifest,
        model=from_pretrained_objects(model, None, "planted"),
        inputs=_inputs(model, items),
        weights="planted",
        options=EditOptions(),
    )
    stale = tmp_path / "edits" / "circuit-stale.json"  # an earlier search's: removed before saving
    stale.parent.mkdir()
    stale.write_text("{}")
    assert save_circuits(sweep, {}) == 2 and not stale.exists()
    knockout = load_edit(tmp_path / "edits" / "circuit-person.json").edit
    assert knockout.sites() == "L1H0 L1H3, MLP0"


def test_the_greedy_subset_is_the_worst_of_the_circuit_less_k_and_found_on_other_pairs():
    """An incomplete hypothesis on the planted MLP model: C = the embeddings, the mover L1H0 and the
    distractor L1H1 (MLP0 and the other mover outside). Without the distractor C keeps nothing while
    the model keeps everything (a gap of the whole gradient); without L1H0, C keeps nothing and the
    model half; without both, the same half. The greedy search, choosing on the other folds' pairs,
    takes the distractor first and keeps that K (the largest gap on its path), which exact patching
    of every subset confirms is the worst."""
    from attnprobe.analyses.circuits.search import _Search, grow

    model, items = planted_mlp_model(), planted_items()
    inputs = _inputs(model, items)
    pairs = reference_pairs(items, "person")
    base = pair_frame(items, inputs.bank, inputs.reference, pairs, inputs.labels)
    graph = Graph(2, 4, True)
    patching = Patching(model, inputs.bank, inputs.reference, pairs, inputs.labels, graph)
    circuit = graph.of_heads([(1, 0), (1, 1)])
    fold = np.array([inputs.fold[p.item] for p in pairs])
    choosing = np.flatnonzero(fold != 0)[::3]
    search = _Search("hypothesis", 2, 0, circuit, graph.groups(circuit), choosing)
    masks, covariate = Masks(), base["covariate"].to_numpy(dtype=float)
    grow(patching, [search], masks, covariate, lambda m: None)
    names = graph.names()
    assert [names[search.groups[g][0]] for g in search.k] == ["L1H1"]
    judged = np.flatnonzero(fold == 0)
    te = part_scores((base["y"] - base["y_cf"]).to_numpy()[judged, None], covariate[judged])[0]
    gaps = {}
    for k in ([0], [1], [0, 1]):  # every subset of the two heads, exactly, on the judged fold
        y = part_runs(patching, search.runs(masks, k, judged), masks).reshape(-1, 2)
        gaps[tuple(names[search.groups[g][0]] for g in k)] = (
            part_scores((y[:, :1] - y[:, 1:]), covariate[judged])[0] / te
        )
    assert max(gaps, key=lambda k: abs(gaps[k])) == ("L1H1",)
    assert gaps[("L1H1",)] == pytest.approx(-1.0, abs=0.02) and gaps[("L1H0",)] == pytest.approx(
        -0.5, abs=0.02
    )


def test_the_held_out_figure_falls_below_the_in_sample_one_where_selection_inflates_it():
    """tests/planted.planted_noisy_movers: eight movers carry the gradient alike in expectation, each
    with noise of its own per occupation. Chosen on every item, the top movers are those whose noise
    happened to follow the covariate on the judged occupations: in-sample they carry more than their
    eighth; chosen on the opposite quarter they do not (the held-out figure is lower at every small
    size, in both comparisons). The same split judged in-sample would show no gap: the check can fail."""
    circuits, _, _ = _tables(planted_noisy_movers(0), planted_items())
    small = circuits[circuits["size"].between(1, 3)]
    gap = small["in_sample"] - small["held_out"]
    assert len(small) == 6 and (gap > 0).all() and gap.mean() > 0.05, small
    one = small[small["size"] == 1]
    assert (one["held_out"] < 0.2).all() and (one["in_sample"] > 0.18).all()  # an eighth is 0.125


PLANTED_EDGES = {
    "embedding -> MLP0 @ occupation",
    "MLP0 -> L1H0.v @ occupation",
    "MLP0 -> L1H3.v @ occupation",
    "L1H0 -> logits @ last",
    "L1H3 -> logits @ last",
}


def test_a_planted_circuit_is_found_at_the_grain_of_edges_with_its_five_edges():
    """tests/planted.planted_mlp_model at the grain of edges (--circuit-grain edges): the circuit is
    five edges (the embeddings into MLP0's input at the occupation, MLP0 into each mover's value there,
    each mover into the logits at the last token). EAP-IG ranks them first; the top 5 keep all five
    after pruning and restore all of the gradient held out with none left after knockout; the top 3
    (no edge into the logits) are pruned to nothing; single edges patched alone agree with their
    attribution; the top 5 heads' hypothesis at this grain is judged beside it, and a hypothesis of
    one comparison's own in that comparison alone. The greedy worst subset (by sending part) of the
    five edges changes nothing."""
    model, items = planted_mlp_model(), planted_items()
    heads = {"two movers": {f: [(1, 0), (1, 3)] for f in ("all", 0, 1, 2, 3)}}
    heads["person's own"] = {"person": {f: [(1, 0)] for f in ("all", 0, 1, 2, 3)}}
    raw = measure_run_circuits(model, _inputs(model, items), "person", hypotheses=heads, grain="edges")
    runs, edges = (
        raw[raw["table"] == t].dropna(axis=1, how="all") for t in ("circuit_runs", "circuit_edges")
    )
    table = circuits_table(runs)
    agreement = agreement_table(runs, edges.rename(columns={"edge": "part"}))
    for reference in ("person", "another occupation"):
        own = edges[edges["reference"] == reference]
        assert set(own.loc[own["rank"] <= 5, "edge"]) == PLANTED_EDGES
        found = table[(table["reference"] == reference) & (table["circuit"] == "top n by EAP-IG")]
        found = found.set_index("size")
        assert (found["grain"] == "edges").all()
        assert found.loc[5, "edges"] == 5 and found.loc[5, "parts"] == 4  # MLP0, two movers, embeddings
        assert found.loc[5, "held_out"] == pytest.approx(1.0, abs=0.03) and found.loc[5, "met"]
        assert abs(found.loc[5, "left_after_knockout"]) < 0.01
        assert found.loc[5, "greedy_searched"] and abs(found.loc[5, "worst_subset_difference"]) < 0.03
        own_hypothesis = table.loc[table["reference"] == reference, "circuit"].eq("person's own").any()
        assert own_hypothesis == (reference == "person")
        assert found.loc[3, "edges"] == 0 and not found.loc[[1, 2, 3], "met"].any()
        assert found.index[found["met"]].min() == 5
        hypothesis = table[(table["reference"] == reference) & (table["circuit"] == "two movers")]
        # the movers with every edge among them and the embeddings, MLP0 outside: nothing reaches them
        assert hypothesis["held_out"].abs().max() < 0.05
        assert agreement.loc[agreement["reference"] == reference, "eap_ig_spearman"].iloc[0] > 0.8


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
def test_every_edge_patched_is_every_part_patched_and_none_is_x(family):
    """Each receiver reads its own copy of the stream (analyses.circuits.wiring): with every edge
    patched every receiver reads x''s stream at the aligned positions, which is the run with every
    part patched; with none it is x. Grouped key/value heads (2 of 4), Gemma 3's norms after
    attention and its query/key norms, Qwen 3's query/key norms; words of other length."""
    from conftest import build_tiny

    from tests.model.test_paths import _items

    model, items = build_tiny(family, vocab_size=64), _items()
    inputs = _inputs(model, items)
    pairs = reference_pairs(items, "person")
    bank = inputs.bank
    graphs = (Graph(2, 4, True), EdgeGraph(2, 4, bank.keys[0].shape[1]))
    y = {}
    for graph in graphs:
        patching = Patching(model, bank, inputs.reference, pairs, inputs.labels, graph)
        masks = Masks()
        plan = [
            (i, "", "", 0, masks.add(np.full(graph.size, every)))
            for every in (True, False)
            for i in range(len(pairs))
        ]
        y[type(graph).__name__] = part_runs(patching, plan, masks)
    every_part, every_edge = y["Graph"][: len(pairs)], y["EdgeGraph"][: len(pairs)]
    np.testing.assert_allclose(every_edge, every_part, atol=1e-5)
    np.testing.assert_allclose(y["EdgeGraph"][len(pairs) :], y["Graph"][len(pairs) :], atol=1e-6)
    assert np.abs(every_part - y["Graph"][len(pairs) :]).max() > 1e-3  # the two ends differ


def test_the_edges_into_one_value_at_the_occupation_are_the_value_path():
    """Every edge into L1H3's value at the occupation patched is the stream's difference swapped into
    that head's value there (analyses.senders' value path: its pattern and the other heads as in x)."""
    from attnprobe.analyses.senders import Patching as PathPatching
    from attnprobe.analyses.senders import _sender_pass
    from tests.model.test_paths import _banks, _items, _llama

    model, items = _llama(kv=4), _items(4)
    bank, reference, labels, pairs = _banks(model, items)
    graph = EdgeGraph(3, 4, 4)
    patched = np.array([name.endswith("-> L1H3.v @ occupation") for name in graph.names()])
    masks = Masks()
    plan = [(i, "", "", 0, masks.add(patched)) for i in range(len(pairs))]
    got = part_runs(Patching(model, bank, reference, pairs, labels, graph), plan, masks)
    stream = torch.stack(
        [reference.hidden[1][p.donor, p.at_cf] - bank.hidden[1][p.item, p.at] for p in pairs]
    )
    with torch.inference_mode():
        swapped = _sender_pass(
            PathPatching(model, bank, reference, labels), pairs, torch.full((4,), 3), 1, stream
        )
    np.testing.assert_allclose(got, swapped.numpy(), atol=1e-5)
    assert np.abs(got - np.array([float(v) for v in bank_y(bank, labels)])).max() > 1e-4


def bank_y(bank, labels):
    from attnprobe.intervene.sites import behaviour_rows

    return behaviour_rows(bank.logits, labels[:, 0], labels[:, 1])


def test_edge_runs_summed_sparsely_equal_the_dense_sums(monkeypatch):
    """wiring.Patched sums, per receiver, the sparser of the patched edges and the others (the others
    from a running total of every sender's diff); the plain dense sum is the reference. Masks of every
    density, one whose first layer's attention inputs are untouched (its MLP's are: the total must
    still count that layer's heads once), runs started from their first patched layer."""
    from attnprobe.analyses.circuits import wiring
    from tests.model.test_paths import _items, _llama

    model, items = _llama(kv=2), _items()
    inputs = _inputs(model, items)
    pairs = reference_pairs(items, "person")
    graph = EdgeGraph(3, 4, 2)
    rng = np.random.default_rng(0)
    names = np.array(graph.names())
    into_mlp0 = np.char.find(names, "-> MLP0 @") >= 0
    chosen = [rng.random(graph.size) < p for p in (0.05, 0.5, 0.95)] + [
        into_mlp0,
        ~into_mlp0 | (rng.random(graph.size) < 0.5),
    ]
    masks = Masks()
    plan = [(i, "", "", 0, masks.add(m)) for m in chosen for i in range(len(pairs))]
    patching = Patching(model, inputs.bank, inputs.reference, pairs, inputs.labels, graph)
    sparse = part_runs(patching, plan, masks)
    monkeypatch.setattr(wiring.Patched, "sparse", False)
    dense = part_runs(patching, plan, masks)
    np.testing.assert_allclose(sparse, dense, atol=1e-5)
    clean = part_runs(
        patching, [(i, "", "", 0, masks.add(np.zeros(graph.size, bool))) for i in range(len(pairs))], masks
    )
    assert np.abs(dense - np.tile(clean, len(chosen))).max() > 1e-3  # the masks matter


def test_a_family_without_separate_query_key_value_projections_is_refused_in_one_line():
    """GPT-2 computes queries, keys and values in one Conv1D: edges cannot be read there; the search
    at the grain of parts still can. The line names the option to use."""
    from conftest import build_tiny

    from attnprobe.analyses.circuits.wiring import edge_sites
    from attnprobe.errors import RunError

    with pytest.raises(
        RunError, match=r"^--circuit-grain edges: .*run --circuits with --circuit-grain parts$"
    ):
        edge_sites(build_tiny("gpt2", vocab_size=64))


def test_the_greedy_search_moves_up_a_size_where_it_fails_the_smallest(monkeypatch):
    """search.greedy_rounds: each family's smallest circuit meeting the target is searched first; where
    its greedy subset fails it, the next smallest meeting the target is searched in a second round,
    and nothing else (the verdict reads the smallest circuit meeting every test, searched)."""
    from attnprobe.analyses.circuits import search

    searched = []

    def table(runs):  # size 3 fails once its greedy subset is judged; 5 and 10 meet the target
        failed = 3 in set(runs.get("greedy_of", pd.Series(dtype=int)))
        sizes = {3: not failed, 5: True, 10: True, 20: True}
        return pd.DataFrame({"circuit": search.ATTRIBUTED, "size": list(sizes), "met": list(sizes.values())})

    def greedy(patching, plan, near, fold, covariate, log):
        searched.append(list(near))
        return near, None

    monkeypatch.setattr(search, "circuits_table", table)
    monkeypatch.setattr(search, "greedy_subsets", greedy)
    as_frame = lambda near, y: pd.DataFrame({"greedy_of": [n for _, n in near]})
    search.greedy_rounds(None, None, pd.DataFrame({"greedy_of": []}), (None, None), as_frame, print)
    assert searched == [[(search.ATTRIBUTED, 3)], [(search.ATTRIBUTED, 5)]]
