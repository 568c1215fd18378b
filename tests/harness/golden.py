"""Golden checks that run on every rank of a worker pool: the parallel program against the unsharded model.

Each function here is called by ``pool.run`` on every rank, builds the zoo model from a fixed seed (so
the reference and the parallel copy start from the same parameters) and returns plain data the test
asserts on.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoshard

from harness.launcher import GROUP_TIMEOUT
from harness.models import IGNORE_INDEX, build

_GROUPS: dict = {}


def groups_for(mesh: autoshard.Mesh):
    """This worker's process groups for ``mesh``, created once per worker (all ranks in the same order)."""
    if not dist.is_initialized():
        return None
    if mesh not in _GROUPS:
        _GROUPS[mesh] = mesh.create_groups(timeout=GROUP_TIMEOUT)
    return _GROUPS[mesh]


def golden(name: str, mesh_kwargs: dict, *, microbatches: int = 1, steps: int = 3, loss: str | None = None,
           eval_mode: bool = False, **options) -> dict:
    """``autoshard.verify`` on a zoo model: outputs, losses, gradients and parameters after ``steps`` steps.

    ``loss`` names a variant of the zoo's token loss (see ``LOSSES``): other cross-entropy arguments. ``eval_mode``:
    the model trained in eval mode (BatchNorm normalising with its running statistics)."""
    case = build(name)
    if eval_mode:
        case.model.eval()
    if loss is not None:
        case.loss_fn, case.target = LOSSES[loss](case.target)
    mesh = autoshard.Mesh(**mesh_kwargs)
    names = len(list(case.model.named_parameters(remove_duplicate=False)))
    report = autoshard.verify(
        case.model, mesh, case.inputs, case.loss_fn, target=case.target, steps=steps,
        microbatches=microbatches, groups=groups_for(mesh), **options,
    )
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences), "counts": report.counts(),
            "parameters": names, "steps": steps, "share": report.share}


def compiled(name: str, mesh_kwargs: dict, *, microbatches: int = 1, **options) -> dict:
    """The zoo model ``name`` with ``compile=True``: compared with the unsharded model over one step, then two more;
    the graphs compiled by the first step, and those compiled after it (none: the same shapes again)."""
    from autoshard.verify import compare

    case = build(name)
    reference = copy.deepcopy(case.model)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), microbatches=microbatches, compile=True,
                               **options)
    first = compare(reference, pm, case.inputs, case.target, loss_fn=case.loss_fn, steps=1)
    graphs = pm.compiler.graphs
    later = compare(reference, pm, case.inputs, case.target, loss_fn=case.loss_fn, steps=2)
    return {"ok": first.ok and later.ok, "report": f"{first}\n{later}", "graphs": graphs,
            "recompiled": pm.compiler.graphs - graphs, "explained": "torch.compile" in pm.explain()}


def check(results: list[dict], mesh: dict | None = None) -> None:
    """Assert a golden run on every rank: exact, and it compared every step's loss and every parameter's gradient
    and value. Under tp or pp (in ``mesh``) each rank also holds only part of the parameter bytes: a planner that
    silently shards nothing fails here (measured on the zoo: 0.50-0.56 at tp=2, 0.28-0.34 at tp=4, at most 0.88
    per pp rank)."""
    tp, pp = (mesh or {}).get("tp", 1), (mesh or {}).get("pp", 1)
    share_below = min(1.0, 1 / tp + 0.2) if tp > 1 or pp > 1 else None
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}:\n{result['report']}"
        counts, names = result["counts"], result["parameters"]
        assert names > 0 and counts["loss"] == result["steps"], (rank, counts)
        assert counts["grad"] == names and counts["param"] == names, f"rank {rank}: {counts}, {names} parameters"
        if share_below is not None:
            assert result["share"] < share_below, (
                f"rank {rank} holds {result['share']:.0%} of the parameter bytes at {mesh} (below {share_below:.0%} "
                "expected): the mesh sharded less than it should")


def _logits(output):
    return output.logits if hasattr(output, "logits") else output


def _cross_entropy(**arguments):
    def loss_fn(output, target):
        logits = _logits(output)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), **arguments)

    return loss_fn


def _ignoring(index: int):
    """Targets that ignore ``index``: the zoo's ignored positions hold it, and a few counted ones too (for 0)."""

    def variant(target: torch.Tensor):
        return _cross_entropy(ignore_index=index), torch.where(target == IGNORE_INDEX, index, target)

    return variant


def _scaled(scale: float, divide: bool = False):
    """The token loss scaled by a number, as a loop scales it for accumulation (``loss / steps``) or a weight."""

    def variant(target: torch.Tensor):
        def loss_fn(output, t):
            ce = _cross_entropy()(output, t)
            return ce / scale if divide else scale * ce

        return loss_fn, target

    return variant


def with_z_loss(target: torch.Tensor):
    """A cross-entropy mean inside a larger loss: plus a z-loss over every position's logits (PaLM's)."""

    def loss_fn(output, t):
        logits = _logits(output)
        return _cross_entropy()(output, t) + 1e-3 * logits.float().logsumexp(-1).pow(2).mean()

    return loss_fn, target


# name -> target -> (loss_fn, target): the cross-entropy arguments a vocab-parallel loss must keep, and the token
# loss scaled by numbers.
LOSSES = {
    "scaled": _scaled(2.0),
    "z_loss": with_z_loss,
    "accumulated": _scaled(4.0, divide=True),
    "ignore_minus_one": _ignoring(-1),
    "ignore_zero": _ignoring(0),
    "label_smoothing": lambda target: (_cross_entropy(label_smoothing=0.1), target),
    "amax": lambda target: (lambda output, t: _cross_entropy()(output, t) + 1e-3 * _logits(output).amax(), target),
    "smoothing_ignore_zero": lambda target: (_cross_entropy(label_smoothing=0.1, ignore_index=0),
                                             torch.where(target == IGNORE_INDEX, 0, target)),
}


