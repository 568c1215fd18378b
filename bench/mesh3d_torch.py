"""The hand-written PyTorch 2x2x2 baseline: DTensor TP inside ``torch.distributed.pipelining`` stages, DP by hand.

What a user of PyTorch's own tools writes to train the zoo GPT on a ``dp x tp x pp`` mesh, and what
``bench/mesh3d.py`` times autoshard against:

- a ``DeviceMesh`` of shape ``(pp, dp, tp)`` (row-major, so the rank layout is autoshard's: tp innermost, pp
  outermost);
- tensor parallelism with ``bench/tp_dtensor.py``'s Megatron plan (``dtensor_tp_gpt``: fused-qkv permutation,
  per-rank head counts, the attention forward replaced, vocab-parallel embedding and LM head re-tied, the loss
  inside ``loss_parallel()``), applied over the ``tp`` sub-mesh;
- pipeline parallelism with ``PipelineStage`` + ``Schedule1F1B`` over the ``pp`` sub-mesh's group, the stages
  written by hand (``GPTStage`` of ``bench/pp_worker.py``: embeddings on the first stage, final norm and LM
  head on the last), equal layers per stage;
- the tied embedding / LM-head weight lives on both stages: its gradient shards are summed over the pp group
  after each step (the stages leave that to the user). On the first stage the vocab-parallel embedding's
  gradient comes back ``Replicate`` (the whole table) for its ``Shard(0)`` weight; it is cut to the weight's
  shard first (``_match_placements``), else the sum over the pp group pairs a whole table with a shard and
  gloo aborts (``Received data size doesn't match expected size``);
- data parallelism by hand: after the schedule, every local gradient shard is averaged over the ``dp`` group
  in one flat all-reduce (DDP cannot wrap a pipeline stage whose schedule calls backward itself).

The loss of each microbatch is its own mean (the schedule divides gradients by the number of microbatches);
``reference_loss`` is the unsharded model's loss under the same normalisation.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from pp_worker import GPTStage
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from tp_dtensor import dtensor_tp_gpt

from harness.models import token_loss


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _loss(logits, target: torch.Tensor) -> torch.Tensor:
    return token_loss(logits, target)


class TorchMesh3D:
    """One rank of the hand-written dp x tp x pp job: ``step()`` runs forward and backward of the global batch.

    ``model`` is the unsharded model (copied, then edited and sharded); ``mesh`` has dims ``("pp", "dp", "tp")``.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, microbatches: int) -> None:
        self.mesh = mesh
        self.pp, self.dp = mesh["pp"].size(), mesh["dp"].size()
        self.pp_rank, self.dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        layers = len(model.transformer.h)
        if layers % self.pp:
            raise ValueError(f"{layers} layers do not split equally into pp={self.pp} stages")
        edited = dtensor_tp_gpt(copy.deepcopy(model), mesh["tp"], vocab_parallel=True)
        per = layers // self.pp
        first, last = self.pp_rank == 0, self.pp_rank == self.pp - 1
        self.module = GPTStage(edited, range(self.pp_rank * per, (self.pp_rank + 1) * per), first, last)
        self.first, self.last = first, last
        stage = PipelineStage(self.module, self.pp_rank, self.pp, torch.device("cpu"), group=mesh["pp"].get_group())
        self.schedule = Schedule1F1B(stage, microbatches, loss_fn=_loss)
        self.tied = edited.transformer.wte.weight if (first or last) and self.pp > 1 else None
        self.losses: list = []

    def parameters(self) -> list[torch.Tensor]:
        return list({id(p): p for p in self.module.parameters()}.values())

    def step(self, tokens: torch.Tensor, target: torch.Tensor) -> None:
        """Forward and backward of this dp rank's slice of the global batch; gradients summed and averaged."""
        x, y = tokens.chunk(self.dp)[self.dp_rank], target.chunk(self.dp)[self.dp_rank]
        self.losses = []
        with loss_parallel():
            if self.first:
                self.schedule.step(x, return_outputs=False)
            elif self.last:
                self.schedule.step(target=y, losses=self.losses, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        self._match_placements()
        self._sum_tied()
        self._average_over_dp()

    def _match_placements(self) -> None:
        """Give every DTensor gradient its parameter's placements. The vocab-parallel embedding's gradient comes
        back ``Replicate`` (the whole table on every tp rank) for a ``Shard(0)`` weight; in the tp-only job the LM
        head's ``Shard(0)`` gradient is added to it, but on a first stage without the LM head it stays whole."""
        for p in self.parameters():
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)

    def _sum_tied(self) -> None:
        if self.tied is None:
            return
        if self.tied.grad is None:
            self.tied.grad = torch.zeros_like(self.tied)
        dist.all_reduce(local(self.tied.grad), group=self.mesh["pp"].get_group())

    def _average_over_dp(self) -> None:
        if self.dp == 1:
            return
        grads = [local(p.grad) for p in self.parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.mesh["dp"].get_group())
        flat /= self.dp
        for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(summed)

    def mean_loss(self) -> float | None:
        """This rank's mean microbatch loss of the last step (last stage only), else None."""
        if not self.losses:
            return None
        return sum(float(local(loss).detach()) for loss in self.losses) / len(self.losses)


def reference_loss(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor, pieces: int) -> torch.Tensor:
    """The unsharded model's loss normalised as the hand-written job does: the mean of ``pieces`` microbatch means."""
    losses = [token_loss(model(x), y) for x, y in zip(tokens.chunk(pieces), target.chunk(pieces), strict=True)]
    return sum(losses) / pieces
