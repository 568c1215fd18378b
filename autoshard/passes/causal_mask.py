"""Attention under a causal mask the graph builds becomes ``is_causal=True``.

A model run eagerly often hands attention no mask at all (transformers skips it and asks the kernel for
``is_causal``); traced, the same code builds the mask in the graph, as a boolean ``(L, S)`` lower triangle from
``arange`` and comparisons, and every attention then reads it. The kernels take such a mask as data: on CPU each
layer converts it to an additive float mask of ``L x S`` and saves it for backward (4 bytes per query and key per
layer: 16 MiB for 4 layers at sequence 1024), and nothing skips the masked blocks.

A mask that depends on no value of the inputs (only on their shapes: ``new_ones``, ``ones_like``, sizes) is a
constant of the capture, which is keyed by shape. It is computed once here, and where it is the causal triangle
(allowed exactly where key <= query, for every batch and head it broadcasts to), attention is rewritten to take
no mask and ``is_causal=True``, which is what the model run whole computes. A mask that reads the inputs'
values (padding from an ``attention_mask``) or any other pattern is left as it is.
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard import meta
from autoshard.passes.writes import writers

aten = torch.ops.aten

# ops that read only the shape, dtype and device of their first input
_SHAPE_ONLY = {aten.new_ones.default, aten.new_zeros.default, aten.new_empty.default, aten.new_full.default,
               aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default, aten.full_like.default,
               aten.sym_size.int, aten.size.default}
_ATTENTION = aten.scaled_dot_product_attention.default


def causal_attention_pass(gm: fx.GraphModule) -> int:
    """Rewrite every attention whose mask is the constant causal triangle; returns how many were rewritten."""
    values: dict[fx.Node, torch.Tensor | None] = {}
    rewritten, masks = 0, []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _ATTENTION:
            continue
        args = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), node.args, strict=False))
        args.update(node.kwargs)
        mask = args.get("attn_mask")
        if not isinstance(mask, fx.Node) or args.get("is_causal"):
            continue
        q, k = meta.val(args["query"]), meta.val(args["key"])
        if q is None or k is None or q.shape[-2] != k.shape[-2]:
            continue
        value = _constant(gm, mask, values)
        if value is None or not _is_causal(value, q.shape[-2]):
            continue
        masks.append(mask)
        node.args = tuple(args[name] for name in ("query", "key", "value"))
        node.kwargs = {**{k2: v for k2, v in node.kwargs.items() if k2 != "attn_mask"},
                       "dropout_p": args.get("dropout_p", 0.0), "is_causal": True}
        rewritten += 1
    if rewritten:
        _erase_unread(gm, masks)
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _erase_unread(gm: fx.GraphModule, masks: list[fx.Node]) -> None:
    """Erase the ops that computed the masks and are read no more; the graph's inputs and the attributes it reads
    (a buffer only the mask used is still the model's, for its state and ``materialize``) stay."""
    pending = list(masks)
    while pending:
        node = pending.pop()
        if node.op == "call_function" and not node.users and not node._erased:
            inputs = node.all_input_nodes
            gm.graph.erase_node(node)
            pending.extend(inputs)


def _constant(gm: fx.GraphModule, node: fx.Node, values: dict) -> torch.Tensor | None:
    """``node``'s value when it depends on no input's values (computed from zeros of the inputs' shapes), else
    None."""
    if node in values:
        return values[node]
    values[node] = None  # until shown constant
    if node.op == "placeholder" or writers(node):
        return None  # a value written in place after its op (a mask built row by row) is not what the op computes
    if node.op == "get_attr":
        attr = getattr(gm, node.target, None)
        if isinstance(attr, torch.nn.Parameter) or not isinstance(attr, torch.Tensor):
            return None
        values[node] = attr
        return attr
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    schema = node.target._schema
    if schema.is_mutable or node.target is aten.dropout.default or "rand" in node.target.__name__:
        return None

    missing = []

    def value_of(a, shape_only: bool = False):
        if shape_only and isinstance(a, fx.Node) and isinstance(meta.val(a), torch.Tensor):
            val = meta.val(a)
            return torch.zeros(val.shape, dtype=val.dtype)
        got = _constant(gm, a, values)
        if got is None:
            missing.append(a)
        return got

    args = [fx.node.map_arg(a, lambda n, first=(i == 0): value_of(n, first and node.target in _SHAPE_ONLY))
            for i, a in enumerate(node.args)]
    kwargs = {key: torch.device("cpu") if key == "device" else fx.node.map_arg(a, value_of)
              for key, a in node.kwargs.items()}
    if missing:
        return None
    try:
        out = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that cannot run on these values leaves the mask as it is
        return None
    if not isinstance(out, torch.Tensor):
        return None
    values[node] = out
    return out


def _is_causal(mask: torch.Tensor, length: int) -> bool:
    """Whether ``mask`` (boolean: True where attention is allowed; or additive: 0 allowed, -inf or the dtype's
    lowest masked) allows
    exactly key <= query in every (L, L) slice it broadcasts to."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (length, length):
        return False
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        masked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)  # exp of either is exactly 0
        if not bool(((mask == 0) | masked).all()):
            return False
        allowed = mask == 0
    else:
        return False
    return bool((allowed == causal).all())