def local_batch_step(name: str, mesh_kwargs: dict, **options) -> dict:
    """Each dp rank passes only its own slice of the batch (``local_batch=True``; every cp rank of a dp rank the
    same slice, at the whole sequence): the same loss and gradients as the unsharded model on the global batch."""
    case = build(name)
    reference = build(name).model
    mesh = autoshard.Mesh(**mesh_kwargs)
    groups = groups_for(mesh)
    rank = groups.coords["dp"]
    local = tuple(x.chunk(mesh.dp)[rank] for x in case.inputs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=local, loss_fn=case.loss_fn, local_batch=True,
                               groups=groups, **options)
    loss = pm.step(*local, target=case.target.chunk(mesh.dp)[rank])
    ref_loss = case.loss_fn(reference(*case.inputs), case.target)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-5)
    grads = pm.gradients()
    compared = 0
    for n, p in reference.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
        compared += 1
    return {"loss": loss.item(), "compared": compared}


def state_dict_round_trip(name: str, mesh_kwargs: dict) -> tuple[bool, bool]:
    """``pm.state_dict()`` loads into the unmodified model and gives its outputs."""
    case, fresh = build(name), build(name, seed=1).model
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh))
    state = pm.state_dict()
    expected = build(name).model.state_dict()
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(*case.inputs), build(name).model(*case.inputs), rtol=0, atol=0)
    return set(state) >= set(expected), all(state[k].shape == v.shape for k, v in expected.items())


class _NoBlocks(torch.nn.Module):
    """Norm -> convolution -> norm: nothing tp has a rule to split."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(12)
        self.conv = torch.nn.Conv1d(1, 1, 3, padding=1)
        self.out = torch.nn.LayerNorm(12)

    def forward(self, x):
        return self.out(self.conv(self.norm(x).unsqueeze(1)).squeeze(1))


class _LoneLinear(torch.nn.Module):
    """Norm -> linear -> norm: no column feeds a row, so the linear is split alone, by rows."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(12)
        self.proj = torch.nn.Linear(12, 12)
        self.out = torch.nn.LayerNorm(12)

    def forward(self, x):
        return self.out(self.proj(self.norm(x)))


def _mse(y, t):
    return (y - t).square().mean()


def no_blocks(tp: int, lone: bool = False) -> tuple[list[str], bool]:
    """A model with nothing to split (or only a linear split alone) still trains exactly at tp > 1; a warning says
    when nothing is split."""
    import warnings

    torch.manual_seed(0)
    model = _LoneLinear() if lone else _NoBlocks()
    x, t = torch.randn(4, 12), torch.randn(4, 12)
    mesh = autoshard.Mesh(tp=tp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = autoshard.verify(model, mesh, (x,), _mse, target=t, groups=groups_for(mesh))
    return [str(w.message) for w in caught if "autoshard" in str(w.message)], report.ok


class _PackedAttention(torch.nn.Module):
    """torch's MultiheadAttention where the query is not the key, so it cuts its packed in_proj apart: a cross
    attention of distinct query, key and value (three pieces) and a pooling head whose learned probe attends to the
    tokens (a piece for q, one for k and v together, unflattened into two parts)."""

    def __init__(self) -> None:
        super().__init__()
        self.cross = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        self.probe = torch.nn.Parameter(torch.randn(1, 1, 16))
        self.pool = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x, memory):
        x = x + self.cross(x, memory, memory + 1, need_weights=False)[0]
        pooled = self.pool(self.probe.expand(x.shape[0], -1, -1), x, x, need_weights=False)[0]
        return self.out(pooled[:, 0])


def packed_attention(tp: int) -> tuple[str, float]:
    """``autoshard.verify`` at ``tp`` on a model cutting its packed in_proj apart: (the report, if not exact; the
    share of the parameters a rank holds)."""
    torch.manual_seed(0)
    model = _PackedAttention()
    x, memory, t = torch.randn(4, 6, 16), torch.randn(4, 5, 16), torch.randn(4, 3)
    mesh = autoshard.Mesh(tp=tp)
    report = autoshard.verify(model, mesh, (x, memory), _mse, target=t, steps=2, groups=groups_for(mesh))
    return "" if report.ok else str(report), report.share


