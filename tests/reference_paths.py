"""Path patching for one item at a time, written from the definition with plain forward hooks on a
Llama-style model with transformers' eager attention and as many key/value heads as query heads
(so head h's value is columns h D .. (h + 1) D of v_proj's output). Imports nothing from attnprobe:
the reference attnprobe.analyses.paths is tested against.

  value    head (l, h)'s value at the occupation position p is x''s at p'
  pattern  head (l, h)'s attention weights are x''s (equal lengths)
  output   head (l, h)'s output (o_proj's input columns) at p and after is x''s, aligned
  edge     head (l, h)'s value at p is v_proj(norm(h_p + c_S(x') - c_S(x))), c_S what sender S
           wrote at p (the embedding, a head through o_proj, an MLP)
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch


@torch.no_grad()
def y_of(model, ids: torch.Tensor, positive: int, negative: int) -> float:
    logits = model(input_ids=ids[None]).logits[0, -1].double()
    logp = torch.log_softmax(logits, -1)
    return float(logp[positive] - logp[negative])


@contextmanager
def hooked(pairs):
    """(module, forward hook or pre-hook with its kind) registered for the block."""
    handles = []
    try:
        for module, kind, hook in pairs:
            register = module.register_forward_pre_hook if kind == "pre" else module.register_forward_hook
            handles.append(register(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def recorded(model, ids: torch.Tensor) -> dict:
    """One run: per layer its input, v_proj's output, o_proj's input, attention weights, MLP output."""
    got = {"input": {}, "v": {}, "z": {}, "mlp": {}}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append((layer, "pre", lambda m, a, i=i: got["input"].__setitem__(i, a[0][0].clone())))
        hooks.append(
            (layer.self_attn.v_proj, "post", lambda m, a, o, i=i: got["v"].__setitem__(i, o[0].clone()))
        )
        hooks.append(
            (layer.self_attn.o_proj, "pre", lambda m, a, i=i: got["z"].__setitem__(i, a[0][0].clone()))
        )
        hooks.append((layer.mlp, "post", lambda m, a, o, i=i: got["mlp"].__setitem__(i, o[0].clone())))
    with hooked(hooks):
        out = model(input_ids=ids[None], output_attentions=True)
    got["weights"] = [w[0] for w in out.attentions]  # (H, T, T) per layer
    return got


@torch.no_grad()
def path_y(model, x, x_cf, at, at_cf, path: str, heads, positive, negative, scale: float = 1.0) -> float:
    """y of x with `path` of each head (layer, head) of `heads` taken from x' (`value`: moved `scale`
    of the way from x's value at p to x''s at p')."""
    D = model.config.hidden_size // model.config.num_attention_heads
    donor = recorded(model, x_cf)
    hooks, live_v = [], {}
    for layer, head in heads:
        cols = slice(head * D, (head + 1) * D)
        attention = model.model.layers[layer].self_attn
        if path == "value":

            def swap_v(m, a, o, layer=layer, cols=cols):
                o = o.clone()
                given = donor["v"][layer][at_cf, cols]
                o[0, at, cols] = given if scale == 1 else o[0, at, cols] + scale * (given - o[0, at, cols])
                return o

            hooks.append((attention.v_proj, "post", swap_v))
        elif path == "pattern":
            hooks.append(
                (attention.v_proj, "post", lambda m, a, o, layer=layer: live_v.__setitem__(layer, o[0]))
            )

            def swap_pattern(m, a, layer=layer, head=head, cols=cols):
                z = a[0].clone()
                z[0, :, cols] = donor["weights"][layer][head] @ live_v[layer][:, cols]
                return (z,)

            hooks.append((attention.o_proj, "pre", swap_pattern))
        else:

            def swap_output(m, a, layer=layer, cols=cols):
                z = a[0].clone()
                n = z.shape[1] - at
                z[0, at:, cols] = donor["z"][layer][at_cf : at_cf + n, cols]
                return (z,)

            hooks.append((attention.o_proj, "pre", swap_output))
    with hooked(hooks):
        return y_of(model, x, positive, negative)


@torch.no_grad()
def edge_y(model, x, x_cf, at, at_cf, receiver, sender: str, positive, negative) -> float:
    """y of x with `sender`'s write at p swapped on its one path into the receiver's value at p.
    sender: "embedding", "MLP j" or (j, h) for a head."""
    D = model.config.hidden_size // model.config.num_attention_heads
    clean, donor = recorded(model, x), recorded(model, x_cf)
    if sender == "embedding":
        delta = donor["input"][0][at_cf] - clean["input"][0][at]
    elif isinstance(sender, str):  # "MLP j"
        j = int(sender.split()[1])
        delta = donor["mlp"][j][at_cf] - clean["mlp"][j][at]
    else:
        j, h = sender
        z = clean["z"][j][at].clone()
        z_cf = z.clone()
        z_cf[h * D : (h + 1) * D] = donor["z"][j][at_cf, h * D : (h + 1) * D]
        o_proj = model.model.layers[j].self_attn.o_proj
        delta = o_proj(z_cf) - o_proj(z)
    layer, head = receiver
    block = model.model.layers[layer]
    v = block.self_attn.v_proj(block.input_layernorm(clean["input"][layer][at] + delta))
    cols = slice(head * D, (head + 1) * D)

    def swap_v(m, a, o):
        o = o.clone()
        o[0, at, cols] = v[cols]
        return o

    with ExitStack() as stack:
        stack.enter_context(hooked([(block.self_attn.v_proj, "post", swap_v)]))
        return y_of(model, x, positive, negative)
