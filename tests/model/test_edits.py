"""Head edits: each kind equals its definition, checked against weight surgery or the recorded
outputs; `attnprobe edit` end to end on a tiny model; bad input in one line."""

import itertools
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from conftest import edit_suite

import attnprobe
from attnprobe.attention.capture import editing, run_with_capture
from attnprobe.cli import main
from attnprobe.edits import Mean, Project, Resample, Scale, Zero, edited, load_edit, parse_heads, save_edit
from attnprobe.edits.editor import RowEditor
from attnprobe.edits.estimate import covariate_directions, token_means, token_sample
from attnprobe.forward.sharing import prefix_sharing_blocker
from attnprobe.heads import HeadSet
from attnprobe.intervene.engine import record
from attnprobe.run import RunOptions, plan_run
from attnprobe.suite import load_suite

LAYER, HEAD = 1, 1


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return attnprobe.load_model(str(tiny_llama_dir))


def _ids(tiny, texts=("The nurse said that", "My brother told me that he")):
    return [torch.tensor(tiny.tokenizer(t)["input_ids"]) for t in texts]


def _logits(tiny, ids):
    with torch.no_grad():
        return tiny.model(input_ids=ids[None], use_cache=False).logits[0]


def _o_proj(tiny):
    return tiny.model.model.layers[LAYER].self_attn.o_proj


def test_leace_mid_last_edits_the_prediction_position_alone_where_the_pass_says_which(tiny, tmp_path):
    """LeaceMidLast (edits.kinds): given each row's prediction position (RowEditor.last, as the
    sweep's passes give it) only that position's head output is edited, so the logits before it
    are the clean ones and the last differs; applied to the whole model (run --edit, `edited`) a
    pass's edit acts at the positions whose prediction the pass reads (a capture reading the last
    position gives the sweep's logits there and the clean attention before it; one reading none is
    the clean model), and where a call does not say, at every position, as leace_mid; edited passes
    of it never share prefixes, nor does a run with it."""
    from attnprobe.edits.kinds import LeaceMid, LeaceMidLast
    from attnprobe.edits.passes import packs_edits

    L, H, D = tiny.info.n_layers, tiny.info.n_heads, tiny.info.head_dim
    g = torch.Generator().manual_seed(0)
    u, f, mu = (torch.randn(L, H, D, generator=g) for _ in range(3))
    heads = ((0, 0), (LAYER, HEAD))
    mid, last = LeaceMid(heads, u, f, mu), LeaceMidLast(heads, u, f, mu)
    ids = _ids(tiny)[1]
    clean, T = _logits(tiny, ids), len(ids)
    rows = mid.mask(L, H)[None]
    with editing(RowEditor(last, rows, None, torch.tensor([T - 1]))):
        at_last = _logits(tiny, ids)
    assert torch.equal(at_last[: T - 1], clean[: T - 1]) and not torch.allclose(
        at_last[-1], clean[-1], atol=1e-4
    )
    with editing(RowEditor(mid, rows, None, torch.tensor([T - 1]))):  # leace_mid ignores it
        everywhere = _logits(tiny, ids)
    assert not torch.allclose(everywhere[: T - 1], clean[: T - 1], atol=1e-4)
    clean_capture = run_with_capture(tiny, ids[None])
    with edited(tiny, last):
        assert torch.allclose(_logits(tiny, ids), everywhere, atol=1e-6)
        read = run_with_capture(tiny, ids[None], logit_positions=torch.tensor([[T - 1]]))
        unread = run_with_capture(tiny, ids[None])
        assert "prediction alone" in prefix_sharing_blocker(tiny.model.config, T)  # a scoring pass's too
    assert prefix_sharing_blocker(tiny.model.config, T) is None
    assert torch.allclose(read.logits[0, 0], at_last[-1], atol=1e-5)
    for layer, weights in read.weights.items():
        assert torch.equal(weights[:, :, : T - 1], clean_capture.weights[layer][:, :, : T - 1])
        assert torch.equal(unread.weights[layer], clean_capture.weights[layer])
    assert not all(torch.equal(read.weights[n], clean_capture.weights[n]) for n in read.weights)
    bank = record(tiny.model, _ids(tiny))
    assert packs_edits(tiny.model, bank, mid) and not packs_edits(tiny.model, bank, last)
    saved = load_edit(save_edit(last, tmp_path / "last", tiny, {}))
    plan = plan_run(load_suite(edit_suite(tmp_path)), tiny, RunOptions(edits=(saved,)))
    assert plan.blocker == "the edit last acts at the prediction alone"