class _SelectiveScan(torch.nn.Module):
    """A Mamba-style mixer written the way a library with pluggable scan kernels writes it: the decay computed
    twice (once for a fused kernel that is absent), the scan's inputs cut along the sequence into the part scanned
    at once and the part stepped (``tensor_split``, here none stepped), an initial state made from the decay that
    nothing reads (``A.new_zeros``), a scan of one piece joined (``cat``), then a head."""

    def __init__(self, width: int = 32, inner: int = 64, state: int = 8, rank: int = 4, kernel: int = 4) -> None:
        super().__init__()
        self.rank, self.state = rank, state
        self.emb = torch.nn.Embedding(64, width)
        self.in_proj = torch.nn.Linear(width, 2 * inner)
        self.conv = torch.nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1)
        self.x_proj = torch.nn.Linear(inner, rank + 2 * state, bias=False)
        self.dt_proj = torch.nn.Linear(rank, inner)
        self.A_log = torch.nn.Parameter(torch.log(torch.arange(1, state + 1.0)).repeat(inner, 1))
        self.D = torch.nn.Parameter(torch.ones(inner))
        self.out_proj = torch.nn.Linear(inner, width, bias=False)
        self.head = torch.nn.Linear(width, 64, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        projected = self.in_proj(h).transpose(1, 2)
        A = -torch.exp(self.A_log.float())  # noqa: F841 - the fused kernel's argument, unused without it
        x, gate = projected.chunk(2, dim=1)
        x = F.silu(self.conv(x)[..., : ids.shape[1]])
        dt, B, C = torch.split(self.x_proj(x.transpose(1, 2)), [self.rank, self.state, self.state], dim=-1)
        dt = self.dt_proj.weight @ dt.transpose(1, 2)
        y = self._scan(x, dt, B, C, gate)
        return self.head(h + self.out_proj(y.transpose(1, 2)))

    def _scan(self, x, dt, B, C, gate):
        A = -torch.exp(self.A_log.float())
        length = x.shape[-1]
        x, _ = torch.tensor_split(x, [length], dim=2)
        dt, _ = torch.tensor_split(dt, [length], dim=2)
        unused = A.new_zeros(x.shape[0], *A.shape)  # noqa: F841 - the initial state of the stepped part
        dt = F.softplus(dt + self.dt_proj.bias[..., None])
        decay = torch.exp(A[None, :, None, :] * dt[..., None])
        inflow = dt[..., None] * B[:, None] * x[..., None]
        state = torch.zeros_like(inflow[:, :, 0])
        outs = []
        for t in range(length):
            state = decay[:, :, t] * state + inflow[:, :, t]
            outs.append(state @ C[:, t, :, None])
        y = torch.cat(outs, dim=-1) + x * self.D[None, :, None]
        return torch.cat([y * F.silu(gate)], dim=2)


def selective_scan(tp: int) -> tuple[str, float]:
    """``autoshard.verify`` at ``tp`` on ``_SelectiveScan``: (the report, if not exact; the share of the parameters a
    rank holds)."""
    report = _verify_on_tokens(_SelectiveScan, tp)
    return "" if report.ok else str(report), report.share


class _CycledWithoutGrad(torch.nn.Module):
    """HRM's recurrence: a state cycled through one block, the first pass under ``torch.no_grad()`` and the second
    with gradients, through the same weights; then a second block and the head."""

    def __init__(self) -> None:
        super().__init__()
        from harness.models import GPT, GPTConfig

        self.gpt = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab=64, seq=16, ffn=64))
        self.init = torch.nn.Parameter(torch.randn(32))

    def forward(self, ids):
        t = self.gpt.transformer
        x = t.wte(ids) + t.wpe(torch.arange(ids.shape[1]))
        state = self.init.expand_as(x).contiguous()
        with torch.no_grad():
            state = t.h[0](state + x)
        state = t.h[0](state + x)
        return self.gpt.lm_head(t.ln_f(t.h[1](x + state)))


def cycles_without_grad(tp: int, **options) -> tuple[str, float]:
    """``autoshard.verify`` at ``tp`` on a model that runs a block once without gradients, then again with them:
    (the report, if not exact; the share of the parameters a rank holds)."""
    report = _verify_on_tokens(_CycledWithoutGrad, tp, **options)
    return "" if report.ok else str(report), report.share


def _verify_on_tokens(make, tp: int, **options):
    """``autoshard.verify`` at ``tp``, 2 steps, of ``make()`` (seeded) on a batch of 2 x 16 ids below 64."""
    torch.manual_seed(0)
    model = make()
    ids, target = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    mesh = autoshard.Mesh(tp=tp)
    return autoshard.verify(model, mesh, (ids,), _cross_entropy(), target=target, steps=2, groups=groups_for(mesh),
                            **options)


class _SequenceSummary(torch.nn.Module):
    """A block's output summed over the sequence (a mean over positions, no parameter on the way) gating every
    token: the summary is whole on every rank while the tokens it gates are split by sequence parallelism."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.ln = torch.nn.LayerNorm(32)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 32, bias=False))
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.mlp(h)  # a block on the residual stream: its sum is reduce-scattered to the split tokens
        summary = self.down(torch.relu(self.up(self.ln(h)))).mean(dim=1, keepdim=True)
        return self.head(h * torch.sigmoid(summary))


def sequence_summary(tp: int, **options) -> str:
    """``autoshard.verify`` at ``tp`` on ``_SequenceSummary``: the report, if not exact."""
    report = _verify_on_tokens(_SequenceSummary, tp, **options)
    return "" if report.ok else str(report)


def explain(name: str, mesh_kwargs: dict, code: bool = False, **options) -> str:
    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    pm.step(*case.inputs, target=case.target)
    return pm.explain(code=code)


def warnings_of(name: str, mesh_kwargs: dict, **options) -> list[str]:
    """The warnings ``parallelize`` gives for this configuration."""
    import warnings

    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                              target=case.target, groups=groups_for(mesh), **options)
    return [str(w.message) for w in caught]


def clipped_adamw(name: str, mesh_kwargs: dict, **options) -> dict:
    """Three AdamW steps with global-norm clipping: the parallel and the unsharded model stay equal."""
    case = build(name)
    reference = build(name).model
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    params = list(pm.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, eps=1e-6) if params else None
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    norms = []
    for _ in range(3):
        if opt:
            opt.zero_grad()
        ref_opt.zero_grad()
        pm.step(*case.inputs, target=case.target)
        norm = pm.clip_grad_norm_(0.05)
        case.loss_fn(reference(*case.inputs), case.target).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        norms.append((norm.item(), ref_norm.item()))
        if opt:
            opt.step()
        ref_opt.step()
    full = pm.full_parameters()
    worst = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    return {"norms": norms, "worst": worst}


def checkpoint_round_trip(name: str, save_mesh: dict, load_mesh: dict, path: str, save_options: dict | None = None,
                          load_options: dict | None = None) -> float:
    """Save under one mesh, load under another (same world), compare parameters with the saved model's."""
    case = build(name)
    mesh = autoshard.Mesh(**save_mesh)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), microbatches=2, **(save_options or {}))
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    pm.step(*case.inputs, target=case.target)
    opt.step()
    saved = pm.full_parameters()
    pm.save_checkpoint(path)
    other = build(name, seed=7)
    mesh2 = autoshard.Mesh(**load_mesh)
    pm2 = autoshard.parallelize(other.model, mesh2, example_inputs=case.inputs, loss_fn=case.loss_fn,
                                target=case.target, groups=groups_for(mesh2), microbatches=2, **(load_options or {}))
    pm2.load_checkpoint(path)
    loaded = pm2.full_parameters()
    return max((saved[n] - loaded[n]).abs().max().item() for n in saved)


