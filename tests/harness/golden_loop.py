"""Per-rank checks of the parallel model driven as an ordinary training loop drives a model.

Each function runs on every rank of a worker pool (see ``launcher.py``) and returns plain data. They cover
what golden tests of single steps miss: gradient accumulation over several ``step()`` calls, switching
between ``train()`` and ``eval()``, data a tokenizer got wrong, a new input shape, a weight shared by
three uses on different pipeline stages, and a model whose cheapest cut leaves a stage without weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.verify import compare

from harness.golden import GROUP_TIMEOUT, groups_for
from harness.models import VOCAB, build, token_data, token_loss

TOL = {"rtol": 1e-4, "atol": 1e-5}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual.detach().float(), expected.detach().float(), **TOL,
                               msg=lambda m: f"{what}: {m}")


def _second_batch(case, seed: int = 11) -> tuple[tuple, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if case.name == "mlp":
        return (torch.randn_like(case.inputs[0]),), torch.randn_like(case.target)
    ids, target = token_data(gen)
    return (ids,), target


def accumulation(name: str, mesh_kwargs: dict, *, calls: int = 2, **options) -> dict:
    """``step()`` called ``calls`` times before ``optimizer.step()`` accumulates exactly as eager ``backward()``s."""
    case, reference = build(name), build(name).model
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    batches = [(case.inputs, case.target)] + [_second_batch(case, 11 + i) for i in range(calls - 1)]
    params = list(pm.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if params else None
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    compared = 0
    for _ in range(2):  # two optimizer steps, each over `calls` accumulated steps
        for inputs, target in batches:
            loss = pm.step(*inputs, target=target)
            ref_loss = case.loss_fn(reference(*inputs), target)
            ref_loss.backward()
            _close(loss, ref_loss, "loss")
        grads = pm.gradients()
        for n, p in reference.named_parameters(remove_duplicate=False):
            if p.grad is not None:
                _close(grads[n], p.grad, f"accumulated gradient of {n}")
                compared += 1
        if opt:
            opt.step()
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    full = pm.full_parameters()
    for n, p in reference.named_parameters(remove_duplicate=False):
        _close(full[n], p, f"parameter {n} after the optimizer steps")
    return {"compared": compared}


def eval_mode(name: str, mesh_kwargs: dict, **options) -> dict:
    """After training in train mode with dropout on, ``pm.eval()`` turns dropout off (and ``pm.train()`` on)."""
    torch.manual_seed(0)
    model = _dropout_gpt2()
    torch.manual_seed(0)
    reference = _dropout_gpt2()
    reference.load_state_dict(model.state_dict())
    case = build("hf_gpt2")
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn, target=case.target,
                               groups=groups_for(mesh), **options)
    params = list(pm.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if params else None
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):  # dropout draws differ between the two, so train on the eval-mode reference's gradient
        pm.step(*case.inputs, target=case.target)
        if opt:
            opt.step()
            opt.zero_grad()
    full = pm.full_parameters()
    with torch.no_grad():
        for n, p in reference.named_parameters():
            p.copy_(full[n])
    del ref_opt
    pm.eval()
    reference.eval()
    with torch.no_grad():
        first, second = pm(*case.inputs).logits, pm(*case.inputs).logits
        expected = reference(*case.inputs).logits
    _close(first, second, "two eval-mode calls")
    _close(first, expected, "eval-mode logits")
    pm.train()
    with torch.no_grad():
        a, b = pm(*case.inputs).logits, pm(*case.inputs).logits
    return {"train_mode_differs": (a - b).abs().max().item(), "training": pm.training}


def _dropout_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    from harness.models import FFN, HIDDEN, MAX_POS, N_HEAD, N_LAYER

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=MAX_POS, n_embd=HIDDEN, n_layer=N_LAYER, n_head=N_HEAD,
                     n_inner=FFN, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def bad_data(name: str, mesh_kwargs: dict, what: str, **options) -> str:
    """A step with an id or target outside the vocabulary raises the unsharded model's error on every rank."""
    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    ids, target = case.inputs[0].clone(), case.target.clone()
    bad = {"big id": (ids, 500), "negative id": (ids, -3), "big target": (target, VOCAB + 7),
           "negative target": (target, -5)}
    tensor, value = bad[what]
    tensor[-1, 3] = value  # in the last dp rank's slice only: every rank must still refuse
    try:
        pm.step(ids, target=target)
    except (IndexError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def ranks_differ(name: str, mesh_kwargs: dict, what: str, **options) -> str:
    """One rank given another model or another batch than its peers: refused on every rank, naming that rank. With
    ``local_batch``, each dp rank's own batch is what it should be given: trained."""
    case = build(name)
    rank = dist.get_rank()
    if what == "model" and rank == 1:
        with torch.no_grad():
            next(case.model.parameters())[0, 0] += 1e-3
    mesh = autoshard.Mesh(**mesh_kwargs)
    try:
        pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                                   target=case.target, groups=groups_for(mesh), **options)
        pm.step(*case.inputs, target=case.target)
        ids, target = case.inputs[0].clone(), case.target.clone()
        if rank == 1 and what == "another batch":
            ids[0, 0] = (ids[0, 0] + 1) % VOCAB
        if rank == 1 and what == "shuffled":
            ids, target = ids.flip(0), target.flip(0)
        if what == "local batch":  # each dp rank its own rows, alike on the ranks of one dp coordinate
            ids, target = ids + mesh.coords(rank)["dp"], target
            ids = ids % VOCAB
        pm.step(ids, target=target)
    except autoshard.AutoshardError as e:
        return f"{type(e).__name__}: {e}"
    return "trained"