def test_zero_ablation_equals_removing_the_head_from_the_output_projection(tiny):
    ids = _ids(tiny)[0]
    with edited(tiny, Zero(heads=((LAYER, HEAD),))):
        got = _logits(tiny, ids)
    D = tiny.info.head_dim
    weight = _o_proj(tiny).weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight[:, HEAD * D : (HEAD + 1) * D] = 0  # the head's columns of W_O: its output never arrives
        expected = _logits(tiny, ids)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert torch.allclose(got, expected, atol=1e-6) and not torch.allclose(got, _logits(tiny, ids), atol=1e-4)


def test_mean_ablation_equals_the_recorded_mean_through_the_output_projection(tiny):
    bank = record(tiny, _ids(tiny))
    means = token_means(bank)
    # by hand: the mean of the head's output over the 2 sequences' real tokens
    valid = [bank.outputs[LAYER][n, HEAD, :length] for n, length in enumerate(bank.lengths.tolist())]
    assert torch.allclose(means[LAYER, HEAD], torch.cat(valid).mean(0), atol=1e-6)
    ids = _ids(tiny)[0]
    with edited(tiny, Mean(heads=((LAYER, HEAD),), means=means)):
        got = _logits(tiny, ids)
    D = tiny.info.head_dim
    o_proj = _o_proj(tiny)
    constant = o_proj.weight[:, HEAD * D : (HEAD + 1) * D] @ means[LAYER, HEAD]  # what the mean adds
    saved = o_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            o_proj.weight[:, HEAD * D : (HEAD + 1) * D] = 0
        hook = o_proj.register_forward_hook(lambda m, a, out: out + constant)
        expected = _logits(tiny, ids)
        hook.remove()
    finally:
        with torch.no_grad():
            o_proj.weight.copy_(saved)
    assert torch.allclose(got, expected, atol=1e-5)


def _edited_outputs(tiny, edit, ids):
    """The per-head outputs every layer passes on under `edit` (recorded after the edit)."""
    seen = {}
    editor = RowEditor(edit, edit.mask(tiny.info.n_layers, tiny.info.n_heads)[None])

    def record_after(site):
        seen[site.layer] = (site.output.detach(), editor(site).detach())
        return seen[site.layer][1]

    with editing(record_after), torch.no_grad():
        tiny.model(input_ids=ids[None], use_cache=False)
    return seen


def test_projection_leaves_no_component_along_the_direction_and_other_heads_alone(tiny):
    bank = record(
        tiny, _ids(tiny, [f"The {w} said that" for w in ("nurse", "pilot", "chef", "judge", "baker")])
    )
    last = torch.stack([z[torch.arange(5), :, bank.lengths - 1] for z in bank.outputs], 1)
    directions = covariate_directions(last, np.array([90.0, 5, 20, 35, 60]))
    assert torch.allclose(directions.norm(dim=-1), torch.ones(2, 2), atol=1e-5)
    seen = _edited_outputs(tiny, Project(heads=((LAYER, HEAD),), directions=directions), _ids(tiny)[0])
    before, after = seen[LAYER]
    u = directions[LAYER, HEAD]
    assert (after[0, HEAD] @ u).abs().max() < 1e-5 and (before[0, HEAD] @ u).abs().max() > 1e-3
    assert torch.equal(after[0, 1 - HEAD], before[0, 1 - HEAD])  # the other head untouched
    assert torch.allclose(after[0, HEAD] + (before[0, HEAD] @ u)[:, None] * u, before[0, HEAD], atol=1e-6)


def test_scale_by_one_is_the_identity_and_by_zero_is_zero_ablation(tiny):
    ids = _ids(tiny)[1]
    with edited(tiny, Scale(heads=((LAYER, HEAD), (0, 0)), factor=1.0)):
        same = _logits(tiny, ids)
    assert torch.equal(same, _logits(tiny, ids))
    with edited(tiny, Scale(heads=((LAYER, HEAD),), factor=0.0)):
        scaled = _logits(tiny, ids)
    with edited(tiny, Zero(heads=((LAYER, HEAD),))):
        zero = _logits(tiny, ids)
    assert torch.allclose(scaled, zero, atol=1e-6)


def test_resample_takes_each_position_from_the_reference_bank(tiny):
    bank = token_sample(record(tiny, _ids(tiny)), 6, seed=1)  # (L, H, 6, D)
    assert bank.shape[2] == 6
    seen = _edited_outputs(tiny, Resample(heads=((LAYER, HEAD),), bank=bank), _ids(tiny)[1])
    _, after = seen[LAYER]
    for position in after[0, HEAD]:
        assert (position[None] - bank[LAYER, HEAD]).abs().max(-1).values.min() < 1e-6