def bf16_losses(name: str, mesh_kwargs: dict) -> tuple[list[float], list[float]]:
    """Losses of three SGD steps in fp32 and under bf16 autocast (bf16 is close, not equal)."""
    mesh = autoshard.Mesh(**mesh_kwargs)
    runs = []
    for precision in (None, "bf16"):
        case = build(name)
        pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                                   target=case.target, groups=groups_for(mesh), mixed_precision=precision)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            losses.append(pm.step(*case.inputs, target=case.target).item())
            opt.step()
        runs.append(losses)
    return runs[0], runs[1]


class _CumulativeGPT(torch.nn.Module):
    """A GPT whose block adds a running mean over the sequence: an op no cp rule knows (cumsum)."""

    def __init__(self) -> None:
        super().__init__()
        from harness.models import build

        self.inner = build("gpt").model

    def forward(self, idx):
        h = self.inner.transformer.wte(idx)
        h = h + torch.cumsum(h, dim=1) / torch.arange(1, idx.shape[1] + 1).view(1, -1, 1)
        for block in self.inner.transformer.h:
            h = block(h)
        return self.inner.lm_head(self.inner.transformer.ln_f(h))


def token_mixing_op(cp: int) -> tuple[bool, list[str]]:
    """cumsum over the sequence under cp: gathered first, with a warning; the result stays exact."""
    import warnings

    from harness.models import build

    torch.manual_seed(0)
    model = _CumulativeGPT()
    case = build("gpt")
    mesh = autoshard.Mesh(cp=cp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = autoshard.verify(model, mesh, case.inputs, case.loss_fn, target=case.target, groups=groups_for(mesh))
    return report.ok, [str(w.message) for w in caught if "cp sharding rule" in str(w.message)]


class _ConvLM(torch.nn.Module):
    """A language model with no attention: a causal depthwise convolution and a recurrence written as RWKV writes
    its own (``out[:, t] = state`` into ``zeros_like``) mix the tokens; MLPs and the head work token by token."""

    def __init__(self, vocab: int = 64, width: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.conv = torch.nn.Conv1d(width, width, 3, padding=2, groups=width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, idx):
        h = self.embed(idx)
        h = h + self.conv(h.transpose(1, 2))[..., :idx.shape[1]].transpose(1, 2)
        state, out = torch.zeros_like(h[:, 0]), torch.zeros_like(h)
        for t in range(idx.shape[1]):
            state = 0.5 * state + h[:, t]
            out[:, t] = state
        h = h + out
        h = h + self.mlp(self.norm(h))
        return self.head(h)


def attention_free_model(cp: int, load_balance: bool) -> tuple[bool, list[str]]:
    """No attention takes the split: token-wise layers split, the convolution run whole, said once, exact."""
    import warnings

    torch.manual_seed(0)
    model = _ConvLM()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))

    def loss_fn(logits, t):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten())

    mesh = autoshard.Mesh(cp=cp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = autoshard.verify(model, mesh, (ids,), loss_fn, target=target, groups=groups_for(mesh),
                                  cp_load_balance=load_balance)
    return report.ok, [str(w.message) for w in caught if "no attention" in str(w.message)]


class MaskedDecoder(torch.nn.Module):
    """A decoder whose attention mask is one of the kinds real training uses, built in its graph from its inputs:
    ``causal`` (the flag), ``full`` (no mask), ``padding`` (an ``attention_mask`` input of 1s and 0s, with the
    causal rule), ``window`` (causal within ``WINDOW`` positions) and ``documents`` (a document-id input: causal
    inside one's own document; packed sequences of uneven lengths)."""

    WINDOW = 5
    KINDS = ("causal", "full", "padding", "window", "documents")

    def __init__(self, kind: str, vocab: int = 64, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.kind, self.heads = kind, heads
        self.embed = torch.nn.Embedding(vocab, width)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(width, 3 * width) for _ in range(layers))
        self.out = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.mlp = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                                           torch.nn.Linear(2 * width, width)) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab)

    def mask(self, extra: torch.Tensor, t: int):
        positions = torch.arange(t, device=extra.device)
        causal = positions[:, None] >= positions[None, :]
        if self.kind == "padding":
            return causal[None, None] & extra.bool()[:, None, None, :]
        if self.kind == "window":
            return causal & (positions[:, None] - positions[None, :] < self.WINDOW)
        if self.kind == "documents":
            return causal[None, None] & (extra[:, :, None] == extra[:, None, :])[:, None]
        return None

    def forward(self, idx, extra):
        b, t = idx.shape
        h = self.embed(idx)
        mask = self.mask(extra, t)
        for qkv, out, mlp in zip(self.qkv, self.out, self.mlp, strict=True):
            q, k, v = (x.view(b, t, self.heads, -1).transpose(1, 2) for x in qkv(h).chunk(3, dim=-1))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.kind == "causal")
            h = h + out(a.transpose(1, 2).reshape(b, t, -1))
            h = h + mlp(h)
        return self.head(h)


def masked_data(kind: str, batch: int = 4, seq: int = 16):
    """Token ids, the mask input of ``kind`` (padding: the last tokens of each sample; documents: ids of uneven
    runs), and targets that ignore padded positions."""
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 64, (batch, seq), generator=g)
    target = torch.randint(0, 64, (batch, seq), generator=g)
    extra = torch.ones(batch, seq, dtype=torch.long)
    if kind == "padding":
        for row, pad in enumerate((0, 3, 6, 1)[:batch]):
            extra[row, seq - pad:] = 0
            target[row, seq - pad:] = IGNORE_INDEX
    if kind == "documents":
        for row, lengths in enumerate(((5, 7, 4), (16,), (3, 3, 10), (9, 7))[:batch]):
            lengths = (*lengths[:-1], lengths[-1] + seq - 16)  # the last document takes the length's difference
            extra[row] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return idx, extra, target