def new_shape(name: str, mesh_kwargs: dict, seq: int, **options) -> str:
    """After training at one shape, a step at a shape the mesh cannot split fails alike on every rank."""
    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    pm.step(*case.inputs, target=case.target)
    ids, target = case.inputs[0][:, :seq], case.target[:, :seq]
    try:
        loss = pm.step(ids, target=target)
    except ValueError as e:
        return f"ValueError: {e}"
    reference = build(name).model
    _close(loss, case.loss_fn(reference(ids), target), f"loss at sequence {seq}")
    return "accepted"


class SharedThrice(nn.Module):
    """An encoder-decoder whose encoder embedding, decoder embedding and LM head are one tensor (T5-style)."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 48, ffn: int = 128) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab, hidden)
        self.enc = nn.ModuleList(_Block(hidden, ffn) for _ in range(2))
        self.dec = nn.ModuleList(_Block(hidden, ffn) for _ in range(2))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.shared.weight
        self.hidden = hidden

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.shared(ids)
        for block in self.enc:
            x = block(x)
        y = self.shared(ids.flip(1)) + x.mean(dim=1, keepdim=True)
        for block in self.dec:
            y = block(y)
        return self.head(y * self.hidden**-0.5)


class _Block(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def shared_thrice(mesh_kwargs: dict, **options) -> dict:
    """The weight used three times on different stages sums its gradient over every copy exactly once."""
    torch.manual_seed(0)
    model = SharedThrice()
    reference = SharedThrice()
    reference.load_state_dict(model.state_dict())
    ids, target = token_data(torch.Generator().manual_seed(2))
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(model, mesh, (ids,), token_loss, target=target, groups=groups_for(mesh), **options)
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences)}


class TinyHeadClassifier(nn.Module):
    """A classifier whose logits (4 classes) are far smaller than its hidden states: the cheapest cut is
    after the head, which would leave the last stage only the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(20, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                                    nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def tiny_head(mesh_kwargs: dict, **options) -> dict:
    """Every pipeline rank holds parameters, and the run equals the unsharded one."""
    torch.manual_seed(0)
    model = TinyHeadClassifier()
    gen = torch.Generator().manual_seed(3)
    x, target = torch.randn(8, 20, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    reference = TinyHeadClassifier()
    reference.load_state_dict(model.state_dict())
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(model, mesh, example_inputs=(x,), loss_fn=F.cross_entropy, target=target,
                               groups=groups_for(mesh), **options)
    held = sum(p.numel() for p in pm.parameters())
    report = compare(reference, pm, (x,), target, loss_fn=F.cross_entropy)
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences), "held": held}


