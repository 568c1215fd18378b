"""Which tier each test runs in: ``quick`` (every change), the CI tier (``make test``) and ``full`` (everything).

The CI tier is every test but those marked ``full``: one path per test and each axis value once; the cross products
run in the full tier. Every parametrized test (a distributed matrix on the worker pools, a single-process matrix, the
corpus sample alike) runs its first cell in CI, then, in collection order, each cell that runs a feature no CI cell
before it ran, anywhere in the suite: a value of one of ``AXES`` (a mesh, an axis's degree or strategy, a pipeline
schedule, a microbatch count; a parameter or an entry of an ``options`` parameter) or, on the worker pools, a zoo model
(``models.ZOO_NAMES``, and the image models of ``models.CONV_NAMES``). So every mesh, axis value, schedule and zoo
model runs at least once in CI, in the first test that brings it. The CI tier does not run each test at each mesh,
and of the architectures outside the zoo (the corpus sample's families, golden_gqa's styles, the mixtures of experts)
it runs only those the rule or a pin keeps.
The rest of each matrix is marked ``full``; a cell its own file marks ``full`` stays there; single tests stay in CI.
The covering is of what was collected: ``-m "not full"`` on one file covers that file alone and runs more of it.
Pinned to the CI tier whatever the covering says, and counted as covering what they run: every test a seeded bug of
``mutations.py`` names (so ``make mutate`` judges the tier CI runs), the ``quick`` tier (it stays part of CI),
``NOT_QUICK``, and ``KEEP``: the cells the notes of ``FULL_ONLY`` name as covers. ``FULL_ONLY`` lists the tests and
cells moved out by hand, each with what in the CI tier covers its code path.

``quick`` is the single-process files (rules, planner, schedules, partition, options, CLI) plus ``QUICK_GOLDENS``:
one golden per axis on 2 ranks, less ``NOT_QUICK``: the few tests of those files that take seconds of processes.
"""

from __future__ import annotations

import pytest

from harness.models import CONV_NAMES, ZOO_NAMES
from harness.mutations import MUTANTS

