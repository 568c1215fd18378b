"""Pipeline partitioning and splitting without processes: valid cuts from structure, balance, exact stages."""

from __future__ import annotations

import pytest
import torch

from autoshard import codegen
from autoshard.capture import capture
from autoshard.passes.partition import PartitionError, partition
from autoshard.passes.pipeline_split import split_pipeline

from harness.models import ZOO_NAMES, build, build_gpt_model, token_loss


def _prepared(name: str):
    case = build(name)
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    return case, codegen.prepare(captured)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_stages_run_in_sequence_compute_the_whole_graph(name, stages):
    case, gm = _prepared(name)
    if name == "mlp" and stages > 3:  # three linears: a fourth stage would only compute the loss
        with pytest.raises(PartitionError, match=f"no cut into {stages} stages gives every stage a parameter"):
            partition(gm, stages)
        return
    cut = partition(gm, stages)
    pieces = split_pipeline(gm, cut.stage_of, stages)
    args = (*case.inputs, case.target)
    received: list = []
    for stage in pieces:
        received = list(stage.gm(*args, *received))
    torch.testing.assert_close(received[0], gm(*args)[0], rtol=0, atol=0)
    owners = [p for s in pieces for p in s.parameters]
    assert set(owners) == {n for n, _ in gm.named_parameters()}, "every parameter lives on some stage"
    assert all(s.parameters for s in pieces), "every stage holds a parameter to train"


def test_cuts_fall_on_the_residual_stream_between_blocks():
    case, gm = _prepared("gpt")
    cut = partition(gm, 2)
    stages = split_pipeline(gm, cut.stage_of, 2)
    assert len(stages[0].sends) == 1 and stages[0].send_specs[0].shape == (8, 16, 48), "one (B, T, hidden) value"
    assert cut.cut_after == ("add_2",), "after the second residual add: the end of block 0"
    tied = set(stages[0].parameters) & set(stages[1].parameters)
    assert tied == {"model.transformer.wte.weight"}, "the tied embedding and LM head live on both ends"


@pytest.mark.parametrize("stages", [2, 4])
def test_masks_and_positions_are_recomputed_not_sent(stages):
    """Only activations cross (float, one row per token); at pp=2 only the residual stream. At pp=4 the four
    layers, embedding and head of this model cannot be cut at layer ends into stages within 1.2x an even share of
    the parameters, so a stage ends inside a layer, and more than the residual stream crosses there."""
    case, gm = _prepared("hf_llama")
    split = split_pipeline(gm, partition(gm, stages).stage_of, stages)
    for stage in split[:-1]:
        assert all(s.dtype.is_floating_point and s.shape[:2] == (8, 16) for s in stage.send_specs), stage.sends
        if stages == 2:
            assert [s.shape for s in stage.send_specs] == [(8, 16, 48)], stage.sends


def test_balance_beats_equal_layers_on_a_deeper_gpt():
    model = build_gpt_model(n_layer=8, n_embd=64, n_head=4, vocab=512, seq=32)
    tokens = torch.zeros(4, 32, dtype=torch.long)
    gm = codegen.prepare(capture(model, (tokens,), loss_fn=token_loss, example_target=tokens))
    balanced = partition(gm, 4)
    equal = partition(gm, 4, starts=["model.transformer.h.2", "model.transformer.h.4", "model.transformer.h.6"])
    assert balanced.balance <= equal.balance
    assert balanced.balance < 1.35, balanced.costs


def test_more_stages_than_cuts_says_how_many_work():
    _, gm = _prepared("mlp")
    with pytest.raises(PartitionError, match=r"8 stages need 7 cuts, but the graph has only 5 .* at most 6 stages"):
        partition(gm, 8)


def test_a_start_module_without_a_cut_before_it_is_refused():
    _, gm = _prepared("gpt")
    with pytest.raises(PartitionError, match="no valid cut before module 'model.transformer.wte'"):
        partition(gm, 2, starts=["model.transformer.wte"])


def test_stages_can_start_at_the_models_own_module_names():
    _, gm = _prepared("gpt")
    assert partition(gm, 2, starts=["transformer.h.1"]).cut_after == partition(gm, 2).cut_after