class _ScaledBlock(nn.Module):
    """A residual block that first scales its input in place (``hidden *= layer_scalar``, as Gemma 4 does)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = nn.Buffer(torch.tensor([scale]))
        self.linear = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h *= self.scale
        return h + torch.tanh(self.linear(h))


class InPlaceAtTheCut(nn.Module):
    """Four scaled blocks; a pipeline cut before the third leaves the in-place update on a received value."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.Sequential(*[_ScaledBlock(0.5 + i / 4) for i in range(4)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def in_place_at_the_cut(mesh_kwargs: dict, **options) -> dict:
    """The run equals the unsharded one when a stage updates a received activation in place."""
    torch.manual_seed(0)
    model = InPlaceAtTheCut()
    reference = InPlaceAtTheCut()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(5)
    x, target = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(model, mesh, example_inputs=(x,), loss_fn=F.cross_entropy, target=target,
                               groups=groups_for(mesh), **options)
    report = compare(reference, pm, (x,), target, loss_fn=F.cross_entropy)
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences)}


class _Recompute(torch.autograd.Function):
    """``x @ weight`` computed without gradients and recomputed in backward, as reversible layers do."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        with torch.no_grad():
            return x @ weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        return grad @ weight.T, x.T @ grad


class HiddenFromCapture(nn.Module):
    """Two layers whose forward runs without gradients inside a custom autograd Function with its own backward
    (reversible layers' way): export alone would see no gradient path; kept whole, the Function's backward trains."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Parameter(torch.randn(16, 16) / 4), nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Recompute.apply(torch.tanh(_Recompute.apply(x, self.first)), self.second)


def hidden_from_capture(mesh_kwargs: dict, **options) -> dict:
    """``autoshard.verify`` of the model: losses, gradients and parameters after two steps."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(HiddenFromCapture(), mesh, (x,), F.mse_loss, target=x, steps=2,
                              groups=groups_for(mesh), **options)
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences)}


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=48, d_kv=12, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                   dropout_rate=0.0, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                   decoder_start_token_id=0, relative_attention_num_buckets=8)
    return T5ForConditionalGeneration(cfg)


class _Seq2Seq(nn.Module):
    """T5 called with encoder and decoder ids, returning its logits (the tied weight has three uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.t5 = _t5()

    def forward(self, ids: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=False).logits


def t5_shared(mesh_kwargs: dict, **options) -> dict:
    """HF T5 with its encoder embedding, decoder embedding and LM head tied: exact on the mesh.

    SGD at lr 0.02: at verify's 0.1 this tiny T5's second step turns fp32 rounding of tp's split matmuls (1e-7 in the
    parameters after one step) into 3e-5 on CPUs whose kernels round differently (AVX-512 FP16 / AMX ones here), and
    5e-5 after three; at 0.02 it stays at 1e-7. A gradient the tp ranks fail to sum differs at the first step."""
    torch.manual_seed(0)
    model = _Seq2Seq()
    ids, target = token_data(torch.Generator().manual_seed(2))
    decoder_ids = torch.roll(ids, 1, dims=1)
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(model, mesh, (ids, decoder_ids), token_loss, target=target, groups=groups_for(mesh),
                              optimizer=lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9), **options)
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences)}


def optimizer_groups(name: str, mesh_kwargs: dict, **options) -> dict:
    """Weight decay grouped by ``named_parameters()`` (none on biases and norms), as training scripts do; SGD, whose
    update is linear in the gradient, so a parameter in the wrong group shows as lr * decay * its value."""
    case, reference = build(name), build(name).model
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)

    def groups(named):
        named = list(named)
        decay = [p for n, p in named if p.dim() >= 2 and "ln" not in n and "norm" not in n]
        rest = [p for n, p in named if not (p.dim() >= 2 and "ln" not in n and "norm" not in n)]
        return [{"params": decay, "weight_decay": 0.5}, {"params": rest, "weight_decay": 0.0}]

    names = [n for n, _ in pm.named_parameters()]
    unknown = sorted(set(names) - {n for n, _ in reference.named_parameters(remove_duplicate=False)})
    opt = torch.optim.SGD(groups(pm.named_parameters()), lr=0.1)
    worst = _steps_beside(pm, case, reference, opt, torch.optim.SGD(groups(reference.named_parameters()), lr=0.1))
    return {"names": len(names), "unknown": unknown, "worst": worst}


