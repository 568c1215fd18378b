"""Seeded one-line bugs and the tests that must catch each (run by ``make mutate``; see ``mutate.py``).

Every mutant is a bug of a kind that gives silently wrong training, or a test harness that would pass it:
a dropped argument, a missing collective, a wrong normaliser, an index off by one. ``original`` must occur
exactly once in ``file``; when the code it names is rewritten, update the entry (the runner reports it
as stale). ``tests`` are pytest node ids, the cheapest ones that catch the bug, run in order with ``-x``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    replacement: str
    why: str
    tests: tuple[str, ...]


TP = "tests/test_tensor_parallel.py::"
DP = "tests/test_data_parallel.py::"
PP = "tests/test_pipeline.py::"
CP = "tests/test_context_parallel.py::"
COMPOSED = "tests/test_composition.py::"
HARNESS = "tests/test_harness.py::"
LOSS_ARGS = TP + "test_the_vocab_parallel_loss_keeps_the_cross_entropy_arguments"
LOOP = "tests/test_training_loop.py::"
CLIPPING = COMPOSED + "test_global_norm_clipping_and_adamw_match_the_unsharded_model"

MUTANTS = (
    # ------------------------------------------------------------------ the four that once survived the suite
    Mutant("ce-label-smoothing", "passes/localize.py",
           'label_smoothing=arg(node, "label_smoothing"),', "label_smoothing=0.0,",
           "the vocab-parallel cross-entropy drops label_smoothing",
           (f"{LOSS_ARGS}[gpt-label_smoothing]", f"{LOSS_ARGS}[llama-smoothing_ignore_zero]")),
    Mutant("ce-ignore-index", "passes/localize.py",
           'ignore_index=arg(node, "ignore_index"),', "ignore_index=-100,",
           "the vocab-parallel cross-entropy drops a non-default ignore_index",
           (f"{LOSS_ARGS}[gpt-ignore_minus_one]", f"{LOSS_ARGS}[gpt-ignore_zero]")),
    Mutant("local-batch-cp-divisor", "autoshard/runtime/parallel_model.py",
           "return self._sum_over_data(local.float()) / self.mesh.cp", "return self._sum_over_data(local.float())",
           "local_batch=True under cp divides the loss by the token count cp times over",
           (f"{DP}test_local_batches_from_a_sharding_loader[gpt-cp2]",
            f"{DP}test_local_batches_from_a_sharding_loader[llama-dp2xcp2-balanced]")),
    Mutant("bf16-autocast-off", "autoshard/runtime/parallel_model.py",
           'bf16 = self.options.mixed_precision == "bf16"', "bf16 = False",
           "mixed_precision='bf16' silently runs in fp32",
           ("tests/test_mixed_precision.py::test_bf16_matches_eager_autocast[gpt-dp2]",)),
    # ------------------------------------------------------------------------------------ tensor parallelism
    Mutant("embedding-padding-idx", "passes/localize.py",
           "padding_idx=None if pad == -1 else pad, **rw.collective_args)", "padding_idx=None, **rw.collective_args)",
           "the vocab-parallel embedding rewrite drops padding_idx",
           ("tests/test_rules_embedding_loss.py::test_vocab_parallel_embedding_carries_padding_idx",)),
    Mutant("embedding-padding-row-gradient", "passes/collectives.py",
           "rows = F.embedding(local_ids, weight, padding_idx=local_pad)", "rows = F.embedding(local_ids, weight)",
           "the vocab-parallel lookup gives the padding row a gradient",
           ("tests/test_collectives.py::test_at_size_one_the_vocab_embedding_is_f_embedding",)),
    Mutant("embedding-vocab-range", "passes/collectives.py",
           "outside = (ids < self.vocab_start) | (ids >= self.vocab_end)",
           "outside = (ids < self.vocab_start) | (ids > self.vocab_end)",
           "the vocab-parallel lookup's range is off by one at its end",
           (f"{TP}test_golden_tensor_parallel[gpt-2]",)),
    Mutant("row-linear-no-all-reduce", "passes/localize.py",
           "out = rw.module(ReduceFromParallel(**rw.collective_args), (partial,), before=node, like=node)",
           "out = partial",
           "a row-parallel linear's partial sums are never all-reduced",
           (f"{TP}test_golden_tensor_parallel[gpt-2]",)),
    Mutant("copy-backward-no-all-reduce", "passes/collectives.py",
           "return _all_reduce(grad, ctx.group), None", "return grad, None",
           "Megatron's f does not sum its input gradient over tp in backward",
           (f"{TP}test_golden_tensor_parallel[llama-2]",)),
    Mutant("row-weight-shard-dim", "passes/tensor_parallel.py",
           "seeds = {_weight(node): Shard(1 - _LINEARS[node.target][2])}",
           "seeds = {_weight(node): Shard(_LINEARS[node.target][2])}",
           "a row-parallel weight is seeded split along the wrong dim (the planner then shards less or nothing)",
           (f"{TP}test_golden_tensor_parallel[gpt-2]", f"{TP}test_golden_tensor_parallel[mlp-2]")),
    Mutant("planner-shards-nothing", "passes/tensor_parallel.py",
           "    if size == 1:\n        return _finish(gm, plan, params)",
           "    if size >= 1:\n        return _finish(gm, plan, params)",
           "the tp planner replicates every parameter (exact, but nothing is sharded)",
           (f"{TP}test_golden_tensor_parallel[gpt-2]",)),
    Mutant("ce-backward-ignored-tokens", "passes/collectives.py",
           "grad *= torch.where(keep, scale, 0.0).unsqueeze(1)", "grad *= scale.unsqueeze(1)",
           "the vocab-parallel loss back-propagates into ignored targets",
           (f"{TP}test_golden_tensor_parallel[gpt-2]",)),
    # ------------------------------------------------------------------------------ data parallelism, losses
    Mutant("ddp-averages", "autoshard/runtime/data_parallel.py",
           "self._ddp.register_comm_hook(self.group, _sum_hook)", "pass",
           "DDP's default hook averages gradients over dp on top of the global-token normalisation",
           (f"{DP}test_golden_data_parallel[gpt-dp2-m1]",)),
    Mutant("dp-slice-of-rank-zero", "autoshard/runtime/parallel_model.py",
           'values = batching.split(values, self.mesh.dp)[self.coord("dp")]',
           "values = batching.split(values, self.mesh.dp)[0]",
           "every dp rank trains on the first dp rank's slice of the batch",
           (f"{DP}test_golden_data_parallel[gpt-dp2-m1]",)),
    Mutant("mse-normaliser", "autoshard/runtime/parallel_model.py",
           "return float(self.options.microbatches * self.mesh.dp)", "return float(self.options.microbatches)",
           "a mean loss without token counts is divided by the microbatches only, not by dp too",
           (f"{DP}test_golden_data_parallel[mlp-dp2-m1]",)),
    Mutant("token-count-per-shard", "autoshard/runtime/parallel_model.py",
           "return sum(count(*view) for view in views).float()",
           "return (count(*views[0]) * len(views)).float()",
           "the loss is normalised by one shard's counted tokens, not the global batch's",
           (f"{DP}test_golden_data_parallel[gpt-dp2-m2]",)),
    Mutant("pipelined-dp-no-sum", "autoshard/runtime/reducer.py",
           "bucket.work = dist.all_reduce(bucket.flat, group=group, async_op=True)", "bucket.work = None",
           "pipelined dp never sums its gradient buckets",
           (f"{COMPOSED}test_golden_composed[gpt-dp2xpp2]",)),
    Mutant("pipelined-dp-leftover", "autoshard/runtime/reducer.py",
           "        _launch(rest, self.group)\n", "",
           "pipelined dp skips the gradients of parameters that no bucket holds",
           (f"{COMPOSED}test_a_later_capture_with_more_parameters_still_sums_them_over_dp",)),
    Mutant("accumulation-overwrites", "autoshard/runtime/data_parallel.py",
           "grad.add_(p.grad)", "grad.copy_(p.grad)",
           "a second step() before optimizer.step() replaces the first step's gradients instead of adding to them",
           (f"{LOOP}test_gradient_accumulation_over_steps_equals_eager[dp2]",)),
    Mutant("eval-keeps-dropout", "autoshard/runtime/parallel_model.py",
           "self._compile(key, capture(self.model, inputs, training=self.training))",
           "self._compile(key, capture(self.model, inputs, training=True))",
           "pm.eval() inference still runs dropout",
           (f"{LOOP}test_eval_turns_dropout_off_and_train_turns_it_on[dp2]",)),
    Mutant("big-ids-accepted", "passes/input_checks.py",
           "bad = (values < 0) | (values >= self.size)", "bad = values < 0",
           "a token id or target past the vocabulary trains silently (another rank's id) instead of raising",
           (f"{LOOP}test_ids_and_targets_outside_the_vocabulary_raise_on_every_rank[pp2-big id]",
            f"{LOOP}test_ids_and_targets_outside_the_vocabulary_raise_on_every_rank[pp2-big target]")),
    # ---------------------------------------------------------------------------------- pipeline parallelism
    Mutant("empty-stage", "passes/partition.py",
           "if i < j and held[points[j] + 1] > held[points[i] + 1]", "if i < j",
           "the balanced partition may leave a stage that only computes the loss (no parameters to train)",
           (f"{PP}test_golden_pipeline[mlp-pp4-m4-1f1b]",
            f"{LOOP}test_a_tiny_head_leaves_no_pipeline_stage_without_parameters[pp2]")),
    Mutant("tied-gradient-sum", "autoshard/runtime/pipeline.py",
           "dist.all_reduce(grad, group=self.groups.across_pp(ranks))", "grad.add_(0)",
           "a weight tied across stages (embedding and LM head) does not sum its two gradients",
           (f"{PP}test_golden_pipeline[gpt-pp2-m4-1f1b]",)),
    Mutant("1f1b-warmup", "autoshard/runtime/schedules.py",
           "warmup = min(p - 1 - r, m)", "warmup = min(p - r, m)",
           "1F1B warms up one microbatch too many (more activations in flight than 1F1B's bound)",
           ("tests/test_schedules.py::test_1f1b_holds_at_most_p_minus_rank_microbatches",)),
    Mutant("interleaved-warmup", "autoshard/runtime/schedules.py",
           "warmup = min((v - 1) * per_round + 2 * (p - 1 - r), total)",
           "warmup = min((v - 1) * per_round + 2 * (p - r), total)",
           "interleaved 1F1B warms up two chunks too many",
           ("tests/test_schedules.py::test_interleaved_first_rank_holds_p_plus_p_minus_1_over_v_stages",)),
    Mutant("clip-replicated-twice", "autoshard/runtime/state.py",
           "weight = 1.0 if placement is not None else 1.0 / pm.mesh.tp", "weight = 1.0",
           "global-norm clipping counts a tp-replicated parameter once per tp rank",
           (f"{CLIPPING}[dp2xtp2]",)),
    Mutant("clip-tied-twice", "autoshard/runtime/state.py",
           "if target in tied and pp_index != min(tied[target]):",
           "if target in tied and pp_index not in tied[target]:",
           "global-norm clipping counts a tied weight once per stage that holds it",
           (f"{CLIPPING}[tp2xpp2]",)),
    # ------------------------------------------------------------------------ found running the corpus at pp
    Mutant("pp-in-place-received", "passes/pipeline_split.py",
           "if any(_writes_first_argument(user) and user.args[0] is source for user in source.users):",
           "if False:",
           "a stage updates its received activation (a leaf that requires grad) in place: one rank fails",
           (f"{LOOP}test_a_stage_that_updates_a_received_activation_in_place_is_exact[m1]",)),
    Mutant("no-grad-region-trains", "passes/propagate.py",
           """elif node.op == "call_function" and _grad_disabled(node):""",
           """elif node.op == "call_function" and False:""",
           "a region computed under no_grad counts as carrying gradients: a hidden loss is not refused",
           (f"{LOOP}test_a_model_that_hides_its_computation_from_the_capture_is_refused_on_every_rank[dp2]",)),
    Mutant("router-picks-read-by-loss", "passes/partition.py",
           "for reader in activation_readers(node, lambda n: n in position):",
           "for reader in node.users:",
           "a router's integer picks count as read by the loss: experts can only be cut after the last block",
           ("tests/test_partition.py::test_a_router_s_integer_picks_do_not_pin_every_later_cut",)),
    # ----------------------------------------------------------------------------------- context parallelism
    Mutant("cp-balanced-chunk", "passes/context_parallel.py",
           "second = torch.arange((2 * self.size - 1 - rank) * chunk, (2 * self.size - rank) * chunk)",
           "second = torch.arange((2 * self.size - 2 - rank) * chunk, (2 * self.size - 1 - rank) * chunk)",
           "load-balanced cp gives a rank the wrong second chunk (off by one chunk)",
           (f"{CP}test_golden_context_parallel_gather[gpt-2-balanced]",)),
    Mutant("cp-mask-diagonal", "passes/context_parallel.py",
           "positions[:, None] >= keys[None, :]", "positions[:, None] > keys[None, :]",
           "the cp causal mask of global positions leaves out the diagonal",
           (f"{CP}test_golden_context_parallel_gather[gpt-2-contiguous]",)),
    Mutant("ring-mask-diagonal", "passes/ring_attention.py",
           "s = s.masked_fill(qpos[:, None] < kpos[None, :], float(\"-inf\"))",
           "s = s.masked_fill(qpos[:, None] <= kpos[None, :], float(\"-inf\"))",
           "ring attention's causal mask of global positions leaves out the diagonal",
           (f"{CP}test_golden_context_parallel_ring[gpt-2-contiguous]",)),
    # ------------------------------------------------------------------------------------ the harness itself
    Mutant("verify-loose", "autoshard/verify.py",
           "RTOL = 1e-4", "RTOL = 1e-2",
           "verify's tolerance is loose enough to pass a gradient 0.1% wrong",
           (f"{HARNESS}test_a_perturbed_gradient_is_caught",)),
    Mutant("verify-empty-ok", "autoshard/verify.py",
           'compared_losses = self.counts()["loss"] > 0', "compared_losses = True",
           "a comparison that compared nothing passes",
           (f"{HARNESS}test_an_empty_comparison_is_not_a_pass",)),
    Mutant("verify-skips-unreported", "autoshard/verify.py",
           'report.differences.append(Difference(what.format(name), float("inf"), False, "(not reported)"))',
           "pass",
           "verify skips a parameter the parallel model does not report instead of failing",
           (f"{HARNESS}test_a_gradient_the_parallel_model_does_not_report_is_a_failure",)),
)