def test_a_large_vocabulary_never_gets_a_stage_of_its_own_loss():
    """Between the LM head and the loss only one value crosses too, but it is the logits (vocab/hidden times
    the residual stream): the partitioner does not cut there to save the loss's few FLOPs."""
    model = build_gpt_model(n_layer=8, n_embd=128, n_head=4, vocab=32000, seq=64)
    tokens = torch.zeros(2, 64, dtype=torch.long)
    gm = codegen.prepare(capture(model, (tokens,), loss_fn=token_loss, example_target=tokens))
    for stages in (4, 8):
        cut = partition(gm, stages)
        assert set(cut.crossing_bytes) == {2 * 64 * 128 * 4}, (cut.cut_after, cut.crossing_bytes)


def test_a_model_with_one_trainable_layer_is_told_not_to_pipeline():
    gm = codegen.prepare(capture(torch.nn.Linear(8, 4), (torch.randn(2, 8),),
                                 loss_fn=lambda y, t: (y - t).pow(2).mean(), example_target=torch.randn(2, 4)))
    with pytest.raises(PartitionError, match=r"cannot be pipelined; train it without pp \(pp=1\)"):
        partition(gm, 2)


class _Routed(torch.nn.Module):
    """A mixture-of-experts block: a top-2 router whose integer picks select each token's experts."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(16, 4)
        self.experts = torch.nn.Parameter(torch.randn(4, 16, 16) / 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, picked = self.router(h).softmax(-1).topk(2, dim=-1)
        out = torch.einsum("nd,nkde->nke", h, self.experts[picked])
        return h + (out * weights.unsqueeze(-1)).sum(1)


def test_a_router_s_integer_picks_do_not_pin_every_later_cut():
    """The picks (no gradient) are recomputed where read; before, they counted as read by the loss, so the
    top-k's value crossed every later cut and a mixture of experts could only be cut after its last block."""
    model = torch.nn.Sequential(*[_Routed() for _ in range(4)], torch.nn.Linear(16, 4))
    x = torch.randn(12, 16)
    gm = codegen.prepare(capture(model, (x,), loss_fn=lambda y, t: (y - t).pow(2).mean(),
                                 example_target=torch.randn(12, 4)))
    part = partition(gm, 4)
    assert part.balance < 1.3, part.costs
    for stage in split_pipeline(gm, part.stage_of, 4):
        assert stage.parameters, "every stage holds experts"


def test_a_weight_read_on_both_sides_of_a_cut_is_held_by_both_stages():
    """MPNet hands every layer a relative position bias computed from one weight, so only cuts near the ends leave
    that weight on one side; a cut between layers has two stages hold it (their gradients summed), which balances
    the parameters. Each stage's parameter bytes and the largest share are reported."""
    import warnings

    from corpus.architectures import build as build_corpus

    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions

    shares = {}
    for balance in ("time", "both", "memory"):
        case = build_corpus("mlm/mpnet")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = compile_global_batch(case.model, case.inputs, Mesh(pp=2), 0,
                                         CompileOptions(microbatches=2, pipeline_balance=balance),
                                         target=case.target, loss_fn=case.loss_fn)
        part = built.partition
        assert len(part.param_bytes) == 2 and sum(part.param_bytes) > 0
        shares[balance] = part.largest_param_share
    # the cuts that balance it leave the bias's weight read on both sides (two stages hold it): their gradients
    # are summed over the two
    assert shares["memory"] <= shares["both"] <= 0.6 and shares["both"] <= shares["time"], shares


