"""Every attention kernel autoshard runs, chosen by the device: both paths on CPU, and an audit of the device one.

``collectives.on_host`` chooses: on CPU, torch's fused CPU attention kernel (``*_for_cpu``) with masks looked at on
the host; anywhere else (CUDA), the explicit path, SDPA under a mask of positions, and ids checked on the device.
Here both run on CPU (the device path by telling ``on_host`` that CPU is not the host), against SDPA on the whole
sequence. The audit: a second step of the device path (caches warm) dispatches no op that reads a value back to the
host (``.item()``, ``bool()``, ``torch.equal``, ``nonzero``) and calls none of autoshard's ``*_for_cpu`` kernels
(SDPA, which the device path calls, picks its own kernel by device): what a CUDA run would stall on, or not find.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.passes import collectives, ring_attention
from autoshard.passes.collectives import VocabParallelCrossEntropy, VocabParallelEmbedding
from autoshard.passes.ring_attention import GatheredCausalAttention, RingAttention

aten = torch.ops.aten
READ_BACK = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.nonzero.default}
B, H, T, D = 2, 4, 12, 8
# one rank's positions in its local order: three runs, as load balance and uneven splits give
POSITIONS = torch.cat([torch.arange(0, 4), torch.arange(8, 12), torch.arange(4, 8)])


class _Audit(TorchDispatchMode):
    found: list[str] = []
    on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READ_BACK:
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=["host", "device"])
def path(request, monkeypatch):
    _Audit.found = []
    if request.param == "device":
        monkeypatch.setattr(collectives, "HOST_DEVICES", ())
    for name in ("_FLASH", "_FLASH_BACKWARD"):  # autoshard's own calls of the CPU-only kernels, recorded
        kernel = getattr(ring_attention, name)
        monkeypatch.setattr(ring_attention, name, _recorded(kernel))
    return request.param


def _recorded(kernel):
    def call(*args, **kwargs):
        if _Audit.on:
            _Audit.found.append(str(kernel))
        return kernel(*args, **kwargs)

    return call


def _qkv(kv_heads: int = H, seq: int = T, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, len(POSITIONS), D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, seq, D, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v


def _grads(out: torch.Tensor, *inputs: torch.Tensor) -> list[torch.Tensor]:
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    return list(torch.autograd.grad(out, inputs, cotangent))


def _steps(run, inputs, path: str, fused: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Two steps (the second audited on the device path); the output and gradients of the second."""
    out = run(*inputs)
    _grads(out, *inputs)
    _Audit.on = True
    try:
        with _Audit():
            out = run(*inputs)
            grads = _grads(out, *inputs)
    finally:
        _Audit.on = False
    if path == "device":
        assert not _Audit.found, f"the device path reads back or runs a CPU-only kernel: {sorted(set(_Audit.found))}"
    elif fused:
        assert _Audit.found, "the host path did not take the fused CPU kernel"
    return out, grads


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [H, 2])
@pytest.mark.parametrize("padded", [False, True])
def test_ring_attention_kernels(path, causal, kv_heads, padded):
    q, k, v = _qkv(kv_heads)
    op = RingAttention(causal=causal, scale=None, layout=[POSITIONS], group=None, size=1, rank=0)
    keep = torch.ones(B, 1, 1, T, dtype=torch.bool)
    keep[0, ..., -3:] = False  # a padded row of the batch: its last keys never attended
    mask = keep if padded else None
    out, grads = _steps(lambda q, k, v: op(q, k, v, mask), (q, k, v), path)
    allowed = torch.ones(len(POSITIONS), T, dtype=torch.bool)
    if causal:
        allowed = POSITIONS[:, None] >= POSITIONS[None, :]
    if padded:
        allowed = allowed & keep[..., POSITIONS]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=kv_heads != H)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, _grads(want, q, k, v), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [H, 2])
