"""Gradient sums over the ranks that split the batch and the sequence (dp x cp), behind one interface.

A ``GradientSync`` is chosen once per parallel model from its options and mesh:

- ``Local``: one rank on dp x cp; nothing to sum.
- ``Replicas``: PyTorch's DistributedDataParallel, its buckets summed (not averaged) by a communication
  hook, because every loss term is already divided by the global batch's divisor. DDP looks for unused parameters
  (``find_unused_parameters``, a traversal of the autograd graph every step) only for a program that leaves some
  parameter without a gradient, as its graph shows (``unused_parameters``).
- ``PipelineReplicas``: under pipeline parallelism a rank runs many backwards per step, so DDP's
  contract does not hold; ``reducer.GradientReducer`` launches each bucket during the last backward that
  finishes it.
- ``FullyShard``: PyTorch's FSDP2 ``fully_shard`` over dp x cp (parameters, gradients and optimizer
  state sharded); under a pipeline the parameters stay gathered for the step and gradients are
  reduce-scattered after the last backward, as torch.distributed.pipelining does.

The *replica* is the module that holds this rank's parameters (its ``store``) and runs a given program.
"""

from __future__ import annotations

import contextlib
import inspect
import operator

import torch.distributed as dist
from torch import fx, nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.nn.parallel import DistributedDataParallel

from autoshard import codegen, peers
from autoshard.passes.propagate import reaching_output

# Buffers are built identically on every rank, so DDP need not broadcast them before every forward.
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


class Replica(nn.Module):
    """The module data parallelism wraps: this rank's parameters, and a forward that runs a given program."""

    def __init__(self, store: codegen.ParamStore) -> None:
        super().__init__()
        self.store = store
        self.sharded_data = False
        self.run = lambda gm: gm  # what runs a program: itself, or its compiled function (compile=True)

    def forward(self, gm: fx.GraphModule, *args):
        if self.sharded_data:  # fully_shard swaps the store's parameters: point the program at the current ones
            self.store.adopt(gm)
        return self.run(gm)(*args)


class GradientSync:
    """No sum: one rank on dp x cp. The base of the strategies, and the interface the parallel model calls."""

    sharded = False  # whether the parameters are sharded over dp x cp (FSDP2)

    def __init__(self, replica: Replica, group=None, pipeline=None, device_type: str = "cpu") -> None:
        self.replica = replica
        self.group = group
        self.pipeline = pipeline
        self.device_type = device_type
        self.reducer = None
        self.experts: tuple[str, ...] = ()  # parameters split over ep: summed over their replicas, not dp x cp
        self.experts_group = None  # the ranks holding this rank's experts (None when no other rank does)

    def prepare(self, build) -> None:
        """A build was compiled (its parameters are in the store)."""
        self.note_experts(build)

    def note_experts(self, build) -> None:
        if not self.experts:
            self.experts = tuple(sorted(name for name, _ in build.captured.gm.named_parameters()
                                        if build.layout(name).split_over_ep))

    def sum_experts(self) -> None:
        """Sum the gradients of the experts this rank holds over the ranks holding the same ones. Each already
        holds the gradient of every token routed to it (the all-to-alls carried them), from its group's ranks."""
        if self.experts_group is None:
            return
        for name in self.experts:
            param = self.replica.store.find(name)
            if param is not None and param.grad is not None:
                with peers.phase("gradient sync"):
                    peers.run(dist.all_reduce, param.grad, group=self.experts_group)

    def module(self, build=None) -> nn.Module:  # noqa: ARG002 - the strategies that configure per build read it
        """What runs the forward and backward of ``build``'s program without pipelining."""
        return self.replica

    def microbatch(self, last: bool):
        """The context of one microbatch's forward and backward (the last one triggers the sums)."""
        return contextlib.nullcontext()

    def begin_pipeline_step(self) -> None:
        pass

    def finish_pipeline_step(self) -> None:
        pass

    def abort(self) -> None:
        pass

    @contextlib.contextmanager
    def fresh_gradients(self):
        """Set aside the gradients of earlier ``step()`` calls and add them back after this step's sums.

        Every sum a step makes (over dp x cp, over tied copies on several pipeline ranks) must add this step's
        gradients only: a gradient that still holds an earlier, already summed step would be counted once per
        rank. So gradient accumulation over several steps equals eager ``backward()`` calls.
        """
        with _set_aside(self.replica.parameters()):
            yield