@pytest.mark.parametrize("kind", ["zero", "mean", "project"])
def test_packed_edited_passes_equal_separate_ones_and_a_plain_edited_forward(tiny, kind):
    """Variants with one head set share their sequences' prefixes in a packed trie; y must equal the
    unpacked passes and a whole forward of the edited model, for heads in either layer and none."""
    from attnprobe.edits.passes import Variants, _packed_groups, edited_behaviour, packs_edits
    from attnprobe.intervene.sites import behaviour_rows

    texts = ["The nurse said that", "The nurse told us that", "The nurse left", "The pilot said that"]
    ids = _ids(tiny, texts + ["My brother told me that he"])
    bank = record(tiny, ids)
    edit = {
        "zero": Zero(),
        "mean": Mean(means=token_means(bank)),
        "project": Project(directions=covariate_directions(torch.randn(5, 2, 2, 8), np.arange(5.0))),
    }[kind]
    L, H = tiny.info.n_layers, tiny.info.n_heads
    sets = [(), ((0, 0),), ((LAYER, HEAD),), ((0, 1), (1, 0))]
    base = torch.arange(len(ids)).repeat(len(sets))
    heads = torch.stack([edit.on(s).mask(L, H) for s in sets for _ in ids])  # (V, L, H)
    positive, negative = torch.tensor([[7]] * len(base)), torch.tensor([[11, 12]] * len(base))
    assert packs_edits(tiny.model, bank, edit)
    packed = edited_behaviour(tiny, Variants(bank, edit, base, heads), positive, negative, share=True)
    separate = edited_behaviour(tiny, Variants(bank, edit, base, heads), positive, negative, share=False)
    assert torch.allclose(packed, separate, atol=1e-5)  # float32 sums in rows of other shapes
    for v in (6, 13, 19):  # a few variants, each as one whole forward of the edited model
        with edited(tiny, edit.on(sets[v // len(ids)])):
            logits = _logits(tiny, ids[base[v]])[-1:]
        assert abs(packed[v] - behaviour_rows(logits, positive[v : v + 1], negative[v : v + 1])[0]) < 1e-5
    assert not torch.allclose(packed[5:10], packed[:5], atol=1e-4)  # the edits change y
    # the four sentences sharing "The nurse" are forwarded once up to where they part
    forwarded = sum(
        len({(tuple(ids[base[v]][: t + 1].tolist())) for v in pack for t in range(len(ids[base[v]]))})
        for _, packs in _packed_groups(bank, base, heads, 4096)
        for pack in packs
    )
    assert forwarded < int(bank.lengths[base].sum())
    assert not packs_edits(tiny.model, bank, Resample(bank=torch.zeros(L, H, 2, 8)))  # draws per position


def test_one_call_with_an_edit_per_variant_equals_a_call_per_edit(tiny):
    """The sweep edits each quarter with its own parameters in one call (`which`): every variant's y
    must be what a call with its edit alone gives, packed or not."""
    from attnprobe.edits.passes import Variants, edited_behaviour

    ids = _ids(tiny, ["The nurse said that", "The nurse told us that", "The pilot left"])
    bank = record(tiny, ids)
    means = token_means(bank)
    edits = (Mean(means=means), Mean(means=means * 3), Zero())
    L, H = tiny.info.n_layers, tiny.info.n_heads
    base = torch.arange(len(ids)).repeat(6)
    which = (torch.arange(len(base)) // 3) % 3  # every edit on every sequence
    heads = torch.stack([HeadSet(((LAYER, HEAD), (0, v % 2))).mask(L, H) for v in range(len(base))])
    positive, negative = torch.tensor([[7]] * len(base)), torch.tensor([[11]] * len(base))
    for share in (True, False):
        together = edited_behaviour(
            tiny, Variants(bank, edits, base, heads, which), positive, negative, share=share
        )
        for i, edit in enumerate(edits):
            mine = (which == i).nonzero()[:, 0]
            alone = edited_behaviour(
                tiny, Variants(bank, edit, base[mine], heads[mine]), positive[mine], negative[mine]
            )
            assert torch.allclose(together[mine], alone, atol=1e-5)
    assert not torch.allclose(together[which == 0], together[which == 1], atol=1e-4)  # the edits differ


def test_heads_are_parsed_and_refused_in_one_line():
    assert parse_heads("L1H0, l0h1", 2, 2) == ((1, 0), (0, 1))
    heads = HeadSet.parse("L1H0, l0h1,L1H0", 2, 3)  # the one vocabulary: text, flat, mask, text again
    assert heads.pairs == ((1, 0), (0, 1)) and heads.flat(3) == [3, 1] and str(heads) == "L1H0 L0H1"
    assert HeadSet.from_flat(heads.flat(3), 3) == heads and heads.mask(2, 3).nonzero().tolist() == [
        [0, 1],
        [1, 0],
    ]
    with pytest.raises(attnprobe.AttnprobeError, match="no heads given"):
        HeadSet.parse(" , ", 2, 2)
    with pytest.raises(attnprobe.AttnprobeError, match=r"head L40H3 is not in this model \(30 layers L0-L29"):
        parse_heads("L40H3", 30, 9)
    with pytest.raises(attnprobe.AttnprobeError, match="is not of the form L<layer>H<head>"):
        parse_heads("26.2", 30, 9)


def _check_joint_terms(raw: pd.DataFrame, row, kind: str, k: int) -> None:
    """The joint regression's terms, specificity, offset and accuracy recomputed from the item file
    alone: statsmodels' OLS of y before and of y after on the covariate / 10, the factual sign and
    the group x template cells (the occupations, then the nouns put in the templates)."""
    import statsmodels.api as sm

    def edited(rows):
        return rows[(rows.kind == kind) & (rows.k == k) & (rows.draw == -1)].set_index("index")["y"]

    none = raw[raw.kind == "none"]
    bias = none[none.target == "bias"].set_index("index")
    nouns = none[(none.target == "control") & (none.set == "nouns_templates")].set_index("index")
    both = pd.concat(
        [
            pd.DataFrame({"y0": bias.y, "y1": edited(raw[raw.target == "bias"]).reindex(bias.index)}).assign(
                cell="o" + bias.template_id, x=bias.covariate / 10, f=0.0
            ),
            pd.DataFrame(
                {"y0": nouns.y, "y1": edited(raw[raw.target == "control"]).reindex(nouns.index)}
            ).assign(cell="p" + nouns.template_id, x=0.0, f=nouns.sign),
        ]
    )
    X = pd.concat([pd.get_dummies(both.cell, dtype=float), both[["x", "f"]]], axis=1)
    b0, b1 = (sm.OLS(both[y].to_numpy(), X.to_numpy()).fit().params[-2:] for y in ("y0", "y1"))
    removed, kept = 1 - b1[0] / b0[0], b1[1] / b0[1]
    assert np.isclose(row.nouns_templates_stereotype_removed, removed, rtol=0, atol=1e-8)
    assert np.isclose(row.nouns_templates_factual_kept, kept, rtol=0, atol=1e-8)
    assert np.isclose(row.specificity, removed - abs(1 - kept), rtol=0, atol=1e-8)
    assert row.specificity_ci_low <= row.specificity <= row.specificity_ci_high
    shift = both.y1[both.f != 0] - both.y0[both.f != 0]
    assert np.isclose(row.control_nouns_templates_offset, shift.mean())
    signs = both.f[both.f != 0]
    assert np.isclose(
        row.control_nouns_templates_accuracy_after, (np.sign(both.y1[both.f != 0]) == signs).mean()
    )


def test_edit_command_end_to_end_and_its_statistics(tiny_llama_dir, tmp_path):
    suite, out = edit_suite(tmp_path), tmp_path / "run"
    args = ["run", str(suite), "--model", str(tiny_llama_dir), "--out", str(out), "--no-report"]
    assert CliRunner().invoke(main, args).exit_code == 0
    (tmp_path / "text.txt").write_text("The weather was mild and the market opened early. " * 5)
    result = CliRunner().invoke(
        main,
        ["edit", str(out), "--kinds", "zero,mean,resample,scale,project", "--k", "1,2"]
        + ["--draws", "3", "--texts", "8", "--cost-text", str(tmp_path / "text.txt")],
    )
    assert result.exit_code == 0, result.output
    edits = pd.read_csv(out / "edits.csv")
    assert len(edits) == 5 * 2 and set(edits["kind"]) == {"zero", "mean", "resample", "scale", "project"}
    # distinct random sets: of 4 heads, one head leaves 3 others (1 of its own layer), two heads leave 1 set
    assert list(edits["n_random"]) == [3, 1] * 5 and edits["random_p"].between(0.25, 1).all()
    raw = pd.read_parquet(out / "edits_items.parquet")
    # recompute one row from the raw values: the gradient before and after, per 10 points
    row = edits[(edits.kind == "zero") & (edits.k == 2)].iloc[0]
    items = raw[(raw.target == "bias") & (raw.kind == "none")].set_index("index").sort_index()
    after = raw[(raw.target == "bias") & (raw.kind == "zero") & (raw.k == 2) & (raw.draw == -1)]
    after = after.set_index("index").sort_index()
    x = items["covariate"].to_numpy()
    slope = lambda y: 10 * np.polyfit(x, y, 1)[0]
    assert np.isclose(row.gradient_before, slope(items["y"].to_numpy()))
    assert np.isclose(row.gradient_after, slope(after["y"].to_numpy()))
    assert np.isclose(row.gradient_removed, 1 - row.gradient_after / row.gradient_before)
    assert row.gradient_after_ci_low <= row.gradient_after <= row.gradient_after_ci_high
    # scale 0.5 edits something, project removes a direction: neither is the clean run
    assert (edits["kl"] > 0).all() and edits["text_loss_change"].notna().all()
    assert edits["definitional_accuracy_before"].between(0, 1).all()
    # the control measured without a sign count, on the nouns (held out by word): the gap toward the
    # labels kept, the offset and the accuracy once the edit's mean shift is removed; the names and the
    # new frame (no fit used them) apart; the phrases in the items' own templates judged like their
    # file rows (nouns: by the other half's fit), never fitted on
    control0 = raw[(raw.target == "control") & (raw.kind == "none")].set_index("index").sort_index()
    control1 = raw[(raw.target == "control") & (raw.kind == "zero") & (raw.k == 2) & (raw.draw == -1)]
    y0, y1, sign = (
        control0["y"].to_numpy(),
        control1.set_index("index").sort_index()["y"].to_numpy(),
        control0["sign"].to_numpy(),
    )
    nouns, names = (control0["set"] == "nouns").to_numpy(), (control0["set"] == "names").to_numpy()
    in_templates = (control0["set"] == "nouns_templates").to_numpy()
    assert set(control0.loc[nouns, "half"]) == {0, 1} == set(control0.loc[in_templates, "half"])
    assert set(control0.loc[~nouns & ~in_templates, "half"]) == {2}
    assert set(control0["set"]) == {"nouns", "frame", "names", "nouns_templates", "names_templates"}
    # "said" cut at its pronoun is the control's own frame ("The king said that"): never a template prompt
    assert set(control0.loc[in_templates, "template_id"]) == {"told"}
    for pair, rows in control0[nouns].groupby("pair"):  # a word pair's prompts share a half
        assert rows["half"].nunique() == 1, pair
    gap = lambda rows: (sign[rows] * y1[rows]).mean() / (sign[rows] * y0[rows]).mean()
    assert np.isclose(row.definitional_gap_kept, gap(nouns))
    assert np.isclose(row.control_names_gap_kept, gap(names))
    assert np.isclose(row.definitional_offset, (y1 - y0)[nouns].mean())
    assert row.definitional_gap_kept_ci_low <= row.definitional_gap_kept <= row.definitional_gap_kept_ci_high
    shifted = y1[nouns] - (y1 - y0)[nouns].mean()
    assert np.isclose(row.definitional_accuracy_after_centred, (np.sign(shifted) == sign[nouns]).mean())
    _check_joint_terms(raw, row, "zero", 2)
    assert row.gradient_removed_ci_low <= row.gradient_removed <= row.gradient_removed_ci_high
    assert row.specificity_ci_low <= row.specificity <= row.specificity_ci_high
    draws = pd.read_csv(out / "edits_draws.csv")
    assert len(draws) == 5 * (3 + 1)
    # the null's floor: 1 / (1 + the distinct sets drawn); same-layer sets first (a 2-head layer has one)
    assert (edits["random_p_floor"] == 1 / (1 + edits["n_random"])).all()
    assert (edits.loc[edits.k == 1, "random_sets_same_layers"] == 1).all()
    assert (edits["random_p_holm"] >= np.maximum(edits["random_p"], edits["random_p_floor"]) - 1e-12).all()
    for r in edits.itertuples():  # where the found heads fall among the random draws
        removed = draws[(draws.kind == r.kind) & (draws.k == r.k)].gradient_removed_sampled
        assert np.isclose(r.random_percentile, 100 * (removed < r.gradient_removed_sampled).mean())
        assert np.isclose(
            r.random_p, (1 + (removed >= r.gradient_removed_sampled).sum()) / (1 + len(removed))
        )
    for (kind, k), group in draws.groupby(["kind", "k"]):  # distinct sets, none the found one
        found = edits[(edits.kind == kind) & (edits.k == k)].heads_all.iloc[0]
        assert group.heads.is_unique and found not in set(group.heads)
    # each top head zeroed alone (4 heads in this model): its shares, recomputed from the raw rows
    heads = pd.read_csv(out / "edits_heads.csv")
    assert list(heads["rank"]) == [1, 2, 3, 4] and heads["head"].is_unique
    first = (
        raw[(raw.target == "bias") & (raw.kind == "single") & (raw.k == 1)].set_index("index").sort_index()
    )
    assert np.isclose(heads.gradient_after.iloc[0], slope(first["y"].to_numpy()))
    assert heads.specificity.iloc[0] == heads.nouns_templates_specificity.iloc[0]
    assert heads.specificity_ci_low.iloc[0] <= heads.specificity.iloc[0] <= heads.specificity_ci_high.iloc[0]
    assert (out / "figures" / "edit_frontier.png").stat().st_size > 5000
    # a second call reads every kind back (resume) and gives the same table
    again = CliRunner().invoke(
        main,
        ["edit", str(out), "--kinds", "zero,mean,resample,scale,project", "--k", "1,2"]
        + ["--draws", "3", "--texts", "8", "--cost-text", str(tmp_path / "text.txt")],
    )
    # 5 kinds and the heads alone
    assert again.exit_code == 0 and again.output.count("read from an earlier session") == 6
    pd.testing.assert_frame_equal(
        pd.read_csv(out / "edits.csv").drop(columns="seconds"), edits.drop(columns="seconds")
    )
    # the notebook reads the same table (the report's section: test_saved_edits, on the swept run)
    pd.testing.assert_frame_equal(attnprobe.Run(out).edits, pd.read_parquet(out / "edits.parquet"))
    # bad input: one line each
    for extra, message in (
        (["--heads", "L40H3"], "head L40H3 is not in this model (2 layers"),
        (["--k", "5"], "k 5 leaves none of this model's 4 heads"),
        (["--k", "1", "--cost-text", str(tmp_path / "empty.txt")], "has no text to score"),
        (["--kinds", "melt"], "unknown edit kind melt"),
        (
            ["--k", "1", "--reference", "robot"],
            "--reference 'robot' is not one of the run's counterfactual words",
        ),
    ):
        (tmp_path / "empty.txt").write_text("  \n")
        bad = CliRunner().invoke(main, ["edit", str(out), *extra])
        assert bad.exit_code == 2 and message in bad.output and "Traceback" not in bad.output, bad.output
        assert "loading" not in bad.output  # refused before the model loads
    # --fresh removes the sweep with the run it belonged to (a stale edits.csv would reach the report)
    assert CliRunner().invoke(main, [*args, "--fresh"]).exit_code == 0
    assert not (out / "edits.csv").exists() and not list((out / "chunks").glob("edits-*"))


def test_edit_refuses_a_run_without_head_effects(tiny_llama_dir, tmp_path):
    suite, out = edit_suite(tmp_path), tmp_path / "run"
    args = ["run", str(suite), "--model", str(tiny_llama_dir), "--out", str(out), "--no-report"]
    assert CliRunner().invoke(main, [*args, "--no-head-effects"]).exit_code == 0
    bad = CliRunner().invoke(main, ["edit", str(out)])
    assert bad.exit_code == 2 and "this run has no head effects" in bad.output


def test_edit_needs_the_suites_control_and_reads_it_from_there(tiny_llama_dir, tmp_path):
    """Nothing about a contrast lives in the edit code (issue 37): a suite without `control:` is
    refused before weights load; a control file naming a label the contrast lacks is one line."""
    suite, out = edit_suite(tmp_path), tmp_path / "run"
    text = suite.read_text()
    suite.write_text(
        text.replace(
            'control:\n  file: definitional.tsv\n  words: {female: " she", male: " he"}\n  pair: pair\n'
            "  set: set\n  fit: nouns\n  phrase: phrase\n",
            "",
        )
    )
    args = ["run", str(suite), "--model", str(tiny_llama_dir), "--out", str(out), "--no-report"]
    assert CliRunner().invoke(main, args).exit_code == 0
    bad = CliRunner().invoke(main, ["edit", str(out)])
    assert (
        bad.exit_code == 2
        and "declare them in the suite: control:" in bad.output
        and "loading" not in bad.output
    )
    (tmp_path / "definitional.tsv").write_text(
        "prompt\tlabel\tpair\tset\tphrase\nThe king said that\tman\tking/queen\tnouns\tthe king\n"
    )
    suite.write_text(text)
    from attnprobe.suite import load_suite

    with pytest.raises(
        attnprobe.SuiteError, match=r"definitional.tsv:2: label 'man' is none of the control's words"
    ):
        load_suite(suite)
    suite.write_text(text.replace('male: " he"', 'boy: " he"'))
    with pytest.raises(
        attnprobe.SuiteError, match=r"`words` must name the contrast's labels female and male"
    ):
        load_suite(suite)


def test_the_random_nulls_floor_counts_the_sets_it_can_draw():
    """Issue 38: 20 draws of one other head of a 9-head layer are at most 8 different sets, so p
    cannot go below 1/9 whatever the draws say; two heads of one layer: C(7, 2) = 21 sets."""
    from attnprobe.stats.edits import possible_sets

    assert possible_sets("L26H2", 9) == 8 and possible_sets("L26H2 L26H5", 9) == 21
    assert possible_sets("L26H2 L25H1", 9) == 64 and possible_sets("L1H0 L1H1", 2) == 1


def test_the_null_draws_distinct_sets_of_the_same_layers_then_from_every_head():
    from attnprobe.edits.sweep.measure import null_sets

    rng = np.random.default_rng(0)
    one = null_sets(((26, 2),), 30, 9, rng, 20)  # 8 other heads of layer 26, then 12 from all heads
    assert len(set(one)) == 20 and ((26, 2),) not in one
    assert sum(draw[0][0] == 26 for draw in one[:8]) == 8 and sorted(one[:8]) == [
        ((26, h),) for h in range(9) if h != 2
    ]
    five = (
        (23, 1),
        (25, 2),
        (26, 2),
        (26, 7),
        (27, 0),
    )  # 8 x 8 x C(7, 2) x 8 sets of the same layers: enough
    sets = null_sets(five, 30, 9, rng, 20)
    layers = sorted(layer for layer, _ in five)
    assert len(set(sets)) == 20 and all(sorted(layer for layer, _ in s) == layers for s in sets)
    assert all(not set(s) & set(five) for s in sets)
    # k above half the model (3 of 2 x 2 heads; edit --k 3 crashed drawing 3 of the 1 head left):
    # every other set of 3 heads, each once
    most = ((0, 0), (0, 1), (1, 0))
    sets = null_sets(most, 2, 2, rng, 20)
    assert sorted(sets) == sorted(
        s for s in itertools.combinations(sorted(itertools.product(range(2), range(2))), 3) if s != most
    )


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"kinds": ("zero", "zero")}, "--kinds lists zero twice; give each once"),
        ({"ks": (1, 5, 1)}, "--k lists 1 twice; give each once"),
        ({"seed": -1}, "--seed -1: give a whole number from 0 to 2**63 - 1"),
        ({"seed": 2**64}, "--seed 18446744073709551616: give a whole number"),
        ({"seed": "3"}, "--seed '3': give a whole number"),
    ],
)
def test_edit_options_repeated_or_out_of_range_are_one_error(settings, message):
    import re

    from attnprobe.edits import EditOptions

    with pytest.raises(attnprobe.AttnprobeError, match=re.escape(message)):
        EditOptions(**settings)