def _steps_beside(pm, case, reference, opt, ref_opt, between=None, steps: int = 2) -> float:
    """``steps`` steps of ``pm`` with ``opt`` beside the unsharded ``reference`` with ``ref_opt`` (``between()`` after
    each backward, before the optimizers step); the worst parameter's difference after them."""
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        pm.step(*case.inputs, target=case.target)
        case.loss_fn(reference(*case.inputs), case.target).backward()
        if between is not None:
            between()
        opt.step()
        ref_opt.step()
    full = pm.full_parameters()
    return max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())


def optimizer_over_the_model(name: str, mesh_kwargs: dict, before: bool, **options) -> dict:
    """An optimizer over the user's own model (built before ``parallelize`` or after, as FSDP2 users write it), in
    groups from ``model.named_parameters()`` (weight decay on matrices alone), stepped with
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` between, as PyTorch loops write them: the worst
    parameter's difference from the unsharded run after two steps, and the groups' sizes as it holds them."""
    case, reference = build(name), build(name).model

    def groups(model):
        named = list(model.named_parameters())
        return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.5},
                {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    mesh = autoshard.Mesh(**mesh_kwargs)
    opt = torch.optim.AdamW(groups(case.model), lr=0.01) if before else None
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    opt = opt or torch.optim.AdamW(groups(case.model), lr=0.01)

    def clip():
        torch.nn.utils.clip_grad_norm_(case.model.parameters(), 0.05)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    worst = _steps_beside(pm, case, reference, opt, torch.optim.AdamW(groups(reference), lr=0.01), between=clip)
    mine = {id(p) for p in pm.parameters()}
    return {"worst": worst, "held": [len(g["params"]) for g in opt.param_groups],
            "all_mine": all(id(p) in mine for g in opt.param_groups for p in g["params"])}


def optimizer_stepped_before(name: str, mesh_kwargs: dict) -> str:
    """An optimizer that stepped the model's parameters before ``parallelize``: its state is of whole tensors."""
    case = build(name)
    opt = torch.optim.AdamW(case.model.parameters(), lr=0.01)
    case.loss_fn(case.model(*case.inputs), case.target).backward()
    opt.step()
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh))
    opt.zero_grad()
    pm.step(*case.inputs, target=case.target)
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return "stepped"


def the_models_own_object(name: str, mesh_kwargs: dict, **options) -> dict:
    """The user's model after training steps: refused when called or read (its weights are those from before),
    then, after ``pm.update_model()``, its outputs and ``state_dict()`` are the unsharded run's."""
    case, reference = build(name), build(name).model
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    untouched = torch.equal(case.model(*case.inputs), reference(*case.inputs))  # before training: as it was
    worst = _steps_beside(pm, case, reference, torch.optim.AdamW(pm.parameters(), lr=0.01),
                          torch.optim.AdamW(reference.parameters(), lr=0.01))
    refused = []
    for use in (lambda: case.model(*case.inputs), lambda: case.model.state_dict()):
        try:
            use()
        except RuntimeError as e:
            refused.append(str(e))
    pm.update_model()
    with torch.no_grad():
        out = (case.model(*case.inputs) - reference(*case.inputs)).abs().max().item()
    own, ref = case.model.state_dict(), reference.state_dict()
    state = max((own[k].float() - ref[k].float()).abs().max().item() for k in ref)
    return {"untouched": untouched, "worst": worst, "refused": refused, "out": out, "state": state,
            "keys": sorted(own) == sorted(ref)}


def torch_clip(name: str, mesh_kwargs: dict, **options) -> dict:
    """``torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm)`` in the loop, as PyTorch loops write it, against
    the same call on the unsharded model: the norms it returns and the parameters after two steps."""
    case, reference = build(name), build(name).model
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    norms = []

    def clip():
        norms.append((torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.05).item(),
                      torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05).item()))
    worst = _steps_beside(pm, case, reference, torch.optim.SGD(pm.parameters(), lr=0.5),
                          torch.optim.SGD(reference.parameters(), lr=0.5), between=clip)
    return {"norms": norms, "worst": worst}