QUICK_FILES = {
    "test_rules_views.py", "test_rules_layers.py", "test_rules_embedding_loss.py", "test_schedules.py",
    "test_planner.py", "test_partition.py", "test_mesh.py", "test_cost.py", "test_cli.py", "test_inspect_cli.py",
    "test_split_backward.py", "test_cutting_inputs.py", "test_capture.py", "test_models.py", "test_tiers.py",
    "test_layers.py", "test_job_plan.py", "test_kernels.py",
    "test_checkpoint_trust.py", "test_planner_profile.py",
}
QUICK_GOLDENS = {
    "tests/test_tensor_parallel.py::test_golden_tensor_parallel[gpt-2]",
    "tests/test_data_parallel.py::test_golden_data_parallel[gpt-dp2-m2]",
    "tests/test_pipeline.py::test_golden_pipeline[gpt-pp2-m4-1f1b]",
    "tests/test_context_parallel.py::test_golden_context_parallel_gather[gpt-2-balanced]",
    "tests/test_sequence_parallel.py::test_golden_sequence_parallel[gpt-2]",
    "tests/test_lost_writes.py::test_a_model_that_builds_its_mask_and_labels_by_writes_is_exact[pp2]",
}
# tests of the quick files that run in the CI tier only (each takes seconds of processes or a whole collection)
# -> what quick runs of the same code
NOT_QUICK = {
    "tests/test_tiers.py::test_every_mutants_tests_are_in_the_ci_tier_and_quick_has_a_golden_per_axis":
        "test_every_mutants_original_text_is_in_its_file_once (a collection of the whole suite takes seconds)",
    "tests/test_planner_profile.py::test_mesh_auto_calibrating_its_own_ranks_trains_exactly_on_the_mesh_it_chose":
        "test_mesh_auto_from_a_profile_trains_exactly_on_the_mesh_it_chose (the same choice read from a profile)",
    "tests/test_partition.py::test_a_weight_held_on_two_stages_counts_on_both_and_the_balance_sees_it"
    "[recurrent_gemma]": "the same test's gemma4_text and s2s/t5 cells",
    "tests/test_partition.py::test_a_weight_read_on_both_sides_of_a_cut_is_held_by_both_stages":
        "test_a_weight_held_on_two_stages_counts_on_both_and_the_balance_sees_it (a weight read on two stages)",
    "tests/test_inspect_cli.py::test_the_entry_point_prints_tp2_pp2_rank1":
        "test_tensor_and_pipeline_parallel_for_two_ranks[1] (the same inspect, in process)",
    "tests/test_cli.py::test_plan_540b_from_the_entry_point":
        "test_plan_prints_a_ranked_table_that_fits_a_terminal (the same plan command, in process)",
    "tests/test_cli.py::test_plan_from_a_profile_costs_the_factorys_own_programs":
        "test_planner_profile.py's searches over written profiles (the same costing of the programs)",
    **{f"tests/test_job_plan.py::{test}[{case}]": "the same test's vit-cp2 cell (every plan field's round trip; the "
       "other axes' fields are the same code)"
       for test in ("test_a_plan_round_trips_through_json_and_builds_the_same_programs",
                    "test_compile_rank_leaves_the_capture_as_it_was")
       for case in ("llama-cp2ring-tp2", "gpt-pp2xtp2-sp", "gpt-pp2zbv-dp2")},
    "tests/test_planner_profile.py::test_mesh_auto_under_a_memory_limit_takes_the_fastest_that_fits":
        "test_mesh_auto_under_a_memory_limit_trains_exactly_on_what_fits",
    "tests/test_cost.py::test_llama_7b_shape_is_annotated_on_meta_without_allocating":
        "test_gpt_forward_flops_match_the_textbook_formula and test_symbolic_flops_evaluate_back_and_predict_another_"
        "shape (the same annotation, at a small shape)",
    "tests/test_cli.py::test_plan_from_a_config_gives_the_answer_of_the_typed_flags[mixtral_8x7b_config.json]":
        "the same test's llama3_8b_config.json cell (the same reading of a config file)",
    "tests/test_planner_profile.py::test_autotune_trains_the_predicted_fastest_and_takes_the_fastest_measured":
        "test_mesh_auto_with_a_profile_takes_the_fastest_prediction (the same ranking, before the trials)",
    "tests/test_planner.py::test_seed_interleaving_16_stages_4_chunks":
        "test_seed_microbatches_for_a_5_percent_bubble (the same bubble formula, at v = 1)",
    "tests/test_capture.py::test_one_export_gives_the_training_and_the_inference_graph_each_as_its_own_export_would"
    "[moe]": "the same test's hf_llama and bert cells (the same one export)",
}
# whole tests run only in the full tier -> what in the CI tier runs the same code path
FULL_ONLY = {
    "tests/test_docs.py::test_the_guides_loop_resumes_under_another_mesh":
        "test_resume.py's runs resumed under another mesh (the same save_checkpoint and resume), and the home page's "
        "and README's examples run in CI",
    "tests/test_docs.py::test_the_guides_trainer_trains_under_torchrun":
        "test_hf_trainer.py's test_the_trainer_under_a_mesh_trains_as_the_plain_trainer cells (the same Trainer)",
    "tests/test_docs.py::test_the_guides_accelerate_loop_trains_under_torchrun":
        "test_hf_trainer.py's test_an_accelerate_loop_changed_by_one_line_trains_as_in_one_process (the same prepare "
        "and loop)",
    "tests/test_docs.py::test_the_guides_experts_split_over_ep_train_under_torchrun":
        "test_expert_parallel.py's test_experts_split_over_ep_train_exactly (the same Mixtral experts over ep)",
    "tests/test_docs.py::test_the_plannings_mesh_auto_from_a_profile_trains_under_torchrun":
        "test_planner_profile.py's test_mesh_auto_from_a_profile_trains_exactly_on_the_mesh_it_chose (the same "
        "search from a profile)",
    "tests/test_resume.py::test_experts_held_as_separate_modules_resume_at_more_ep_ranks":
        "test_experts_looped_one_at_a_time_resume_at_more_ep_ranks (the same resume at more ep ranks) and "
        "test_expert_parallel.py's goldens of experts held as separate modules",
    "tests/test_hf_trainer.py::test_mesh_auto_trains_as_the_plain_trainer":
        "test_the_trainer_under_a_mesh_trains_as_the_plain_trainer's cells and test_planner_profile.py's mesh='auto' "
        "goldens",
    "tests/test_docs.py::test_the_plannings_mesh_auto_calibrated_and_autotuned_trains_under_torchrun":
        "the planning page's example from a profile file under torchrun (the same search of mesh='auto'), "
        "test_mesh_auto_calibrating_its_own_ranks_trains_exactly_on_the_mesh_it_chose and "
        "test_autotune_trains_the_predicted_fastest_and_takes_the_fastest_measured (a calibration and the trials)",
    "tests/test_gpu_check.py::test_the_gpu_check_runs_on_the_cpu":
        "every golden the check runs is an axis's golden in the CI tier (dp2, tp2, tp2 with sp, pp2 1F1B and ZBV, "
        "cp2 gathered, ring and all-to-all, the zoo at one rank) and test_compile.py's compiled programs",
    "tests/test_fuzz.py::test_random_uses_of_the_api_are_refused_alike_or_exact[50]":
        "the axes' goldens and test_api.py's refusals (each case the fuzz draws is one of them, composed)",
    "tests/test_demo.py::test_the_hf_trainer_example_trains_saves_and_resumes_under_another_mesh":
        "test_hf_trainer.py's Trainer cell at llama-tp2 and its run saved under tp resumed under pp (the same "
        "Trainer, callback and checkpoint); the demo under torchrun stays in CI",
    **{f"tests/test_expert_parallel.py::test_fsdp_with_experts_split_by_ep[{mesh}]":
       "test_resume.py's fsdp-ep2-to-ep4 cell (FSDP2 beside Mixtral's experts left to ep2, trained, saved and resumed "
       "exactly) and test_experts_summed_over_the_ranks_that_hold_them_alike (the replicas at dp4 x ep2, without "
       "FSDP2)"
       for mesh in ("dp2xep2", "dp4xep2")},
    "tests/test_lost_writes.py::test_a_model_that_builds_its_mask_and_labels_by_writes_is_exact[dp2xtp2xpp2]":
        "the same test's pp2 (quick), tp2sp and cp2 cells: the writes are kept per stage and per axis",
    "tests/test_compile.py::test_compiled_programs_are_exact_and_compile_once[hf_llama-tp2-sequence_parallel=True]":
        "the gpt-tp2 compiled cell (the same functional collectives) and the eager sequence-parallel goldens",
    "tests/test_demo.py::test_the_example_with_fsdp_over_a_pipeline":
        "test_composition.py's FSDP2 goldens over a pipeline; the demo under torchrun stays in CI",
    "tests/test_spread.py::test_no_pp2_rank_stores_more_than_0_6_of_the_parameters[hrm_text-0.99]":
        "the same test's deepseek_v4 cell (the same spreading; the other architectures in the full tier)",
    "tests/test_training_loop.py::test_t5_with_its_embeddings_and_head_tied_is_exact[dp2xtp2xpp2]":
        "the same test at tp2xpp2 (the cross-attention's input gradient summed over tp before it is sent back), "
        "and the dp2 x tp2 x pp2 goldens of test_composition.py",
    **{f"tests/test_resume.py::test_resuming_under_the_same_mesh_is_bit_identical[{mesh}-{name}]":
       "the tp2xpp2-adamw cell (the same save and load; every optimizer's state tensors are moved alike), "
       "test_other_optimizers_resume_under_another_mesh[sgd]"
       + (", and test_composition.py's FSDP2 checkpoints moved between meshes" if mesh.startswith("fsdp") else "")
       for mesh in ("tp2xpp2", "fsdp-dp2xtp2") for name in ("rmsprop", "adagrad")},
    "tests/test_gqa.py::test_grouped_query_attention_is_exact_at_the_share_of_duplicated_kv_heads[titan-tp8-kv2]":
        "titan's tp=4 cell at two ranks per kv head, mistral's tp=8 cell (four ranks per kv head), and the 8-rank "
        "all-to-all cp cell of sdpa_gqa",
    "tests/test_gqa.py::test_grouped_query_attention_over_tp_and_all_to_all_cp[fused]":
        "the same test's sdpa_gqa cell (8 ranks), and fused's tp=4 cell",
    "tests/test_composition.py::test_golden_dp2_tp2_pp2_on_eight_processes[llama]":
        "the gpt cell (the same 8-rank mesh), and the Llama-style goldens at tp2 (test_tensor_parallel.py's "
        "llama-2) and HF Llama's at pp2 (test_pipeline.py's hf_llama-pp2-m4-dualpipev)",
    "tests/test_composition.py::test_checkpoint_saved_under_one_mesh_loads_under_another[hf_llama]":
        "the same test's gpt cell, and test_resume.py's HF Llama run resumed under another mesh",
    "tests/test_gqa.py::test_grouped_query_attention_with_sequence_parallelism[fused]":
        "the same test's sdpa_gqa cell, and fused's tp=4 cell",
    "tests/test_gqa.py::test_grouped_query_attention_over_tp_and_all_to_all_cp[titan]":
        "the same test's sdpa_gqa cell (8 ranks, the kv heads repeated for the all-to-all), and titan's tp=4 cell",
    "tests/test_elastic.py::test_a_run_that_loses_a_node_goes_on_at_the_smaller_world_size":
        "test_resume.py's runs resumed at another world size (hf_llama-pp2-to-tp4, a single-process run moved to "
        "eight ranks and back); the demo under torchrun stays in CI",
    **{f"tests/test_restart.py::test_a_run_killed_again_and_again_resumes_by_itself_with_the_same_losses[{times}]":
       "test_checkpoint_trust.py's saves killed at any point (the previous checkpoint stays loadable), "
       "test_resume.py's runs resumed bit for bit (tp2xpp2-adamw) and the demo under torchrun; torchrun's restarts "
       "run in the full tier"
       for times in (2, 5)},
    "tests/test_hash_seeds.py::test_pipeline_ranks_whose_hash_seeds_order_the_capture_differently_train_exactly":
        "test_pipeline.py's handoff check (ranks that compiled different programs are refused before a step) and the "
        "demo under torchrun (ranks under their own hash seeds, on a model whose capture does not depend on them); a "
        "capture the seed reorders (Gemma 4's) runs across ranks in the full tier only",
    "tests/test_expert_parallel.py::test_compiled_programs_over_experts_split_by_ep":
        "the compiled goldens of test_compile.py (the same compiler) and the eager ep goldens (the same programs)",
    **{f"tests/test_expert_parallel.py::test_experts_split_over_ep_train_as_adamw_trains_them_in_one_process[{name}-{mesh}]":
       "the jetmoe-ep2xtp2 cell (the same AdamW loop over experts split by ep), and the SGD goldens of one "
       "architecture per mesh (Mixtral at ep2, gpt-oss at ep2 x tp2, DeepSeek-V3 at dp2 x ep2 x pp2)"
       for name in ("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "granitemoe", "gpt_oss", "jetmoe")
       for mesh in ("ep2", "ep2xtp2", "dp2xep2xpp2") if (name, mesh) != ("jetmoe", "ep2xtp2")},  # explain() at tp2
    # expert parallelism: one golden per mesh on the architecture that brings the most, the seeded bugs' tests, and
    # what no other test runs (the explain() of routed sizes, save_pretrained, inference) stay in CI
    **{f"tests/test_expert_parallel.py::test_experts_split_over_ep_train_exactly[{name}-{mesh}]":
       "one cell per mesh (Mixtral at ep2, gpt-oss at ep2 x tp2, DeepSeek-V3 at dp2 x ep2 x pp2): every op the "
       "other architectures' expert segments hold is among theirs"
       for name in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "granitemoe", "gpt_oss", "jetmoe")
       for mesh in ("ep2", "ep2xtp2", "dp2xep2xpp2")
       if (name, mesh) not in {("mixtral", "ep2"), ("gpt_oss", "ep2xtp2"), ("deepseek_v3", "dp2xep2xpp2")}},
    **{f"tests/test_expert_parallel.py::test_experts_split_over_ep_train_as_adamw_trains_them_in_one_process"
       f"[mixtral-{mesh}]": f"Mixtral's ordinary loop at ep2 (the same AdamW loop) and the SGD golden at this mesh "
       f"({arch}'s)" for mesh, arch in (("ep2", "Mixtral"), ("ep2xtp2", "gpt-oss"), ("dp2xep2xpp2", "DeepSeek-V3"))},
    **{f"tests/test_expert_parallel.py::{test}": "the ep2 goldens (the same programs) and the axis's own goldens"
       for test in ("test_a_router_loss_is_exact_where_the_batch_stays_whole[tp2]",
                    "test_a_router_loss_is_exact_where_the_batch_stays_whole[cp2]",
                    "test_bf16_autocast_over_experts_split_by_ep", "test_ep_with_context_parallelism[dp2xcp2xep2]",
                    "test_ep_with_context_parallelism[dp2xcp2xep4]",
                    "test_an_ordinary_training_loop_over_experts_split_by_ep[ep2xtp2]")},
    **{f"tests/test_expert_parallel.py::test_the_zoos_torchtitan_style_experts_split_over_ep_train_exactly[{mesh}]":
       "the zoo MoE's ep2 golden (the same routes; more ranks and cp only change the groups, as Mixtral's cp2xep2 "
       "cell and test_resume.py's fsdp-ep2-to-ep4 at ep4 show)" for mesh in ("ep4", "cp2xep2")},
    "tests/test_expert_parallel.py::test_the_zoos_experts_split_over_ep_train_as_adamw_trains_them[ep2xtp2]":
        "the zoo MoE's SGD golden at ep2 x tp2 and its AdamW loop at ep2",
    **{f"tests/test_expert_parallel.py::test_a_router_loss_over_the_whole_batch_is_exact_under_ep[{name}]":
       "the Mixtral cell (the same load_balancing_loss_func, copied into each family)"
       for name in ("qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "jetmoe")},
    **{f"tests/test_expert_parallel.py::test_a_router_loss_over_the_whole_batch_in_an_ordinary_training_loop[{c}]":
       "the mixtral-ep2 loop (the same sums; tp and more dp ranks change no statistic)"
       for c in ("qwen3_moe-ep2xtp2", "mixtral-dp4xep2")},
    "tests/test_data_parallel.py::test_a_token_mean_inside_a_larger_loss_is_exact_under_dp_and_cp[dp2xtp2]":
        "the dp4 cell (the same sums) and the tp goldens",
    **{f"tests/test_data_parallel.py::test_a_token_loss_scaled_by_a_number_is_divided_by_the_whole_batchs_count[{c}]":
       "the dp4 and dp2xpp2-m4 cells (the same token loss) and the cp and tp goldens of the plain token loss"
       for c in ("dp2xcp2", "cp4", "dp2xtp2-m2")},
    "tests/test_expert_parallel.py::test_a_capacity_drops_the_rows_beyond_it_as_the_model_would[ep2xtp2]":
        "the ep2 capacity cell (the same route) and the zoo mixture's ep2 x tp2 golden",
    "tests/test_resume.py::test_experts_under_fsdp_resume_under_another_split[ep2-to-fsdp-dp4xep2]":
        "the fsdp-ep2-to-ep4 cell (the same checkpoint format, read the other way)",
    "tests/test_expert_parallel.py::test_a_router_loss_computed_on_each_part_with_local_batch_statistics[dp2-m2]":
        "the ep2 cell (the same option; dp's and microbatches' loss averaging is the plain dp golden's)",
    **{f"tests/test_resume.py::test_experts_split_over_ep_resume_under_another_split[corpus/gpt_oss-{pair}]":
       "Mixtral's ep2-to-tp2 cell (the same checkpoint: each ep rank's experts its rows of one tensor)"
       for pair in ("ep2-to-ep4", "ep2-to-tp2", "tp2-to-ep2xtp2", "cp2xep2-to-ep2", "dp2xcp2xep4-to-tp2")},
    "tests/test_resume.py::test_experts_split_over_ep_resume_under_another_split[corpus/mixtral-dp2xcp2xep4-to-tp2]":
        "the ep2-to-tp2 cell (the same checkpoint, read under another split) and test_expert_parallel.py's "
        "cp2xep2 golden (experts carved from cp)",
    "tests/test_pretrained.py::test_save_pretrained_loads_exactly_with_from_pretrained[gpt_oss-dp2xep2xpp2]":
        "test_save_pretrained_under_ep_loads_under_another_split_reading_each_ranks_experts (Mixtral's experts "
        "gathered from dp2 x ep2 x tp2: the same assembly, over tp as well)",
    "tests/test_fuzz.py::test_random_uses_of_the_api_are_refused_alike_or_exact[500]":
        "the axes' goldens and test_api.py's refusals (the first 50 cases run in the full tier too)",
    **{f"tests/test_compile.py::test_compiled_programs_are_exact_and_compile_once[{cell}]":
       "the compiled gpt tp2, pp2 zbv and cp2 ring cells (dp's and 1F1B's programs are the same code path; the "
       "gathered and all-to-all attention are single graphs as tp's are)"
       for cell in ("gpt-dp2", "gpt-pp2-microbatches=2", "gpt-cp2", "gpt-cp2-cp_attention=alltoall", "hf_llama-tp2",
                    "hf_llama-pp2-microbatches=2", "hf_llama-pp2-schedule=zbv-microbatches=2",
                    "hf_llama-cp2-cp_attention=ring-cp_load_balance=True",
                    "gpt-dp2xtp2xpp2-schedule=zbv-microbatches=2")},
    "tests/test_data_parallel.py::test_a_token_mean_inside_a_larger_loss_is_exact_in_two_passes[dp2xtp2xpp2-m2]":
        "the same test's pp2-m2 and dp2-m2 cells (the same shares; tp splits the model before the cut alone), and "
        "the contrastive golden in two passes at dp2 x tp2 x pp2 in test_batch_split.py",
    "tests/test_hf_trainer.py::test_the_trainer_under_a_mesh_trains_as_the_plain_trainer[llama-dp2xtp2xpp2]":
        "the Trainer's llama-tp2 cell (the same Trainer and callback), test_composition.py's dp2 x tp2 x pp2 golden "
        "on eight processes, and the contrastive golden in two passes at dp2 x tp2 x pp2 in test_batch_split.py",
    "tests/test_resume.py::test_a_fused_projection_with_kv_blocks_held_whole_moves_back_to_fewer_ranks":
        "the fused layouts' moves between tp degrees (phi3's fused qkv, gpt2's c_attn) in "
        "test_state_of_fused_padded_tied_and_expert_weights_moves_between_tp_degrees",
    "tests/test_functions.py::test_a_model_trained_through_functions_is_exact[lm-dp2xtp2xpp2-microbatches=2]":
        "the same model's dp2, tp2 and pp2 cells (kept Functions replicated under tp, per stage under pp, proven "
        "per-sample under dp and microbatches)",
    "tests/test_partition.py::test_the_default_balance_keeps_each_stage_within_its_parameter_share_where_a_cut_allows"
    "[kimi_linear]": "the same test's roc_bert cell",
    **{f"tests/test_resume.py::test_state_of_fused_padded_tied_and_expert_weights_moves_between_tp_degrees[{n}]":
       "gpt2's fused c_attn and phi3's fused qkv and gate_up cells (the same blocks held per tp rank)"
       for n in ("corpus/gpt_neox", "corpus/falcon")},
    **{f"tests/test_planner_profile.py::{test}": covers for test, covers in (
        ("test_calibrate_writes_a_profile_of_this_machine", "the profile's fits and readings, tested on written "
         "profiles, and test_mesh_auto_calibrating_its_own_ranks_trains_exactly_on_the_mesh_it_chose (a calibration "
         "of this machine)"),
        ("test_mesh_auto_searches_ep_for_a_mixture_of_experts",
         "test_mesh_auto_with_a_profile_takes_the_fastest_prediction (the same search over the other axes)"),
        ("test_mesh_auto_with_this_machines_profile_takes_the_measured_best",
         "test_mesh_auto_with_a_profile_takes_the_fastest_prediction"))},
}
# cells that stay in the CI tier whatever the covering says: each is named above as what covers a test moved out
KEEP = {f"tests/{test}" for test in (
    "test_training_loop.py::test_each_step_reports_its_time_tokens_flops_memory_and_bubble[tp2]",  # MFU measured
    "test_training_loop.py::test_each_step_reports_its_time_tokens_flops_memory_and_bubble[pp2]",  # the trace
    "test_training_loop.py::test_a_ranks_failure_ends_the_step_on_its_peers_at_once_and_later_steps_are_refused[dp2]",
    "test_data_parallel.py::test_golden_data_parallel[gpt-dp2-m2]",
    # the Megatron-style decoder trained through its region mappings (its first cell, dp1, runs in one process)
    "test_tensor_parallel.py::test_golden_tensor_parallel[megatron-2]",
    "test_tensor_parallel.py::test_golden_data_and_tensor_parallel[megatron]",
    "test_sequence_parallel.py::test_golden_sequence_parallel[megatron-2]",
    # DDP quiet at dp2 and at dp2 x tp2
    *(f"test_data_parallel.py::test_ddp_looks_for_unused_parameters_only_where_the_graph_leaves_some_and_pytorch_"
      f"says_nothing[{cell}]" for cell in ("gpt-dp2", "megatron-dp2xtp2-accumulated-after-eval")),
    "test_pipeline.py::test_golden_pipeline[gpt-pp2-m4-zbv]",
    "test_pipeline.py::test_golden_pipeline[hf_llama-pp2-m4-dualpipev]",
    "test_context_parallel.py::test_golden_context_parallel_ring[gpt-2-contiguous]",
    "test_context_parallel.py::test_golden_context_parallel_all_to_all[gpt-2]",
    "test_tensor_parallel.py::test_golden_tensor_parallel[llama-2]",
    "test_hf_trainer.py::test_the_trainer_under_a_mesh_trains_as_the_plain_trainer[llama-tp2]",
    "test_lost_writes.py::test_a_model_that_builds_its_mask_and_labels_by_writes_is_exact[tp2sp]",
    "test_lost_writes.py::test_a_model_that_builds_its_mask_and_labels_by_writes_is_exact[cp2]",
    "test_compile.py::test_compiled_programs_are_exact_and_compile_once[gpt-tp2]",
    "test_compile.py::test_compiled_programs_are_exact_and_compile_once[gpt-pp2-schedule=zbv-microbatches=4]",
    "test_compile.py::test_compiled_programs_are_exact_and_compile_once[gpt-cp2-cp_attention=ring]",
    "test_composition.py::test_golden_fully_sharded_data_parallel[dp2xpp2]",
    "test_composition.py::test_golden_fully_sharded_data_parallel[dp2xtp2xpp2]",
    "test_composition.py::test_golden_dp2_tp2_pp2_on_eight_processes[gpt]",
    "test_composition.py::test_checkpoint_saved_under_one_mesh_loads_under_another[gpt]",
    "test_composition.py::test_fsdp_checkpoints_round_trip_across_meshes[gpt-fsdp-dp2xtp2-to-tp2xpp2]",
    "test_spread.py::test_no_pp2_rank_stores_more_than_0_6_of_the_parameters[deepseek_v4-0.62]",
    "test_training_loop.py::test_t5_with_its_embeddings_and_head_tied_is_exact[tp2xpp2]",
    "test_resume.py::test_resuming_under_the_same_mesh_is_bit_identical[tp2xpp2-adamw]",
    "test_resume.py::test_other_optimizers_resume_under_another_mesh[sgd]",
    "test_resume.py::test_a_run_resumes_under_another_mesh_as_if_it_had_not_stopped[hf_llama-pp2-to-tp4]",
    "test_resume.py::test_experts_under_fsdp_resume_under_another_split[fsdp-ep2-to-ep4]",
    "test_resume.py::test_experts_split_over_ep_resume_under_another_split[corpus/mixtral-ep2-to-tp2]",
    "test_resume.py::test_state_of_fused_padded_tied_and_expert_weights_moves_between_tp_degrees[corpus/gpt2]",
    "test_resume.py::test_state_of_fused_padded_tied_and_expert_weights_moves_between_tp_degrees[corpus/phi3]",
    "test_gqa.py::test_grouped_query_attention_is_exact_at_the_share_of_duplicated_kv_heads[titan-tp4-kv2]",
    "test_gqa.py::test_grouped_query_attention_is_exact_at_the_share_of_duplicated_kv_heads[mistral-tp8-kv2]",
    "test_gqa.py::test_grouped_query_attention_is_exact_at_the_share_of_duplicated_kv_heads[fused-tp4-kv2]",
    "test_gqa.py::test_grouped_query_attention_over_tp_and_all_to_all_cp[sdpa_gqa]",
    "test_gqa.py::test_grouped_query_attention_with_sequence_parallelism[sdpa_gqa]",
    "test_expert_parallel.py::test_experts_split_over_ep_train_exactly[mixtral-ep2]",
    "test_expert_parallel.py::test_experts_split_over_ep_train_exactly[gpt_oss-ep2xtp2]",
    "test_expert_parallel.py::test_experts_split_over_ep_train_exactly[deepseek_v3-dp2xep2xpp2]",
    "test_expert_parallel.py::test_experts_split_over_ep_train_as_adamw_trains_them_in_one_process[jetmoe-ep2xtp2]",
    "test_expert_parallel.py::test_an_ordinary_training_loop_over_experts_split_by_ep[ep2]",
    "test_expert_parallel.py::test_the_zoos_torchtitan_style_experts_split_over_ep_train_exactly[ep2]",
    "test_expert_parallel.py::test_the_zoos_torchtitan_style_experts_split_over_ep_train_exactly[ep2xtp2]",
    "test_expert_parallel.py::test_the_zoos_experts_split_over_ep_train_as_adamw_trains_them[ep2]",
    "test_expert_parallel.py::test_ep_with_context_parallelism[cp2xep2]",
    "test_expert_parallel.py::test_a_router_loss_over_the_whole_batch_is_exact_under_ep[mixtral]",
    "test_expert_parallel.py::test_a_router_loss_over_the_whole_batch_in_an_ordinary_training_loop[mixtral-ep2]",
    "test_expert_parallel.py::test_a_capacity_drops_the_rows_beyond_it_as_the_model_would[ep2]",
    "test_expert_parallel.py::test_a_router_loss_computed_on_each_part_with_local_batch_statistics[ep2]",
    "test_data_parallel.py::test_a_token_mean_inside_a_larger_loss_is_exact_under_dp_and_cp[dp4]",
    "test_data_parallel.py::test_a_token_loss_scaled_by_a_number_is_divided_by_the_whole_batchs_count[dp4]",
    "test_data_parallel.py::test_a_token_loss_scaled_by_a_number_is_divided_by_the_whole_batchs_count[dp2xpp2-m4]",
    "test_data_parallel.py::test_a_token_mean_inside_a_larger_loss_is_exact_in_two_passes[pp2-m2]",
    "test_data_parallel.py::test_a_token_mean_inside_a_larger_loss_is_exact_in_two_passes[dp2-m2]",
    "test_batch_split.py::test_a_contrastive_loss_is_exact_in_two_passes_under_microbatches_and_pp"
    "[dp2xtp2xpp2-clip-m2]",
    "test_functions.py::test_a_model_trained_through_functions_is_exact[lm-dp2]",
    "test_functions.py::test_a_model_trained_through_functions_is_exact[lm-tp2]",
    "test_functions.py::test_a_model_trained_through_functions_is_exact[lm-pp2-microbatches=2]",
    "test_partition.py::test_the_default_balance_keeps_each_stage_within_its_parameter_share_where_a_cut_allows"
    "[roc_bert]",
)}
# the parameters, and the entries of an ``options`` parameter, whose values the CI tier runs each at least once: a
# mesh, an axis's degree or strategy, a pipeline schedule and its microbatches
AXES = {"mesh", "mesh_kwargs", "world", "dp", "tp", "pp", "cp", "load", "save", "schedule", "chunks", "microbatches",
        "attention", "load_balance", "cp_attention", "cp_load_balance", "sequence_parallel", "data_parallel"}


def mutant_tests() -> set[str]:
    return {test for mutant in MUTANTS for test in mutant.tests}


def assign(items: list) -> None:
    """Mark each collected item ``quick`` or ``full`` (the CI tier is the rest)."""
    keep = mutant_tests()

    def pinned(item) -> bool:  # stays in the CI tier and counts as covering what it runs
        nodeid = item.nodeid
        return (nodeid in keep or nodeid.partition("[")[0] in keep or nodeid.partition("::")[0] in keep
                or nodeid in QUICK_GOLDENS or nodeid in NOT_QUICK or nodeid in KEEP
                or item.get_closest_marker("quick") is not None)

    for item in items:
        if (item.path.name in QUICK_FILES or item.nodeid in QUICK_GOLDENS) and item.nodeid not in NOT_QUICK \
                and item.nodeid not in FULL_ONLY:
            item.add_marker(pytest.mark.quick)
    seen: set = set()  # the features the CI tier's cells run
    tests: set = set()  # the parametrized tests with a cell in the CI tier
    for item in items:
        if pinned(item) and hasattr(item, "callspec"):
            seen |= _features(item)
            tests.add(item.function)
    for item in items:
        if pinned(item):
            continue
        if item.nodeid in FULL_ONLY:
            item.add_marker(pytest.mark.full)
            continue
        if not hasattr(item, "callspec") or item.get_closest_marker("full") is not None:
            continue  # single tests stay; a cell its own file marks full stays there
        features = _features(item)
        if item.function in tests and features <= seen:
            item.add_marker(pytest.mark.full)
            continue
        seen |= features
        tests.add(item.function)


def _features(item) -> set:
    """What a cell runs that the CI tier has to run once: the value of each of its ``AXES`` (a parameter, or an entry
    of a parameter named ``options``, ``save_options``...), and in a distributed matrix (a test on the worker pools)
    the zoo model it trains."""
    features = set()
    for key, value in item.callspec.params.items():
        if key in AXES:
            features.add((key, repr(value)))
        elif key.endswith("options") and isinstance(value, dict):
            features |= {(k, repr(v)) for k, v in value.items() if k in AXES}
    if "pools" in item.fixturenames and item.callspec.params.get("name") in ZOO_NAMES + CONV_NAMES:
        features.add(("zoo model", item.callspec.params["name"]))
    return features