@pytest.mark.parametrize("name", ["s2s/t5", "gemma4_text", "recurrent_gemma"])
def test_a_weight_held_on_two_stages_counts_on_both_and_the_balance_sees_it(name):
    """T5's one embedding serves its encoder, decoder and head, so both pp=2 stages hold it: counting it only on
    its first reader's stage left the other at 0.61 of the parameters. Gemma 4 (keys shared across layers) and
    RecurrentGemma (few unlike layers) balance only at cuts where a transposed value crosses, which the receiver
    now lays out like the sender's."""
    import warnings

    from corpus.architectures import build as build_corpus

    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions

    case = build_corpus(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = compile_global_batch(case.model, case.inputs, Mesh(pp=2), 0, CompileOptions(microbatches=2),
                                     target=case.target, loss_fn=case.loss_fn)
    part = built.partition
    assert part.largest_param_share <= 0.6, part
    total = sum(p.numel() * p.element_size() for p in case.model.parameters() if p.requires_grad)
    assert part.total_param_bytes <= total
    if name == "s2s/t5":
        assert sum(part.param_bytes) > part.total_param_bytes, "the shared embedding counts on both stages"
    else:
        assert any(spec.order is not None for spec in built.stages[0].send_specs), "a transposed value crosses"


def test_a_transposed_value_is_received_laid_out_as_it_was_sent():
    from autoshard.passes.pipeline_split import TensorSpec

    value = torch.arange(24.0).view(2, 3, 4).transpose(1, 2)
    spec = TensorSpec.of(value)
    assert spec.order == (0, 2, 1)
    buffer, received = spec.allocate()
    buffer.copy_(spec.pack(value).view(buffer.shape))
    assert torch.equal(received, value) and received.stride() == value.stride()
    received.reshape(2, 12)  # what worked on the original works on the copy
    assert TensorSpec.of(value.contiguous()).order is None


@pytest.mark.parametrize("name", ["kimi_linear", "roc_bert"])
def test_the_default_balance_keeps_each_stage_within_its_parameter_share_where_a_cut_allows(name):
    """Balancing time alone leaves one pp=2 stage 0.74 (Kimi's linear-attention experts) or 0.64 (RoCBert's
    embeddings) of the parameters; the default holds every stage within 1.2x an even share (0.6) when cuts exist
    that do, trading some time balance for it."""
    import warnings

    from corpus.architectures import build as build_corpus

    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions

    shares = {}
    for balance in ("time", "both"):
        case = build_corpus(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = compile_global_batch(case.model, case.inputs, Mesh(pp=2), 0,
                                         CompileOptions(microbatches=2, pipeline_balance=balance),
                                         target=case.target, loss_fn=case.loss_fn)
        shares[balance] = built.partition.largest_param_share
    assert shares["both"] <= 0.6 < shares["time"], shares


def test_a_pipeline_balance_that_is_not_an_option_names_the_ones_that_are():
    from autoshard.options import CompileOptions

    with pytest.raises(ValueError, match="pipeline_balance='speed' is not an option: use 'both'"):
        CompileOptions(pipeline_balance="speed")


def test_a_v_placement_balances_each_ranks_two_stages_together():
    """Under ZBV and DualPipeV rank r runs stages r and S-1-r: the first and last stages (embedding, LM head)
    share a rank, so the cuts are moved until each rank's pair of stages costs about the same. An HF Llama of 8
    layers whose LM head (vocab 4096) costs about two layers: balanced per stage, rank 0 gets 1.35x rank 1's
    work; balanced per rank, within 2% (the cuts fall between ops)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=172, vocab_size=4096, use_cache=False)
    tokens = torch.randint(0, 4096, (2, 32))
    captured = capture(LlamaForCausalLM(config), (tokens,), example_target=tokens,
                       loss_fn=lambda out, t: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), t.flatten()))
    gm = codegen.prepare(captured)

    def ranks(part):
        return part.costs[0] + part.costs[3], part.costs[1] + part.costs[2]

    loop, v = ranks(partition(gm, 4, balance="time")), ranks(partition(gm, 4, balance="time", v_shape=True))
    assert max(loop) / min(loop) > 1.3 and max(v) / min(v) < 1.02 and max(v) < max(loop)


@pytest.mark.parametrize("balance", ["both", "time", "memory"])
def test_the_cuts_are_the_best_of_every_choice(balance):
    """The dynamic programme over every stage's score at once (a recurrent model has thousands of cuts to weigh)
    finds the least largest stage score, then the fewest bytes crossing, of all choices of cuts that leave every
    stage a weight; and the bytes each stage holds are the weights its nodes read, a tied one on every stage."""
    import itertools

    from autoshard.passes import partition as p

    _, gm = _prepared("gpt")
    order, dag = p._activation_dag(gm)
    memory = p._HeldBytes(gm, order)
    params = dict(gm.named_parameters())
    read = [{s.target for s in n.all_input_nodes if s.op == "get_attr" and s.target in params} for n in order]
    crossing = p._crossing_sets(order, dag)
    candidates = [i for i, c in enumerate(crossing[:-1]) if len(c) == 1][:16]
    bounds = [0, *(c + 1 for c in candidates), len(order)]
    held = memory.matrix(bounds)
    for a, b in itertools.combinations(range(len(bounds)), 2):
        names = set().union(*read[bounds[a]:bounds[b]])
        assert held[a, b] == memory(bounds[a], bounds[b]) == sum(
            params[n].numel() * params[n].element_size() for n in names)
    stages, weights = 4, p._weights_read(gm, order)
    nbytes = [sum(p._bytes(n) for n in c) for c in crossing]
    score = p._scores(p._costs(gm, order), memory, balance, stages)

    def largest(cuts):
        edges = [0, *(c + 1 for c in cuts), len(order)]
        if any(sum(weights[lo:hi]) == 0 for lo, hi in itertools.pairwise(edges)):
            return None
        return max(score(lo, hi) for lo, hi in itertools.pairwise(edges)), sum(nbytes[c] for c in cuts)

    every = [found for cuts in itertools.combinations(candidates, stages - 1) if (found := largest(cuts))]
    assert largest(p._balanced_cuts(score, candidates, nbytes, stages, weights)) == min(every)


@pytest.mark.parametrize("options", [{"microbatches": 2}, {"microbatches": 2, "schedule": "interleaved", "chunks": 2}],
                         ids=["1f1b", "interleaved"])
@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_what_a_stage_sends_each_rank_is_what_the_next_stage_receives(name, options):
    """Every stage of pp2 x cp2, compiled for every rank: what each cp rank's stage sends has the shapes its next
    stage receives on that cp rank. A stage hands its activations on split only where split plainly along one dim,
    as the next stage seeds what it receives; GPT-2's flattened tokens (``x.view(-1, h)``, split in blocks of the
    batch) were sent split to a stage that took them whole (interleaved, its cut inside an MLP: 256 KiB against
    128 KiB, and gloo aborted the processes)."""
    import autoshard
    from autoshard.options import CompileOptions
    from autoshard.planner.predict import CandidateCompiler

    case = build(name)
    builds = CandidateCompiler(case.model, case.inputs, case.target, case.loss_fn).builds(autoshard.Mesh(pp=2, cp=2),
                                                                                CompileOptions(**options))
    sent, received = {}, {}
    for per_cp in builds:
        for cp_rank, build_ in enumerate(per_cp):
            for stage, (got, out) in build_.local_specs.items():
                sent[cp_rank, stage] = [tuple(spec.shape) for spec in out]
                received[cp_rank, stage] = [tuple(spec.shape) for spec in got]
    pairs = [(key, (key[0], key[1] + 1)) for key in sent if (key[0], key[1] + 1) in received]
    assert len(pairs) == 2 * (len(received) // 2 - 1)
    for here, there in pairs:
        assert sent[here] == received[there], (here, sent[here], received[there])


@pytest.mark.parametrize("name", ["opt", "bert"])
def test_a_stage_after_cp_s_attention_sends_this_rank_s_part(name):
    """Interleaved over pp2 x cp2 the first cut of OPT and BERT follows an attention cp rewrote into its own
    module: what the stage sends (and the buffers its gradients come back into) has this cp rank's shape."""
    from corpus import build as corpus_build

    import autoshard
    from autoshard.options import CompileOptions
    from autoshard.planner.predict import CandidateCompiler

    case = corpus_build(name)
    builds = CandidateCompiler(case.model, case.inputs, case.target, case.loss_fn).builds(
        autoshard.Mesh(pp=2, cp=2), CompileOptions(microbatches=2, schedule="interleaved", chunks=2))
    for cp_rank in range(2):
        specs = {stage: got_sent for per_cp in builds for stage, got_sent in per_cp[cp_rank].local_specs.items()}
        for stage in range(3):
            assert [s.shape for s in specs[stage][1]] == [s.shape for s in specs[stage + 1][0]], (cp_rank, stage)


@pytest.mark.parametrize("options", [{}, {"cp_attention": "ring", "cp_load_balance": True},
                                     {"cp_attention": "alltoall"}], ids=["gathered", "ring", "alltoall"])
def test_cp_s_attention_under_tp_records_the_part_both_axes_leave(options):
    """Over tp2 x cp2 cp's attention module replaces an attention whose heads tp already split: its output is this
    rank's heads of this rank's tokens, what a stage cut after it would send (it had kept every token)."""
    from corpus import build as corpus_build

    import autoshard
    from autoshard import meta
    from autoshard.options import CompileOptions
    from autoshard.planner.predict import CandidateCompiler

    case = corpus_build("opt")
    gm = CandidateCompiler(case.model, case.inputs, case.target, case.loss_fn).builds(
        autoshard.Mesh(tp=2, cp=2), CompileOptions(**options))[0][0].programs[0].gm
    modules = [n for n in gm.graph.nodes if n.op == "call_module"
               and type(gm.get_submodule(n.target)).__name__ in ("GatheredCausalAttention", "RingAttention",
                                                                 "HeadsToSequence")]
    assert modules
    for node in modules:
        whole = meta.global_val(node).shape
        assert tuple(meta.val(node).shape) == (whole[0], whole[1] // 2, whole[2] // 2, whole[3]), node.name