Local = GradientSync


class Replicas(GradientSync):
    """DistributedDataParallel over dp x cp, summing."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ddp: DistributedDataParallel | None = None
        self._finds = False  # whether the DDP wrapper looks for unused parameters
        self._unused: dict[int, bool] = {}  # id of a training build -> whether its program leaves some unused

    def prepare(self, build) -> None:
        self.note_experts(build)
        if build.training:
            self._unused[id(build)] = bool(unused_parameters(build, self.replica))

    def module(self, build=None) -> nn.Module:
        """DDP over this rank's replica, looking for unused parameters only when ``build``'s program leaves some
        (without, DDP would wait for their gradients; with them for no reason, it warns and walks the autograd graph
        every step). A build that needs the other setting makes a new wrapper (parameters broadcast again, as any
        DDP construction does): only where programs of both kinds run, one per input shape."""
        finds = self._unused.get(id(build), self._finds)
        if self._ddp is not None and finds != self._finds:
            self._ddp = None  # its reducer, dropped, takes its gradient hooks off the parameters
        if self._ddp is None:
            if self.experts:  # their gradients are not replicas' over dp x cp: summed by ``sum_experts``
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                    self.replica, [f"store.{name}" for name in self.experts])
            self._ddp = DistributedDataParallel(self.replica, process_group=self.group,
                                                find_unused_parameters=finds, **_NO_BUFFER_SYNC)
            self._ddp.register_comm_hook(self.group, _sum_hook)
            self._finds = finds
        return self._ddp

    def microbatch(self, last: bool):
        return self._ddp.no_sync() if self._ddp is not None and not last else contextlib.nullcontext()


class PipelineReplicas(GradientSync):
    """Replicas under a pipeline: gradients summed in buckets during the backwards that finish them."""

    def prepare(self, build) -> None:
        self.note_experts(build)
        if self.reducer is None and build.training:
            self.reducer = self.pipeline.reducer(build.programs, self.replica.store, self.group, self.experts)

    def finish_pipeline_step(self) -> None:
        self.reducer.finish((name, p) for name, p in self.replica.store.named_parameters() if name not in self.experts)
        self.sum_experts()

    def abort(self) -> None:
        if self.reducer is not None:
            self.reducer.reset()


class FullyShard(GradientSync):
    """FSDP2 over dp x cp: parameters, gradients and optimizer state sharded; the experts split over ep stay
    whole on their ep rank, as under DDP."""

    sharded = True
    _ignored: frozenset = frozenset()  # the experts FSDP2 leaves alone

    def prepare(self, build) -> None:
        self.note_experts(build)
        if not self.replica.sharded_data:
            if build.training:
                self._shard()
            return  # now, so that an optimizer built next holds the sharded parameters
        new = [name for name, p in self.replica.store.named_parameters()
               if not hasattr(p, "device_mesh") and p not in self._ignored]
        if new:
            raise ValueError(
                f"the capture at input shapes {build.captured.input_shapes} reads parameters no earlier capture read "
                f"({', '.join(new[:3])}{'...' if len(new) > 3 else ''}), and under data_parallel='fsdp' the "
                "parameters were sharded when the first training graph was captured: capture first with inputs "
                "that reach every parameter (pass that example target to parallelize), or use data_parallel='ddp'"
            )

    def _shard(self) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(self.group, self.device_type)
        # The experts split over ep are no replicas over dp x cp: FSDP2 leaves them alone (each ep rank holds its
        # own already), and ``sum_experts`` sums their gradients over the ranks holding the same ones.
        experts = self._ignored = {self.replica.store.find(name) for name in self.experts} - {None}
        # Under pipelining a stage runs one forward per microbatch: keep the parameters gathered for the step
        # rather than all-gathering them again for every microbatch (torchtitan's default too).
        fully_shard(self.replica, mesh=mesh, reshard_after_forward=self.pipeline is None,
                    ignored_params=experts or None)
        self.replica.set_custom_all_gather(_RecordedAllGather())  # FSDP2's own, seen by ``peers.recording``
        self.replica.set_custom_reduce_scatter(_RecordedReduceScatter())
        self.replica.set_gradient_divide_factor(1.0)  # losses are normalised globally: gradients are sums
        self.replica.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum
        self.replica.sharded_data = True

    def microbatch(self, last: bool):
        self.replica.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def begin_pipeline_step(self) -> None:
        """Keep unsharded gradients over the step's many backwards, reduce none yet."""
        self.replica.set_is_last_backward(False)
        self.replica.set_reshard_after_backward(False)
        self.replica.set_requires_gradient_sync(False)

    def finish_pipeline_step(self) -> None:
        """After the last backward: reduce-scatter the gradients and reshard (as torch.distributed.pipelining
        does, since no single backward is the step's last one). It calls FSDP2's own post-backward steps,
        private API that torch.distributed.pipelining uses the same way (torch 2.13)."""
        from torch.distributed.fsdp import fully_shard

        self.replica.set_is_last_backward(True)
        self.replica.set_reshard_after_backward(True)
        self.replica.set_requires_gradient_sync(True)
        state = fully_shard.state(self.replica)
        for fsdp_state in state._state_ctx.all_states:
            for group in fsdp_state._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        self.sum_experts()

    @contextlib.contextmanager
    def fresh_gradients(self):
        """FSDP2 adds each reduce-scattered gradient into the sharded gradient it keeps; the experts it leaves alone
        are summed over their replicas by ``sum_experts``, so their earlier steps' gradients are set aside."""
        with _set_aside(self._ignored):
            yield


