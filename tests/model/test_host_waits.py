"""A GPU's host time, counted on a CPU (issue 70): the phases wait for the device (read a value back)
and copy host data to it a bounded number of times per forward pass, not per prompt or per patched
variant. On an H100 the prompt phase spent 1.4 ms of host time a prompt and ran slower than a plain
eager loop; the stand-in device (attnprobe.testing.stand_in) counts the waits and copies a GPU would
make, so a regression fails here without one."""

import pytest

from attnprobe.forward.device import on_model_device
from attnprobe.measures.head_effects.screen import screen
from attnprobe.model import load_model
from attnprobe.run import RunOptions, plan_run
from attnprobe.run.phases import prompts_phase
from attnprobe.suite import load_suite
from attnprobe.testing.stand_in import stand_in_device

GENDER = "probes/gender.yaml"


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


def _plan(pm, limit, tmp_path, batch_size=256):
    out = tmp_path / f"{limit}-{batch_size}"
    options = RunOptions(out=out, limit=limit, batch_size=batch_size, progress=False, log=lambda m: None)
    return plan_run(load_suite(GENDER), pm, options), options


def test_the_prompt_phase_waits_per_batch_not_per_prompt(tiny, tmp_path):
    counted = {}
    for limit, batch_size in ((48, 256), (240, 256), (240, 16)):
        plan, options = _plan(tiny, limit, tmp_path, batch_size)
        phase = prompts_phase(tiny, plan, options)
        with stand_in_device() as device, on_model_device(tiny):
            for k in range(phase.n_chunks):
                phase.compute(k, lambda n: None)
        batches = sum(len(chunk) for chunk in plan.chunks)
        counted[(limit, batch_size)] = (device.waits, device.copies, batches)
    for waits, copies, batches in counted.values():
        # each batch: the attention blocks and the candidates' log-probabilities read back once;
        # ids, positions, mask, recorded rows, unpacking indices and picks copied once
        assert waits <= 2 * batches and copies <= 12 * batches, counted


def test_patching_waits_per_pass_not_per_variant(tiny, tmp_path):
    plan, _ = _plan(tiny, 96, tmp_path)
    part = plan.parts["head_effects"]
    items = part.items[:4]
    with stand_in_device() as device, on_model_device(tiny):
        tables = screen(tiny, part.measure, items, {i.item_id for i in items})
    variants = tables["items"]["output_in"].notna().sum() * 3  # every head in, out and its pattern
    L = tiny.info.n_layers
    # each group of variants by lowest layer is a few passes; a pass waits for its sizes and its
    # patched layers and copies its labels: a bound in layers, whatever the number of variants
    assert device.waits <= 40 * (L + 1) and device.copies <= 20 * (L + 1), (device.waits, device.copies)
    assert variants > device.copies


def test_the_edit_costs_wait_per_pass_not_per_text(tiny, tmp_path):
    """`attnprobe edit`'s cost passes (KL and loss of every text under every variant) read their
    results back once a pass: 38,216 waits fell to 780 on a 240-prompt edit when they stopped reading
    one text at a time."""
    import torch
    from conftest import edit_suite

    from attnprobe.edits import Zero
    from attnprobe.edits.passes import edited_text_costs
    from attnprobe.testing.edit_kinds import edit_inputs

    L, H = tiny.info.n_layers, tiny.info.n_heads
    with stand_in_device() as device, on_model_device(tiny):
        inputs = edit_inputs(tiny, load_suite(edit_suite(tmp_path)), texts=8)
        masks = torch.zeros(4 * len(inputs.texts.lengths), L, H, dtype=torch.bool)
        masks[:, L - 1, 0] = True  # every text under four variants of one head set: one group of passes
        before = device.waits
        kl, loss = edited_text_costs(tiny, inputs.texts, inputs.clean_logp, Zero(), masks)
    assert kl.shape == loss.shape == (len(masks),) and torch.isfinite(kl).all()
    # a few per pass (13 here), not several per variant (the per-text reads made 4 each: 128)
    assert device.waits - before < len(masks) / 2, device.waits - before