def masked_golden(kind: str, mesh_kwargs: dict, seq: int = 16, **options) -> dict:
    """``autoshard.verify`` of ``MaskedDecoder(kind)`` on ``mesh_kwargs``, at sequence length ``seq``."""
    torch.manual_seed(0)
    model = MaskedDecoder(kind)
    idx, extra, target = masked_data(kind, seq=seq)
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(model, mesh, (idx, extra), _cross_entropy(ignore_index=IGNORE_INDEX), target=target,
                              groups=groups_for(mesh), **options)
    names = len(list(model.named_parameters()))
    pm = autoshard.parallelize(MaskedDecoder(kind), mesh, example_inputs=(idx, extra),
                               loss_fn=_cross_entropy(ignore_index=IGNORE_INDEX), target=target,
                               groups=groups_for(mesh), **options)
    modules = sorted({type(m).__name__ for build in pm.builds for m in build.program.gm.modules()})
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences), "counts": report.counts(),
            "parameters": names, "steps": 3, "share": report.share, "modules": modules}


class WrittenMaskDecoder(MaskedDecoder):
    """A decoder that builds what it reads by in-place writes, as models written outside transformers do: a
    sliding-window mask filled row by row with slice assignments (``fill_`` of views of a ``full(-inf)``, none of
    which has a user of its own), positions scaled in place, a mask widened by ``masked_fill_`` and a bias row set
    by ``index_put_``; logits soft-capped, so a lost write gives NaN (an all-masked row) rather than a small error."""

    def __init__(self, **sizes) -> None:
        super().__init__("window", **sizes)
        self.positions = torch.nn.Embedding(16, self.embed.embedding_dim)

    def mask(self, extra: torch.Tensor, t: int):
        mask = torch.full((t, t), float("-inf"), device=extra.device)
        for i in range(t):
            mask[i, max(0, i - self.WINDOW + 1):i + 1] = 0
        first = torch.zeros(t, t, dtype=torch.bool, device=extra.device)
        first[:, 0] = True  # every query also sees the first token (an attention sink)
        mask.masked_fill_(first, 0.0)
        return mask

    def forward(self, idx, extra):
        b, t = idx.shape
        steps = torch.arange(t, device=idx.device)
        steps.index_put_((torch.tensor([0], device=idx.device),), torch.tensor(1, device=idx.device))
        steps.sub_(1)  # position 0 and 1 share an embedding: the writes change what the table is read at
        h = self.embed(idx) + self.positions(steps)[None]
        mask = self.mask(extra, t)
        for qkv, out, mlp in zip(self.qkv, self.out, self.mlp, strict=True):
            q, k, v = (x.view(b, t, self.heads, -1).transpose(1, 2) for x in qkv(h).chunk(3, dim=-1))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            h = h + out(a.transpose(1, 2).reshape(b, t, -1))
            h = h + mlp(h)
        logits = self.head(h)
        return 30.0 * torch.tanh(logits / 30.0)


def _shifted_by_writes(output, target):
    """Cross-entropy against the next token, the labels shifted by an in-place write into a tensor of ignored
    ids (the loss's tokens are counted from a graph cut out of the capture: the write must be in it)."""
    labels = torch.full_like(target, IGNORE_INDEX)
    labels[:, :-1] = target[:, 1:]
    return F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def written_mask_golden(mesh_kwargs: dict, microbatches: int = 1, **options) -> dict:
    """``autoshard.verify`` of ``WrittenMaskDecoder`` with labels shifted in place: every in-place write kept where
    its value is read."""
    torch.manual_seed(0)
    model = WrittenMaskDecoder()
    idx, extra, target = masked_data("window")
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(model, mesh, (idx, extra), _shifted_by_writes, target=target,
                              microbatches=microbatches, groups=groups_for(mesh), **options)
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences), "counts": report.counts(),
            "parameters": len(list(model.named_parameters())), "steps": 3, "share": report.share}


class SmallResNet(torch.nn.Module):
    """Two residual blocks of conv -> BatchNorm -> ReLU over 8x8 images, pooled into a classifier (the convs
    without bias, as a BatchNorm follows each: a bias there has a gradient of zero, measured only as noise)."""

    def __init__(self, width: int = 8, classes: int = 5) -> None:
        super().__init__()
        conv = lambda a, b: torch.nn.Conv2d(a, b, 3, padding=1, bias=False)  # noqa: E731 - a BatchNorm follows
        self.stem = torch.nn.Sequential(conv(3, width), torch.nn.BatchNorm2d(width))
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(conv(width, width), torch.nn.BatchNorm2d(width), torch.nn.ReLU(), conv(width, width),
                                torch.nn.BatchNorm2d(width)) for _ in range(2))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, pixels):
        h = torch.relu(self.stem(pixels))
        for block in self.blocks:
            h = torch.relu(h + block(h))
        return self.head(h.mean(dim=(2, 3)))


def resnet_golden(mesh_kwargs: dict, **options) -> dict:
    """``autoshard.verify`` of ``SmallResNet`` in training mode, and its BatchNorm running statistics after the
    steps against the unsharded model's."""
    g = torch.Generator().manual_seed(5)
    pixels, target = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
    mesh = autoshard.Mesh(**mesh_kwargs)
    torch.manual_seed(0)
    report = autoshard.verify(SmallResNet(), mesh, (pixels,), F.cross_entropy, target=target,
                              groups=groups_for(mesh), **options)
    torch.manual_seed(0)
    model, reference = SmallResNet(), SmallResNet()
    reference.load_state_dict(model.state_dict())
    pm = autoshard.parallelize(model, mesh, example_inputs=(pixels,), loss_fn=F.cross_entropy, target=target,
                               groups=groups_for(mesh), **options)
    for _ in range(2):
        pm.step(pixels, target=target)
        F.cross_entropy(reference(pixels), target).backward()
    state, expected = pm.state_dict(), reference.state_dict()
    stats = [k for k in expected if "running" in k or "num_batches" in k]
    offs = {k: float((state[k].double() - expected[k].double()).abs().max()) for k in stats}
    off = max(offs.values())
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences), "counts": report.counts(),
            "parameters": len(list(SmallResNet().named_parameters())), "steps": 3, "share": report.share,
            "running_stats": len(stats), "stats_off": off, "worst_stat": max(offs, key=offs.get)}