class _RecordedAllGather(DefaultAllGather):
    """FSDP2's all-gather of the parameters, recorded (``peers.sent``) as autoshard's own collectives are."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        peers.sent("all_gather", input_tensor, group, phase="parameter gathers")
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _RecordedReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter of the gradients, recorded."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        peers.sent("reduce_scatter", input_tensor, group, phase="gradient sync")
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


@contextlib.contextmanager
def _set_aside(params):
    """Take the gradients ``params`` hold away for the block, then add them back to what it left."""
    earlier = {}
    for p in params:
        if p.grad is not None:
            earlier[p], p.grad = p.grad, None
    try:
        yield
    finally:
        for p, grad in earlier.items():
            if p.grad is not None:
                grad.add_(p.grad)
            p.grad = grad


def gradient_sync(replica: Replica, *, data_parallel: str, ranks: int, group, pipeline,
                  device_type: str) -> GradientSync:
    """The strategy for ``ranks`` = dp x cp ranks summing over ``group``; ``pipeline`` under pp, else None."""
    if ranks == 1:
        return Local(replica)
    kind = FullyShard if data_parallel == "fsdp" else PipelineReplicas if pipeline is not None else Replicas
    return kind(replica, group, pipeline, device_type)


def _sum_hook(group, bucket):
    """DDP communication hook that sums gradients (DDP's default divides by the group size)."""
    peers.sent("all_reduce", bucket.buffer(), group, phase="gradient sync")
    future = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(lambda f: f.value()[0])
    return peers.watched(future, group) if bucket.buffer().device.type == "cpu" else future


def unused_parameters(build, replica: Replica) -> list[str]:
    """The parameters of ``replica`` that take gradients and get none from ``build``'s programs: no program reads
    them (a head only inference uses, a layer the model defines and skips), or a program reads them without a
    differentiable path to the loss (a pooler whose output the loss ignores, a sparse-attention indexer that only
    picks positions). DDP must be told of them, or it waits for those gradients forever; told when there are none,
    it warns and walks the autograd graph every step for nothing."""
    used = set()
    for program in build.programs.values():
        gm = program.gm
        used |= {id(operator.attrgetter(n.target)(gm)) for n in reaching_output(gm) if n.op == "get_attr"}
    return [name for name, p in replica.named_parameters() if p.requires_grad and id(p) not in used]