def test_the_placebo_and_the_readout_after_the_edit(tiny_llama_dir, tmp_path, monkeypatch):
    """--placebo N: leace (fitted on the covariate) refitted on N permutations of it across units, each
    choosing its heads and layers again, zero (not fitted on it) left out; p recomputes from the raw
    rows, its floor is 1 / (1 + N), and the edits table carries it; a permuted covariate keeps each
    unit one value."""
    from attnprobe.edits.layers.stream import StreamEdit
    from attnprobe.edits.sweep.permuted import permuted

    fits = []  # the layer of every stream eraser fitted
    fit = StreamEdit.fit.__func__
    monkeypatch.setattr(StreamEdit, "fit", classmethod(lambda cls, *a: fits.append(a[1]) or fit(cls, *a)))
    suite, out = edit_suite(tmp_path), tmp_path / "run"
    args = ["run", str(suite), "--model", str(tiny_llama_dir), "--out", str(out), "--no-report"]
    assert CliRunner().invoke(main, args).exit_code == 0
    sweep = ["edit", str(out), "--kinds", "zero,leace", "--k", "1", "--draws", "0", "--alone", "0"]
    result = CliRunner().invoke(main, [*sweep, "--texts", "2", "--placebo", "4", "--stream", "--mlp"])
    assert result.exit_code == 0, result.output
    # the stream's layer chosen again by every refit: each layer fitted for the 4 quarters, every item
    # and the other half's words by the real sweep, for the 4 quarters by each of the 4 permutations
    # (the saved edits add their chosen layers' fits)
    assert all(fits.count(layer) >= 6 + 4 * 4 for layer in (0, 1)), sorted(fits)
    raw = pd.read_parquet(out / "edits_items.parquet")
    again = raw[raw.kind == "placebo-stream-chosen"].groupby("draw")["heads"].first()
    assert len(again) == 4 and again.str.contains("q0: layer").all()  # the layers each refit chose
    heads = raw[raw.kind == "placebo-leace"].groupby("draw")["heads"].first()
    assert len(heads) == 4 and heads.str.match(r"L\dH\d( \| L\dH\d){3}$").all()  # and its heads
    placebo = pd.read_csv(out / "edits_placebo.csv")
    stream = pd.read_csv(out / "edits_stream.csv")
    chosen = stream[stream["chosen"]].iloc[0]  # the stream's placebo
    row = placebo.set_index("kind").loc["stream-chosen"]
    assert np.isclose(chosen.placebo_p, row.placebo_p) and np.isclose(
        chosen.gradient_removed, row.gradient_removed
    )
    assert stream.loc[~stream["chosen"], "placebo_p"].isna().all()
    # each MLP mode fitted on the covariate likewise (zero and mean are not: no placebo)
    mlp = pd.read_csv(out / "edits_mlp.csv").set_index("kind")
    for mode in ("project", "leace"):
        row = placebo.set_index("kind").loc[f"mlp-{mode}-chosen"]
        assert np.isclose(mlp.loc[f"mlp-{mode}-chosen", "placebo_p"], row.placebo_p) and row.n_placebo == 4
    assert mlp.loc[["mlp-zero-chosen", "mlp-mean-chosen"], "placebo_p"].isna().all()
    placebo = placebo[~placebo["kind"].str.endswith("-chosen")]
    assert list(placebo["kind"]) == ["leace"] and list(placebo["n_placebo"]) == [4]
    assert np.allclose(placebo["placebo_p_floor"], 0.2) and placebo["placebo_p"].between(0.2, 1).all()
    items = raw[(raw.target == "bias") & (raw.kind == "none")].set_index("index").sort_index()
    x, y0 = items["covariate"].to_numpy(), items["y"].to_numpy()
    removed = lambda rows: (
        1 - np.polyfit(x, rows.set_index("index").sort_index()["y"], 1)[0] / np.polyfit(x, y0, 1)[0]
    )
    fake = raw[(raw.target == "bias") & (raw.kind == "placebo-leace")]
    null = np.array([removed(rows) for _, rows in fake.groupby("draw")])
    real = removed(raw[(raw.target == "bias") & (raw.kind == "leace") & (raw.draw == -1)])
    assert len(null) == 4 and np.isclose(placebo["gradient_removed"].iloc[0], real)
    assert np.isclose(placebo["placebo_p"].iloc[0], (1 + (null >= real).sum()) / 5)
    edits = pd.read_csv(out / "edits.csv").set_index("kind")
    assert np.isclose(edits.loc["leace", "placebo_p"], placebo["placebo_p"].iloc[0])
    assert np.isnan(edits.loc["zero", "placebo_p"])
    # the erasure checked after the fact: R2 of the covariate read on held-out items from the site
    for kind in ("zero", "leace"):
        read = raw[(raw.target == "readout_after") & (raw.kind == kind)].set_index("index")["y"]
        x_held = items["covariate"].reindex(read.index).to_numpy()
        r2 = 1 - ((x_held - read) ** 2).sum() / ((x_held - x_held.mean()) ** 2).sum()
        assert np.isclose(edits.loc[kind, "readout_r2_after"], r2)
        assert edits.loc[kind, "readout_r2_after_ci_low"] <= r2 <= edits.loc[kind, "readout_r2_after_ci_high"]
    assert edits.loc["zero", "readout_r2_after"] <= 0.01  # zeroed heads hold nothing to read
    units = ["a", "a", "b", "c", "c", "c"]
    shuffled = permuted(np.array([1.0, 1.0, 2.0, 3.0, 3.0, 3.0]), units, np.random.default_rng(0))
    assert shuffled[0] == shuffled[1] and shuffled[3] == shuffled[4] == shuffled[5]
    assert sorted(set(shuffled)) == [1.0, 2.0, 3.0]