def padded_batch(name: str, mesh_kwargs: dict, **options) -> dict:
    """A HuggingFace model given a right-padded batch and its ``attention_mask``, padding targets ignored."""
    case = build(name)
    ids, target = case.inputs[0], case.target.clone()
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 3, 0, 7, 1, 0, 5, 2]):  # uneven padding at the end of the rows
        if pad:
            mask[row, -pad:] = 0
            target[row, -pad:] = -100
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(case.model, mesh, (ids, mask), case.loss_fn, target=target, groups=groups_for(mesh),
                              **options)
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences)}


class _PicksAndPools(nn.Module):
    """Parameters the graph reads but the loss gets no gradient through: an indexer whose scores only pick
    positions (top-k indices), and a pooler whose output the loss ignores."""

    def __init__(self) -> None:
        super().__init__()
        self.indexer = nn.Linear(20, 1)
        self.body = nn.Sequential(nn.Linear(20, 32), nn.GELU(), nn.Linear(32, 24))
        self.pooler = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor):
        picked = self.indexer(x).squeeze(-1).topk(2, dim=-1).indices  # (B, 2)
        x = x.gather(1, picked.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, 2, 20)
        hidden = self.body(x)
        return hidden, self.pooler(hidden[:, 0])


def params_without_gradients(mesh_kwargs: dict, **options) -> dict:
    """Data parallelism over a model with parameters that get no gradient: exact, no DDP error."""
    torch.manual_seed(0)
    model = _PicksAndPools()
    gen = torch.Generator().manual_seed(4)
    x, target = torch.randn(8, 6, 20, generator=gen), torch.randn(8, 2, 24, generator=gen)
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(model, mesh, (x,), lambda out, t: F.mse_loss(out[0], t), target=target,
                              groups=groups_for(mesh), **options)
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences)}


# ------------------------------------------------------------------------------ the model's state, saved and loaded


def _train_one_step(pm, case) -> None:
    """One SGD step, so that the parallel model's parameters differ from the model it was built from."""
    params = list(pm.parameters())
    pm.step(*case.inputs, target=case.target)
    if params:
        torch.optim.SGD(params, lr=0.1).step()