class SharedBiasDecoder(MaskedDecoder):
    """A decoder whose attention adds a learned relative-position bias with fewer heads than attention has
    (``bias_heads`` columns, each shared by ``heads // bias_heads`` adjacent heads, T5-style buckets)."""

    def __init__(self, heads: int = 8, bias_heads: int = 2, buckets: int = 8) -> None:
        super().__init__("full", heads=heads)
        self.bias = torch.nn.Embedding(buckets, bias_heads)

    def mask(self, extra: torch.Tensor, t: int):
        positions = torch.arange(t, device=extra.device)
        buckets = (positions[None, :] - positions[:, None]).clamp(-4, 3) + 4  # (T, T) in [0, 8)
        bias = self.bias(buckets).permute(2, 0, 1)  # (bias heads, T, T)
        return bias.repeat_interleave(self.heads // self.bias.embedding_dim, dim=0)[None]  # (1, heads, T, T)


def shared_bias_golden(mesh_kwargs: dict, **options) -> dict:
    """``autoshard.verify`` of ``SharedBiasDecoder`` and where its plan put the bias table."""
    torch.manual_seed(0)
    idx, extra, target = masked_data("full")
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(SharedBiasDecoder(), mesh, (idx, extra), _cross_entropy(ignore_index=IGNORE_INDEX),
                              target=target, groups=groups_for(mesh), **options)
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences), "counts": report.counts(),
            "parameters": len(list(SharedBiasDecoder().named_parameters())), "steps": 3, "share": report.share}


class PatchViT(torch.nn.Module):
    """A vision transformer: no input carries a sequence; the tokens are an image's patches (a strided conv),
    torch's ``nn.TransformerEncoder`` attends over them, a mean over the tokens feeds the classifier. With
    ``class_token`` a learned token joins the 16 patches (17 tokens, as ViT's 197) and the classifier reads it."""

    def __init__(self, width: int = 32, heads: int = 4, classes: int = 5, class_token: bool = False) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(3, width, 4, stride=4)
        self.token = torch.nn.Parameter(torch.randn(1, 1, width) * 0.02) if class_token else None
        self.positions = torch.nn.Parameter(torch.randn(1, 16 + class_token, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, pixels):
        tokens = self.patches(pixels).flatten(2).transpose(1, 2)  # (B, 16, width)
        if self.token is None:
            return self.head(self.encoder(tokens + self.positions).mean(dim=1))
        tokens = torch.cat([self.token.expand(tokens.shape[0], -1, -1), tokens], dim=1) + self.positions
        return self.head(self.encoder(tokens)[:, 0])


def vision_golden(mesh_kwargs: dict, class_token: bool = False, **options) -> dict:
    """``autoshard.verify`` of ``PatchViT`` on 16x16 images: the sequence starts at the patch projection (or where
    the class token joins the patches)."""
    torch.manual_seed(0)
    model = PatchViT(class_token=class_token)
    g = torch.Generator().manual_seed(4)
    pixels, target = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(model, mesh, (pixels,), F.cross_entropy, target=target, groups=groups_for(mesh),
                              **options)
    pm = autoshard.parallelize(PatchViT(class_token=class_token), mesh, example_inputs=(pixels,),
                               loss_fn=F.cross_entropy, target=target, groups=groups_for(mesh), **options)
    modules = sorted({type(m).__name__ for build in pm.builds for m in build.program.gm.modules()})
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences), "counts": report.counts(),
            "parameters": len(list(model.named_parameters())), "steps": 3, "share": report.share,
            "modules": modules}