def test_no_template_prompt_is_word_for_word_a_control_prompt(smollm_tokenizer):
    """A template cut where the control's frame ends ("The nurse said that" -> "The king said that")
    would judge a phrase on a prompt a keep constraint was fitted on: it is left out, the others kept."""
    from attnprobe.edits.inputs import template_prompts

    cut = lambda text, template: SimpleNamespace(
        x=np.array(smollm_tokenizer(text)["input_ids"]), original="nurse", template_id=template
    )
    items = [cut("The nurse said that", "said"), cut("Yesterday the nurse told us that", "told")]
    control = SimpleNamespace(
        prompts=("The king said that", "The queen said that"), phrases=("the king", "the queen")
    )
    made = template_prompts(smollm_tokenizer, items, control)
    texts = [smollm_tokenizer.decode(ids) for ids in made.ids]
    assert texts == ["Yesterday the king told us that", "Yesterday the queen told us that"]
    assert list(made.item) == [1, 1] and list(made.row) == [0, 1]


def test_a_fitted_word_in_a_new_frame_is_judged_by_the_fit_on_the_other_half():
    """Round 5 judged the "frame" prompts (the nouns in a new frame, never fitted) by the fit on half
    0's words, which holds half of those very words; now a prompt of a half-0 pair is judged by the
    fit on half 1, fitted or not; prompts of no fitted pair (names) as before."""
    from attnprobe.edits.inputs import Inputs

    rows = [  # (pair, half, fitted): the nouns, their frame, a name pair, a pairless prompt
        ("king/queen", 0, True),
        ("son/daughter", 1, True),
        ("king/queen", 2, False),
        ("son/daughter", 2, False),
        ("John/Mary", 2, False),
        ("", 0, True),
    ]
    inputs = SimpleNamespace(
        control_pair=np.array([r[0] for r in rows], dtype=object),
        control_half=np.array([r[1] for r in rows]),
        control_fit=np.array([r[2] for r in rows]),
    )
    inputs.words_half = lambda: Inputs.words_half(inputs)
    assert list(Inputs.judged_by_other_half(inputs)) == [1, 0, 1, 0, 0, 1]