def test_gathered_causal_attention_kernels(path, kv_heads):
    q, k, v = _qkv(kv_heads)
    op = GatheredCausalAttention(positions=POSITIONS, seq_len=T, scale=None, enable_gqa=kv_heads != H)
    out, grads = _steps(op, (q, k, v), path)
    allowed = POSITIONS[:, None] >= torch.arange(T)[None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=kv_heads != H)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, _grads(want, q, k, v), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_vocab_parallel_lookup_and_loss_kernels(path):
    ids = torch.tensor([[1, 9, 4], [0, 2, 7]])
    weight = torch.randn(10, 6, requires_grad=True)
    lookup = VocabParallelEmbedding(group=None, size=1, rank=0, vocab_start=0, vocab_end=10, num_embeddings=10)
    loss = VocabParallelCrossEntropy(group=None, size=1, rank=0, vocab_start=0, vocab_end=10, vocab_size=10,
                                     reduction="sum")
    target = torch.tensor([[2, -100, 9], [1, 3, 0]])

    def run(weight):
        return loss(lookup(ids, weight) @ weight.t(), target)

    out, grads = _steps(run, (weight,), path, fused=False)
    want = F.cross_entropy((F.embedding(ids, weight) @ weight.t()).reshape(-1, 10), target.reshape(-1),
                           reduction="sum")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], _grads(want, weight)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises((IndexError, RuntimeError), match="vocabulary"):
        lookup(torch.tensor([[10]]), weight)


# What the runtime makes on the host on purpose, by (file, function): each is read or written by the host alone.
HOST_MADE = {
    ("checkpoint.py", "_view"): "buffers the checkpoint's files are read into, copied to the parameters' device",
    ("checkpoint.py", "_tp_data_mesh"): "a DeviceMesh's layout of ranks, which torch keeps on the host",
    ("checkpoint.py", "_ep_tp_mesh"): "a DeviceMesh's layout of ranks, which torch keeps on the host",
    ("collectives.py", "local_indices"): "a list of indices for the host (``shard`` itself narrows, on the device)",
    ("ring_attention.py", "RingAttention.__init__"): "positions the host plans pieces by; copied to a device once",
    ("ring_attention.py", "GatheredCausalAttention.__init__"): "positions the host plans runs by; copied likewise",
}
CONSTRUCTORS = {"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint", "as_tensor"}


def _made_without_a_device(path):
    """``(function, line)`` of each ``torch.<constructor>(...)`` in ``path`` given no ``device=``."""
    import ast

    found = []

    def visit(node, name):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{name}.{child.name}" if name else child.name)
                continue
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and isinstance(child.func.value, ast.Name) and child.func.value.id == "torch"
                    and child.func.attr in CONSTRUCTORS and not any(k.arg == "device" for k in child.keywords)):
                found.append((name, child.lineno))
            visit(child, name)

    visit(ast.parse(path.read_text()), "")
    return found


def test_every_tensor_the_runtime_makes_is_on_the_models_device():
    """A tensor made without ``device=`` is on the host; under NCCL, a collective given one fails (or a CUDA
    kernel reads it, copying each step). Every tensor the runtime and its collectives make follows the model's
    device, but those ``HOST_MADE`` names, read by the host alone."""
    from pathlib import Path

    import autoshard

    root = Path(autoshard.__file__).parent
    import autoshard.passes as passes

    files = [*sorted((root / "runtime").glob("*.py")), Path(passes.__file__).parent / "collectives.py",
             Path(passes.__file__).parent / "ring_attention.py", Path(passes.__file__).parent / "expert_parallel.py"]
    made = {(path, function, line) for path in files for function, line in _made_without_a_device(path)}
    assert {(path.name, function) for path, function, _ in made} >= set(HOST_MADE), "a HOST_MADE name is stale"
    wrong = [f"{path.parent.name}/{path.name}:{line} in {function}()" for path, function, line in made
             if (path.name, function) not in HOST_MADE]
    assert not wrong, "made on the host, not on the model's device: " + ", ".join(sorted(set(wrong)))