def state_dict_keys(name: str, mesh_kwargs: dict, **options) -> dict:
    """``state.state_dict(pm)`` holds exactly the keys of ``model.state_dict()``, in its order, and loads with
    strict=True into the unmodified model (which then computes what the parallel model computes)."""
    from autoshard.runtime import state

    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    _train_one_step(pm, case)
    saved = state.state_dict(pm)
    expected = list(build(name).model.state_dict())
    fresh = build(name, seed=1).model
    fresh.load_state_dict(saved, strict=True)  # raises on any missing or unexpected key
    full = pm.full_parameters()
    for n, p in fresh.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(p.detach(), full[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    pm.load_state_dict(saved)
    try:  # as the model's own load_state_dict: an unexpected key is refused unless strict=False
        pm.load_state_dict({**saved, "not_in_the_model.weight": torch.zeros(1)})
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    pm.load_state_dict({**saved, "not_in_the_model.weight": torch.zeros(1)}, strict=False)
    return {"keys": list(saved), "expected": expected, "method": list(pm.state_dict()), "refused": refused}


def meta_hf_rotary(mesh_kwargs: dict, **options) -> dict:
    """An HF Llama built on meta: ``materialize()`` recomputes its rotary tables itself (no ``buffers=``); after
    loading the unsharded model's state dict it trains exactly, and its state dict loads strictly back."""
    from autoshard.runtime import state

    case, meta_case = build("hf_llama"), build("hf_llama", device="meta")
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(meta_case.model, mesh, example_inputs=meta_case.inputs, loss_fn=meta_case.loss_fn,
                               target=meta_case.target, groups=groups_for(mesh), **options)
    pm.materialize("cpu")
    pm.load_state_dict(case.model.state_dict())
    loss = pm.step(*case.inputs, target=case.target)
    expected = case.loss_fn(case.model(*case.inputs), case.target)
    fresh = build("hf_llama", seed=1).model
    fresh.load_state_dict(state.state_dict(pm), strict=True)
    # the model built on meta now holds the tensors its programs read (as a model built on the CPU shares them)
    reference = dict(case.model.named_buffers())
    tables = {n: (b - reference[n]).abs().max().item() for n, b in meta_case.model.named_buffers()}
    return {"loss": abs(loss.item() - expected.item()), "buffers": tables}


def meta_route(mesh_kwargs: dict, directory: str, **options) -> dict:
    """The meta route as a user takes it: an HF Llama built on meta and parallelized with CPU example inputs
    (`load_pretrained` before `materialize` refused), `materialize()`, `load_pretrained` of the unsharded model's
    files, two AdamW steps, an evaluation at the captured shape and at a new one, `save_pretrained`; against the
    unsharded model loaded from the same files and trained alike."""
    import os

    import torch.distributed as dist
    import transformers

    case, meta_case = build("hf_llama"), build("hf_llama", device="meta")
    if dist.get_rank() == 0:
        case.model.save_pretrained(os.path.join(directory, "start"))
    dist.barrier()
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(meta_case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)  # CPU inputs, meta model
    try:
        pm.load_pretrained(os.path.join(directory, "start"))
        early = "loaded into meta"
    except ValueError as e:
        early = str(e)
    pm.materialize()
    pm.load_pretrained(os.path.join(directory, "start"))
    reference = type(case.model).from_pretrained(os.path.join(directory, "start"))
    worst = _steps_beside(pm, case, reference, torch.optim.AdamW(pm.parameters(), lr=0.01),
                          torch.optim.AdamW(reference.parameters(), lr=0.01))
    shorter = tuple(t[:, :-3] for t in case.inputs)
    with torch.no_grad():
        evaluated = max((pm(*inputs).logits - reference(*inputs).logits).abs().max().item()
                        for inputs in (case.inputs, shorter))
    pm.save_pretrained(os.path.join(directory, "end"))
    dist.barrier()
    saved = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(directory, "end"))
    written = max((saved.state_dict()[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return {"early": early, "worst": worst, "evaluated": evaluated, "written": written}


def dropout_masks(mesh_kwargs: dict, steps: int = 2, **options) -> dict:
    """HF BERT with dropout 0.1 on its hidden states and on its attention probabilities, trained under ``mesh``
    (tp only: each rank runs the whole batch) next to the model run whole, both seeded alike before each step.

    A dropout of a value split over tp (heads, or the sequence under sequence parallelism) draws the whole value's
    mask from the stream the tp ranks share and keeps its part, so the masks, and so the losses, gradients and
    parameters, are the model's own; the replicated parameters stay bit-identical on every rank."""
    from transformers import BertConfig, BertForMaskedLM

    from harness.models import FFN, HIDDEN, MAX_POS, N_HEAD, hf_token_loss

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=N_HEAD,
                     intermediate_size=FFN, max_position_embeddings=MAX_POS, hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1, attn_implementation="eager")
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg)
    torch.manual_seed(0)
    reference = BertForMaskedLM(cfg)
    reference.load_state_dict(model.state_dict())
    ids, target = token_data(torch.Generator().manual_seed(1))
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(model, mesh, example_inputs=(ids,), loss_fn=hf_token_loss, target=target,
                               groups=groups_for(mesh), **options)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        loss = pm.step(ids, target=target)
        torch.manual_seed(100 + step)
        expected = hf_token_loss(reference(ids), target)
        expected.backward()
        _close(loss.detach(), expected.detach(), f"step {step}'s loss with dropout on")
        full = pm.gradients()
        for n, p in reference.named_parameters():
            _close(full[n], p.grad, f"step {step}'s gradient of {n} with dropout on")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
    full = pm.full_parameters()
    for n, p in reference.named_parameters():
        _close(full[n], p, f"parameter {n} after the steps")
    from autoshard.verify import _replicas_identical

    return {"losses": losses, "replicas_identical": _replicas_identical(pm)}


def spread_loop(name: str, mesh_kwargs: dict, **options) -> dict:
    """A corpus architecture whose weights are spread over the pp ranks, trained as scripts train: AdamW over two
    weight-decay groups built from ``named_parameters()`` by ``p.dim()``, two ``step()`` calls accumulated per
    optimizer step, global-norm clipping; against the model run whole. Returns the worst differences and the
    share of the parameter bytes this rank stores."""
    from corpus.architectures import build as build_corpus

    case, reference = build_corpus(name), build_corpus(name).model
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)

    def adamw(named):
        named = list(named)
        return torch.optim.AdamW([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
                                  {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)

    opt, ref_opt = adamw(pm.named_parameters()), adamw(reference.named_parameters())
    worst = {"loss": 0.0, "norm": 0.0}
    for _ in range(2):
        for _ in range(2):
            loss = pm.step(*case.inputs, target=case.target)
            ref_loss = case.loss_fn(reference(*case.inputs), case.target)
            ref_loss.backward()
            worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss.item()))
        norm = pm.clip_grad_norm_(0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        worst["norm"] = max(worst["norm"], abs(norm.item() - ref_norm.item()) / ref_norm.item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    full = pm.state_dict()
    worst["param"] = max((full[n] - p.detach()).abs().max().item() for n, p in reference.state_dict().items()
                         if n in full and p.is_floating_point())
    size = lambda p: p.numel() * p.element_size()  # noqa: E731
    share = sum(size(p) for p in pm.parameters()) / sum(size(p) for p in reference.parameters())
    return {**worst, "share": share, "spread": len(pm.latest.spread)}


class _FailsWhenAsked(torch.autograd.Function):
    """Times one; raises in its forward on the ranks in ``ASKED["fail"]`` (a stage's own error, on a rank that runs
    it). Not the identity as traced (a Function proven the identity is seen through at capture, its Python frozen
    as the rest of the model's is): kept whole, its forward runs each step."""

    @staticmethod
    def forward(ctx, x):
        if dist.is_initialized() and dist.get_rank() in ASKED["fail"]:
            raise ValueError("the stage's own error")
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad


ASKED = {"fail": ()}


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 3:
                x = _FailsWhenAsked.apply(x)
        return x


class _Attending(nn.Module):
    """Causal attention over (batch, 8 tokens, 16) and a projection, then the failing identity."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 16)
        return _FailsWhenAsked.apply(torch.tanh(self.out(y)))


def stage_failure(mesh_kwargs: dict, failing: tuple[int, ...] | None = None, attention: bool = False,
                  **options) -> dict:
    """A step in which the model's forward raises on the ranks ``failing`` (every rank: None): how long each rank
    took to end the step, and its error; then what a next step says (``after``). Under groups of its own: a rank that
    gave up a collective leaves them out of step."""
    import time

    torch.manual_seed(0)
    x = torch.randn(2, 8, 16) if attention else torch.randn(8, 16)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(_Attending() if attention else _Stack(), mesh, example_inputs=(x,),
                               loss_fn=F.mse_loss, target=x, groups=mesh.create_groups(timeout=GROUP_TIMEOUT),
                               **options)
    pm.step(x, target=x)
    ASKED["fail"] = tuple(range(dist.get_world_size())) if failing is None else failing
    start = time.perf_counter()
    try:
        pm.step(x, target=x)
        error = None
    except Exception as e:  # noqa: BLE001 - the error is the result
        error = f"{type(e).__name__}: {e}"
    finally:
        ASKED["fail"] = ()
    seconds = time.perf_counter() - start
    try:
        pm.step(x, target=x)
        after = None
    except Exception as e:  # noqa: BLE001 - the error is the result
        after = f"{type(e).__name__}: {e}"
    return {"seconds": seconds, "error": error, "after": after}


def eager_backward(name: str, mesh_kwargs: dict, **options) -> str:
    """The eager habit ``loss_fn(pm(x), y).backward()``: what it raises (or "trained" where it raises nothing)."""
    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    try:
        case.loss_fn(pm(*case.inputs), case.target).backward()
    except RuntimeError as e:
        return str(e)
    return "trained"


def metrics_of_a_step(name: str, mesh_kwargs: dict, trace: str | None = None, **options) -> dict:
    """Two steps with the ``autoshard`` logger at INFO: ``pm.metrics()`` after the second, the lines logged, and
    under pp the Chrome trace ``pm.timeline(trace=...)`` wrote."""
    import json
    import logging

    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    logger, lines = logging.getLogger("autoshard"), []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                                   target=case.target, groups=groups_for(mesh), **options)
        losses = [float(pm.step(*case.inputs, target=case.target)) for _ in range(2)]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    events = None
    if trace is not None and mesh.pp > 1:
        pm.timeline(trace=f"{trace}.json")  # every rank calls; rank 0 writes every rank's
        if dist.get_rank() == 0:
            with open(f"{trace}.json") as f:
                events = json.load(f)["traceEvents"]
    return {"metrics": pm.metrics(), "lines": lines, "losses": losses, "events": events,
            "tokens": case.inputs[0].numel()}


def generated(name: str, mesh_kwargs: dict, **options) -> dict:
    """``pm.generate`` against the unsharded model's own ``generate``: greedy tokens, and sampled ones under one
    seed, from a 6-token prompt; and how many inference shapes 10 new tokens captured (bucket 8: two)."""
    case, reference = build(name), build(name).model
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    prompt = case.inputs[0][:, :6]
    out = {"greedy": pm.generate(prompt, max_new_tokens=10, bucket=8).tolist()}
    with torch.no_grad():
        out["reference_greedy"] = reference.generate(prompt, max_new_tokens=10, do_sample=False).tolist()
    torch.manual_seed(7)
    out["sampled"] = pm.generate(prompt, max_new_tokens=10, bucket=8, do_sample=True, top_k=50).tolist()
    torch.manual_seed(7)
    with torch.no_grad():
        out["reference_sampled"] = reference.generate(prompt, max_new_tokens=10, do_sample=True, top_k=50).tolist()
    out["inference_shapes"] = sorted({k[0] for k in pm._builds if not k[2] and k[0] != (tuple(case.inputs[0].shape),)})
    return out


def _adapted(kind: str):
    """HF Llama with a PEFT adapter: LoRA (r=4) on q_proj and v_proj, or IA3 on k_proj, v_proj and down_proj."""
    from peft import IA3Config, LoraConfig, get_peft_model

    case = build("hf_llama")
    if kind == "lora":
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                            init_lora_weights=False)  # B not zero: the adapter changes the outputs from step 0
    else:
        config = IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                           init_ia3_weights=False)
    return case, get_peft_model(case.model, config)


def peft_adapter(kind: str, mesh_kwargs: dict, directory: str, **options) -> dict:
    """A PEFT model parallelized as it is: two AdamW steps beside the unsharded one (the worst trained parameter's
    difference), then ``pm.save_pretrained`` (rank 0 writes PEFT's own adapter files) read back by
    ``PeftModel.from_pretrained`` onto a fresh base model: the worst adapter weight's difference from the unsharded
    run's, and the files written."""
    import os

    from peft import PeftModel

    torch.manual_seed(0)
    case, model = _adapted(kind)
    torch.manual_seed(0)
    _, reference = _adapted(kind)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn, target=case.target,
                               groups=groups_for(mesh), **options)
    trained = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=0.01)
    worst = _steps_beside(pm, case, reference, opt, torch.optim.AdamW(trained, lr=0.01))
    pm.save_pretrained(directory)
    saved = pm.full_parameters()  # every rank gathers
    out = {"worst": worst, "trained": len(trained), "files": sorted(os.listdir(directory)) if os.path.isdir(directory)
           else []}
    if not dist.is_initialized() or dist.get_rank() == 0:
        loaded = PeftModel.from_pretrained(build("hf_llama").model, directory)
        adapters = {n: p for n, p in reference.named_parameters() if p.requires_grad}
        mine = dict(loaded.named_parameters())
        out["adapter"] = max((mine[n] - p.detach()).abs().max().item() for n, p in adapters.items())
        out["as_saved"] = all(torch.equal(mine[n], saved[n]) for n in adapters)  # bit-exact: what pm trained
        with torch.no_grad():
            out["outputs"] = (loaded(*case.inputs).logits - reference(*case.inputs).logits).abs().max().item()
    return out