class _OddMLP(torch.nn.Module):
    """column -> an op no rule knows (cumsum over the hidden features) -> row."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(12, 32)
        self.down = torch.nn.Linear(32, 12)

    def forward(self, x):
        return self.down(torch.cumsum(torch.relu(self.up(x)), dim=-1) / 32)


def forced_tp_plan(tp: int) -> tuple[bool, list[str], str]:
    """A user's plan that shards through an op without a rule: gathered, warned, exact."""
    import warnings

    from autoshard.passes.placements import R, Shard
    from autoshard.plan import ParamPlan, TensorParallelPlan

    torch.manual_seed(0)
    model = _OddMLP()
    x, t = torch.randn(4, 12), torch.randn(4, 12)
    plan = TensorParallelPlan(tp, {
        "model.up.weight": ParamPlan(Shard(0), "column", "by hand"),
        "model.up.bias": ParamPlan(Shard(0), "column", "by hand"),
        "model.down.weight": ParamPlan(Shard(1), "row", "by hand"),
        "model.down.bias": ParamPlan(R, "replicated", ""),
    })
    plan = TensorParallelPlan.from_json(plan.to_json())
    mesh = autoshard.Mesh(tp=tp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = autoshard.verify(model, mesh, (x,), _mse, target=t, groups=groups_for(mesh), tp_plan=plan)
    return report.ok, [str(w.message) for w in caught if "sharding rule" in str(w.message)], str(report)


def timeline(name: str, mesh_kwargs: dict, **options) -> str:
    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    pm.step(*case.inputs, target=case.target)
    return pm.timeline()


def meta_then_checkpoint(name: str, mesh_kwargs: dict, path: str, **options) -> dict:
    """A model built on meta compiles, allocates only its shards, loads a checkpoint and trains exactly."""
    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    groups = groups_for(mesh)
    saver = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                                  target=case.target, groups=groups)
    saver.save_checkpoint(path)
    meta_case = build(name, device="meta")
    pm = autoshard.parallelize(meta_case.model, mesh, example_inputs=meta_case.inputs, loss_fn=case.loss_fn,
                               target=meta_case.target, groups=groups, **options)
    allocated = pm.materialize("cpu")
    pm.load_checkpoint(path)
    reference = build(name).model
    loss = pm.step(*case.inputs, target=case.target)
    ref_loss = case.loss_fn(reference(*case.inputs), case.target)
    ref_loss.backward()
    grads = pm.gradients()
    worst = max((grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
    full = sum(p.numel() * p.element_size() for p in reference.parameters())
    return {"loss": abs(loss.item() - ref_loss.item()), "grad": worst, "allocated": allocated, "full": full}


def odd_vocab(name: str, vocab: int, mesh_kwargs: dict) -> dict:
    """A vocabulary the tp degree does not divide (GPT-2's 50257): padded shards, exact results."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from harness.models import HIDDEN, MAX_POS, N_HEAD, N_LAYER, build_gpt_model, hf_token_loss, token_data, token_loss

    torch.manual_seed(0)
    if name == "hf_gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_positions=MAX_POS, n_embd=HIDDEN, n_layer=N_LAYER, n_head=N_HEAD,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model, loss_fn = GPT2LMHeadModel(cfg), hf_token_loss
    else:
        model, loss_fn = build_gpt_model(vocab=vocab), token_loss
    tokens, target = token_data(torch.Generator().manual_seed(1), vocab=vocab)
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(model, mesh, (tokens,), loss_fn, target=target, groups=groups_for(mesh))
    return {"ok": report.ok, "report": str(report)}


def checkpoint_of_another_model(path: str) -> str:
    """Loading a GPT checkpoint into a Llama-style model: a clear error before any collective."""
    gpt = build("gpt")
    mesh = autoshard.Mesh(tp=2)
    pm = autoshard.parallelize(gpt.model, mesh, example_inputs=gpt.inputs, loss_fn=gpt.loss_fn, target=gpt.target,
                               groups=groups_for(mesh))
    pm.save_checkpoint(path)
    llama = build("llama")
    other = autoshard.parallelize(llama.model, mesh, example_inputs=llama.inputs, loss_fn=llama.loss_fn,
                                  target=llama.target, groups=groups_for(mesh))
    try:
        other.load_checkpoint(path)
    except ValueError as e:
        return str(e)
    return "no error"


def one_rank_skips_a_step(seconds: float) -> str:
    """Rank 1 never joins step 1: rank 0 stops within the timeout with an error naming its peers."""
    return _rank_zero_alone("mlp", {"dp": 2}, seconds, lambda pm, case: pm.step(*case.inputs, target=case.target))


def only_rank_zero_gathers(seconds: float) -> str:
    """The idiom ``if rank == 0: torch.save(pm.state_dict(), path)``: rank 0 waits in a collective its peers never
    join; it stops within the timeout, saying every rank calls it."""
    return _rank_zero_alone("gpt", {"tp": 2}, seconds, lambda pm, case: pm.state_dict())


def _rank_zero_alone(name: str, mesh_kwargs: dict, seconds: float, call) -> str:
    """``call(pm, case)`` on rank 0 alone, under groups that time out after ``seconds``: what it raises."""
    import datetime

    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    groups = mesh.create_groups(timeout=datetime.timedelta(seconds=seconds))
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups)
    if dist.get_rank() == 1:
        return "skipped"
    try:
        call(pm, case)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def pipelined_gradient_buckets(name: str, mesh_kwargs: dict, bucket_bytes: int, **options) -> dict:
    """Pipelined dp with small gradient buckets: exact, and the buckets launch while the backward runs."""
    import copy

    from autoshard.runtime import reducer
    from autoshard.verify import compare

    reducer.BUCKET_BYTES, saved = bucket_bytes, reducer.BUCKET_BYTES
    try:
        case = build(name)
        reference = copy.deepcopy(case.model)
        mesh = autoshard.Mesh(**mesh_kwargs)
        pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                                   target=case.target, groups=groups_for(mesh), **options)
        report = compare(reference, pm, case.inputs, case.target, loss_fn=case.loss_fn)
    finally:
        reducer.BUCKET_BYTES = saved
    return {"ok": report.ok, "report": str(report), "timeline": pm.timeline()}


def _init_everything(module: torch.nn.Module) -> None:
    """A user's initialiser, applied module by module: every direct parameter from the global random stream."""
    for p in module.parameters(recurse=False):
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
        else:
            torch.nn.init.uniform_(p, -0.1, 0.1)


def _reset(module: torch.nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def meta_then_init(name: str, mesh_kwargs: dict, init: str = "function", **options) -> dict:
    """A model built on meta, its shards filled by its own initialisers: equal to the unsharded model's init."""
    reference_case = build(name)
    reference = reference_case.model
    fn = {"function": _init_everything, "reset": _reset}[init]
    torch.manual_seed(5)
    with torch.no_grad():
        reference.apply(fn)
    mesh = autoshard.Mesh(**mesh_kwargs)
    meta_case = build(name, device="meta")
    pm = autoshard.parallelize(meta_case.model, mesh, example_inputs=meta_case.inputs, loss_fn=meta_case.loss_fn,
                               target=meta_case.target, groups=groups_for(mesh), **options)
    buffers = dict(reference.named_buffers())
    torch.manual_seed(5)
    allocated = pm.materialize("cpu", buffers=buffers, init=True if init == "reset" else fn)
    full = pm.full_parameters()
    worst = max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    loss = pm.step(*reference_case.inputs, target=reference_case.target)
    ref_loss = reference_case.loss_fn(reference(*reference_case.inputs), reference_case.target)
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    return {"worst": worst, "loss": abs(loss.item() - ref_loss.item()), "allocated": allocated, "full": total}


def meta_init_that_misses_a_parameter(name: str, mesh_kwargs: dict) -> str:
    """init=True on a model with a parameter no reset_parameters() covers: a clear error, not garbage."""
    mesh = autoshard.Mesh(**mesh_kwargs)
    meta_case = build(name, device="meta")
    pm = autoshard.parallelize(meta_case.model, mesh, example_inputs=meta_case.inputs, loss_fn=meta_case.loss_fn,
                               target=meta_case.target, groups=groups_for(mesh))
    try:
        pm.materialize("cpu", buffers=dict(build(name).model.named_buffers()), init=True)
    except ValueError as e:
        return str(e)
    return "no error"


def inference_slices(name: str, mesh_kwargs: dict, **options) -> dict:
    """pm(x) under dp: equal to the unsharded outputs; which batch sizes this rank captured for inference."""
    case = build(name)
    reference = build(name).model
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    with torch.no_grad():
        out, expected = pm(*case.inputs), reference(*case.inputs)
    if hasattr(expected, "logits"):  # a HuggingFace output: its cache flattens differently
        out, expected = out.logits, expected.logits
    flat, ref_flat = torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(expected)
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(flat, ref_flat, strict=True)
                if isinstance(a, torch.Tensor))
    return {"worst": worst, "batches": sorted({b.captured.input_shapes[0][0] for b in pm.builds if not b.training}),
            "shapes_equal": [tuple(a.shape) == tuple(b.shape) for a, b in zip(flat, ref_flat, strict=True)
                             if isinstance(a, torch.Tensor)]}


def frozen_weights(name: str, mesh_kwargs: dict, frozen: list[str], **options) -> dict:
    """Fine-tuning: some weights frozen (requires_grad=False) in the model; the rest trains exactly."""
    case = build(name)
    for param_name, param in case.model.named_parameters():
        if any(param_name.startswith(f) for f in frozen):
            param.requires_grad_(False)
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(case.model, mesh, case.inputs, case.loss_fn, target=case.target,
                              groups=groups_for(mesh), **options)
    return {"ok": report.ok, "report": str(report)}


class _ShapeDependent(torch.nn.Module):
    """Reads ``extra`` only for batches larger than 4: a later capture brings a parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        return y + self.extra(x) if x.shape[0] > 4 else y


def fsdp_capture_with_new_parameters() -> str:
    torch.manual_seed(0)
    model = _ShapeDependent()
    mesh = autoshard.Mesh(dp=2)
    x, t = torch.randn(8, 8), torch.randn(8, 8)
    pm = autoshard.parallelize(model, mesh, example_inputs=(x,), loss_fn=_mse, target=t, groups=groups_for(mesh),
                               data_parallel="fsdp")
    pm.step(x, target=t)
    try:
        pm.step(torch.randn(16, 8), target=torch.randn(16, 8))
    except ValueError as e:
        return str(e)
    return "no error"


class _GrowsWithTheBatch(torch.nn.Module):
    """Three layers, and a fourth that only batches larger than 2 rows per microbatch read."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.extra = torch.nn.Linear(8, 8)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x + self.extra(x) if x.shape[0] > 2 else x


def later_capture_reads_more_parameters(mesh_kwargs: dict, **options) -> dict:
    """The first training graph (2 rows per microbatch) never reads ``extra``; a later one (4 rows) does. Its
    gradient is still summed over dp, so the parallel model stays equal to the unsharded one."""
    import copy

    from autoshard.verify import compare

    torch.manual_seed(0)
    model = _GrowsWithTheBatch()
    reference = copy.deepcopy(model)
    mesh = autoshard.Mesh(**mesh_kwargs)
    small, large = torch.randn(8, 8), torch.randn(16, 8)
    pm = autoshard.parallelize(model, mesh, example_inputs=(small,), loss_fn=_mse, target=torch.randn(8, 8),
                               groups=groups_for(mesh), **options)
    report = compare(reference, pm, (large,), torch.randn(16, 8), loss_fn=_mse)
    return {"ok": report.ok, "report": str(report)}


def what_pytorch_says(name: str, mesh_kwargs: dict, *, steps: int = 3, accumulate: int = 1, eval_first: bool = False,
                      look_for_unused: bool = False, unused_layer: bool = False, target_first: bool = True,
                      frozen: str | None = None, **options) -> dict:
    """A few training steps of zoo model ``name`` with every warning recorded on this rank: Python's warnings and
    what torch's C++ side writes to the process's stderr (DDP's reducer warns there). Optionally an evaluation
    first and ``accumulate`` steps per optimizer step; ``look_for_unused`` tells DDP that some parameter is unused
    whatever the graph shows (to see that the recording would catch DDP's warning). Returns the warnings, the stderr,
    the losses and the unsharded model's, and how far the parameters are from its after the steps. ``unused_layer``:
    the model holds a layer its forward never calls; without ``target_first`` the training graph is captured at the
    first step (no target passed to ``parallelize``)."""
    import os
    import sys
    import tempfile
    import warnings

    from autoshard.runtime import data_parallel

    unused = data_parallel.unused_parameters
    if look_for_unused:
        data_parallel.unused_parameters = lambda build, replica: ["(told)"]
    case = build(name)
    if unused_layer:
        case.model.unused = torch.nn.Linear(4, 4)
    for parameter_name, p in case.model.named_parameters():
        p.requires_grad_(frozen is None or frozen not in parameter_name)
    reference = copy.deepcopy(case.model)
    mesh = autoshard.Mesh(**mesh_kwargs)
    with tempfile.TemporaryFile() as err, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                                       target=case.target if target_first else None, groups=groups_for(mesh),
                                       **options)
            if eval_first:
                with torch.no_grad():
                    pm.eval()
                    pm(*case.inputs)
                    pm.train()
            losses, opt = [], None
            for _ in range(steps):
                for _ in range(accumulate):
                    losses.append(pm.step(*case.inputs, target=case.target).item())
                opt = opt or torch.optim.SGD(pm.parameters(), lr=0.1)  # the shards exist once a step captured them
                opt.step()
                opt.zero_grad()
        finally:
            data_parallel.unused_parameters = unused
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for _ in range(steps):
        for _ in range(accumulate):
            loss = case.loss_fn(reference(*case.inputs), case.target)
            loss.backward()
            expected.append(loss.item())
        ref_opt.step()
        ref_opt.zero_grad()
    trained = pm.full_parameters()
    worst = max((trained[n] - p).abs().max().item() for n, p in reference.named_parameters())
    return {"warnings": [f"{w.category.__name__}: {w.message}" for w in caught], "stderr": stderr,
            "losses": losses, "expected": expected, "worst": worst}
