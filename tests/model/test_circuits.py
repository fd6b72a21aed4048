"""Circuits found by attribution and judged by exact patching (attnprobe edit --circuits,
analyses.circuits): every part patched is x', none is x; a planted circuit through an MLP is found
at its size, faithful and complete, and a smaller one is not; selection on the judged items
inflates the in-sample figure, which the held-out one does not share."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attnprobe.analyses.circuits.graph import Graph
from attnprobe.analyses.circuits.runs import Patching, measure_run_circuits, part_runs
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
    return circuits_table(runs), parts_table(attribution), agreement_table(runs, attribution)


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
    plan = [(i, "", "", 0, np.full(graph.size, every)) for every in (True, False) for i in range(len(pairs))]
    y = part_runs(Patching(model, inputs.bank, inputs.reference, pairs, inputs.labels, graph), plan)
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
        assert table.loc[2, "random_high"] < 0.8  # two parts of the right three by chance: not all
        smallest = table.index[table["met"]].min()
        assert smallest == 3
        area, chance = table["area_held_out"].iloc[0], table["area_random"].iloc[0]
        # the curve: 0 up to a tenth of the parts, half at two tenths, 1 from three tenths on
        assert area == pytest.approx(0.8, abs=0.01) and chance < 0.7
        assert agreement.loc[agreement["reference"] == reference, "eap_ig_spearman"].iloc[0] > 0.8


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
