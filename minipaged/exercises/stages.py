"""The build track's stages, in lesson order: what each asks, what grades it, what it needs.

A stage replaces some of the project's real functions (`targets`) with the learner's, and is
graded by some of the project's own tests, grouped by the `Concept` they check; each concept
names the lesson section (a markdown heading of the notebook) that explains it, so a failing
grader can say what to reread. tests/test_exercises.py checks that every heading exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Concept:
    name: str  # what its graders check, in a few words
    lesson: str  # the notebook that explains it (its stem, notebooks/<lesson>.ipynb)
    section: str  # the heading of the cell that explains it (without the leading #s)
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root

    def where(self) -> str:
        return f"lesson {self.lesson.split('_')[0]}, section \"{self.section}\" " \
               f"(notebooks/{self.lesson}.ipynb)"


@dataclass(frozen=True)
class Stage:
    name: str  # the skeleton's module name, and the learner's file <workspace>/<name>.py
    lesson: str  # the notebook the stage belongs to (the last one that explains it)
    title: str  # what the learner builds, in a few words
    minutes: int  # about how long it takes, reading the skeleton included
    # The real symbols the learner's functions replace, as "module:Qual.name"; the learner's
    # function is named after the last part, or "name=module:Qual.name" names it (a method is
    # written as a plain function taking `self`).
    targets: tuple[str, ...]
    concepts: tuple[Concept, ...]
    needs: str  # what it uses from the stages before it
    capstone: str  # where the capstone runs it

    @property
    def functions(self) -> tuple[str, ...]:
        """The names the learner's file must define."""
        return tuple(function_and_target(t)[0] for t in self.targets)

    @property
    def real_targets(self) -> tuple[str, ...]:
        return tuple(function_and_target(t)[1] for t in self.targets)

    @property
    def tests(self) -> tuple[str, ...]:
        """Every grader, in concept order (a test shared by two concepts runs once)."""
        return tuple(dict.fromkeys(t for c in self.concepts for t in c.tests))

    @property
    def skeleton_path(self) -> Path:
        return Path(__file__).with_name("skeletons") / f"{self.name}.py"

    @property
    def lesson_number(self) -> str:
        return self.lesson.split("_")[0]

    def concept_of(self, nodeid: str) -> Concept:
        """The first concept a grader (a node id, maybe with its parameters) belongs to."""
        for c in self.concepts:
            for t in c.tests:
                if nodeid == t or nodeid.startswith(t + "["):
                    return c
        raise KeyError(nodeid)


def function_and_target(spec: str) -> tuple[str, str]:
    """"name=module:Qual.name" or "module:Qual.name" -> (the learner's name, the target)."""
    if "=" in spec:
        name, target = spec.split("=", 1)
        return name, target
    return spec.split(":")[1].split(".")[-1], spec


def _tests(path: str, *names: str) -> tuple[str, ...]:
    return tuple(f"tests/{path}::{n}" for n in names)


L02, L02B, L03, L04 = ("02_block_manager", "02b_one_request", "03_continuous_batching",
                       "04_sampling")
L05, L06, L10 = "05_paged_attention_kernel", "06_sharing_and_preemption", "10_speculative_decoding"
L13 = "13_serving_under_load"
BM, SCHED, SAMPLER = "test_block_manager.py", "test_scheduler.py", "test_sampler.py"
PRIO = "test_priority_scheduling.py"  # the scheduler's and the engine's tests, not the API's
PREEMPTION_PARITY = "tests/test_parity.py::test_stories260k_under_preemption_and_chunked_prefill"

STAGES: tuple[Stage, ...] = (
    Stage(
        name="block_allocator", lesson=L02, minutes=45,
        title="the physical blocks: free queue, ref counts, prefix-hash index",
        targets=tuple(f"minipaged.engine.block_allocator:BlockAllocator.{m}"
                      for m in ("allocate", "incref", "decref", "lookup", "register"))
        + ("minipaged.engine.block_allocator:hash_block",),
        concepts=(
            Concept("the free queue in LRU order: allocate from the front, free to the back",
                    L02, "5. Free: blocks go back, prefixes stay cached",
                    _tests(BM, "test_lru_eviction_order",
                           "test_revived_cached_block_moves_to_the_back_of_the_queue",
                           "test_allocate_twice_and_double_free_raise")),
            Concept("prefix hashing: a block's hash covers its whole prefix, a collision is a "
                    "miss", L02, "3. Prefix caching: sharing blocks between requests",
                    _tests(BM, "test_prefix_hit_returns_the_cached_blocks_and_token_count",
                           "test_hash_collision_is_a_miss",
                           "test_freed_blocks_stay_cached_and_are_reused")),
            Concept("ref counts and the free queue agree under any sequence of operations",
                    L02, "6. The same thing inside the engine",
                    _tests(BM, "test_block_manager_state_machine", "test_usage_numbers")),
        ),
        needs="nothing: this is the bottom of the engine",
        capstone="every block of every run comes from your allocator"),
    Stage(
        name="block_manager", lesson=L02, minutes=75,
        title="block tables: allocate, prefix lookup and publish, copy-on-write, free",
        targets=tuple(f"minipaged.engine.block_manager:BlockManager.{m}"
                      for m in ("get_computed_blocks", "can_allocate", "allocate",
                                "cache_blocks", "_needs_cow", "can_append", "append_slots",
                                "free")),
        concepts=(
            Concept("allocate: a sequence's cached prefix plus fresh blocks", L02,
                    "1. Allocate: a prompt gets its blocks",
                    _tests(BM, "test_block_manager_state_machine", "test_usage_numbers",
                           "test_allocate_twice_and_double_free_raise")),
            Concept("the prefix lookup: whole cached blocks, at least one token left to compute",
                    L02, "3. Prefix caching: sharing blocks between requests",
                    _tests(BM, "test_prefix_hit_returns_the_cached_blocks_and_token_count",
                           "test_prefix_hit_leaves_at_least_one_token_to_compute",
                           "test_prefix_cache_off_never_hits")
                    + ("tests/test_sharing.py::test_requests_arriving_together_prefill_the_"
                       "shared_prompt_once[torch_ref]",)),
            Concept("append with copy-on-write: never write into a block another table reads",
                    L02, "4. Fork and copy-on-write",
                    _tests(BM, "test_fork_shares_blocks_and_copy_on_write_splits_the_partial_block",
                           "test_can_append_counts_the_copy_on_write_block")
                    + ("tests/test_sharing.py::test_prompt_prefilled_once_then_forked_with_copy_"
                       "on_write",)),
            Concept("free: tail blocks first, full blocks stay cached for the next request", L02,
                    "5. Free: blocks go back, prefixes stay cached",
                    _tests(BM, "test_lru_eviction_order",
                           "test_freed_blocks_stay_cached_and_are_reused")
                    + ("tests/test_preemption_modes.py::test_swap_round_trip_is_bit_exact_and_"
                       "keeps_sharing",)),
        ),
        needs="block_allocator: allocate, incref, decref, lookup and hash_block",
        capstone="every block table of every run is yours"),
    Stage(
        name="prepare_inputs", lesson=L02B, minutes=45,
        title="one step flattened: positions, slot mapping, block tables, cumulative lengths",
        targets=("minipaged.worker.model_runner:ModelRunner.prepare_inputs",),
        concepts=(
            Concept("positions and the slot mapping: where each new K/V goes", L02B,
                    "4. Flattening: `ModelRunner.prepare_inputs`",
                    ("tests/test_lessons.py::test_next_decode_slot_mapping_matches_the_engine",
                     "tests/test_cpu_model_runner.py::test_decode_inputs_equal_model_runner_in_"
                     "length_order",
                     "tests/test_cpu_model_runner.py::test_prefill_steps_keep_the_scheduler_"
                     "order")),
            Concept("what attention reads: cu_seqlens_q, context lengths, padded block tables",
                    L02B, "5. The forward: K/V into their slots, attention over the blocks",
                    ("tests/test_engine.py::test_gpu_model_runner_builds_the_same_step_as_the_"
                     "lesson_runner",
                     "tests/test_lessons.py::test_flat_batch_picture_draws_the_engines_step")),
            Concept("the step's tensors drive the model: greedy tokens equal Hugging Face's",
                    L02B, "8. The same tokens as `LLM.generate`",
                    ("tests/test_parity.py::test_stories260k_many_concurrent_prompts[8-torch_ref]",
                     "tests/test_cpu_model_runner.py::test_greedy_tokens_equal_model_runner")),
        ),
        needs="block_manager: the block tables the scheduler hands over in each ScheduledSeq",
        capstone="every forward of every run reads the tensors you build"),
    Stage(
        name="step_loop", lesson=L02B, minutes=40,
        title="the step loop: plan, run, update, sample, stop checks",
        targets=("minipaged.engine.step_loop:SyncStepLoop.step",
                 "minipaged.engine.llm_engine:LLMEngine.update_computed",
                 "minipaged.engine.output:OutputProcessor.check_stop",
                 "minipaged.engine.output:find_stop_string"),
        concepts=(
            Concept("one step's phases in order: plan, run, update, sample and process", L02B,
                    "6. Logits, the sampler, and the engine's bookkeeping",
                    ("tests/test_engine.py::test_text_prompt_and_greedy_text",
                     "tests/test_engine.py::test_logprobs")),
            Concept("stop checks: EOS, stop tokens, max_tokens, max_model_len", L02B,
                    "6. Logits, the sampler, and the engine's bookkeeping",
                    ("tests/test_engine.py::test_stop_token_ids",
                     "tests/test_engine.py::test_eos_stops_and_ignore_eos_continues",
                     "tests/test_engine.py::test_generation_stops_at_max_model_len",
                     "tests/test_engine.py::test_stop_string_trims_text")),
            Concept("a step that plans nothing, and chunks that sample nothing", L02B,
                    "7. Step 2: a decode of both",
                    (PREEMPTION_PARITY, "tests/test_engine.py::test_abort_frees_blocks")),
        ),
        needs="the scheduler's plan (admission, scheduler) and the runner (prepare_inputs)",
        capstone="every run steps through your loop"),
    Stage(
        name="admission", lesson=L03, minutes=50,
        title="the waiting queue: admission under seats, budget and blocks",
        targets=tuple(f"minipaged.engine.scheduler:Scheduler.{m}"
                      for m in ("schedule", "_admit_waiting", "admit")),
        concepts=(
            Concept("the waiting queue and max_num_seqs", L03,
                    "3. `max_num_seqs`: the queue (course note 002)",
                    _tests(SCHED, "test_max_num_seqs_caps_running_sequences",
                           "test_new_prefill_shares_a_step_with_decodes")),
            Concept("the token budget and chunked prefill", L03,
                    "4. Chunked prefill: long prompts share the step with decodes",
                    _tests(SCHED, "test_token_budget_is_never_exceeded_with_many_prompts",
                           "test_chunked_prefill_splits_a_long_prompt",
                           "test_chunk_samples_only_when_it_reaches_the_end",
                           "test_without_chunked_prefill_a_too_long_prompt_waits",
                           "test_without_chunked_prefill_a_fitting_prompt_runs_whole")),
            Concept("admission with a cached prefix: only the rest costs budget", L02,
                    "3. Prefix caching: sharing blocks between requests",
                    ("tests/test_sharing.py::test_prefix_cache_statistics_for_a_shared_system_"
                     "prompt",
                     "tests/test_sharing.py::test_requests_arriving_together_prefill_the_"
                     "shared_prompt_once[torch_ref]")),
            Concept("iteration-level scheduling runs every workload to completion", L03,
                    "2. The course note's example: A finishes, E takes its seat",
                    _tests(SCHED, "test_random_workloads_run_to_completion")),
        ),
        needs="block_manager: get_computed_blocks, can_allocate, allocate",
        capstone="every request of every run is admitted by you"),
    Stage(
        name="scheduler", lesson=L03, minutes=60,
        title="the running set: the token-budget loop with recompute preemption",
        targets=tuple(f"minipaged.engine.scheduler:Scheduler.{m}"
                      for m in ("_schedule_running", "_preempt_last", "preempt", "finish")),
        concepts=(
            Concept("decodes first, then prefill chunks, within the token budget", L03,
                    "4. Chunked prefill: long prompts share the step with decodes",
                    _tests(SCHED, "test_decodes_are_scheduled_before_prefill_chunks",
                           "test_token_budget_is_never_exceeded_with_many_prompts",
                           "test_chunked_prefill_splits_a_long_prompt")),
            Concept("recompute preemption: the most recently admitted gives its blocks back",
                    L03, "5. Preemption: when the KV cache runs out",
                    _tests(SCHED, "test_preemption_takes_the_most_recently_admitted",
                           "test_preempting_a_decode_already_scheduled_this_step",
                           "test_a_block_planned_then_preempted_in_the_same_pass_is_unpublished",
                           "test_a_lone_sequence_that_cannot_grow_preempts_itself")
                    + (PREEMPTION_PARITY, "tests/test_preemption_modes.py::test_greedy_outputs_"
                       "identical_in_all_three_modes")),
            Concept("every workload runs to completion and gives its blocks back", L03,
                    "5. Preemption: when the KV cache runs out",
                    _tests(SCHED, "test_random_workloads_run_to_completion",
                           "test_finish_frees_blocks")),
        ),
        needs="block_manager: can_append, append_slots, free",
        capstone="the parity run preempts: your loop chooses the victims"),
    Stage(
        name="sampler", lesson=L04, minutes=60,
        title="the sampler: temperature, top-k / top-p / min-p, seeded draws",
        targets=("minipaged.sampling.sampler:apply_top_k_top_p_min_p",
                 "minipaged.sampling.sampler:Sampler._sample"),
        concepts=(
            Concept("temperature and the exponential race draw from softmax(logits / T)", L04,
                    "5. Does the engine draw what it says?",
                    _tests(SAMPLER, "test_temperature_sampling_matches_softmax",
                           "test_greedy_rows_take_the_argmax_in_a_mixed_batch")),
            Concept("truncation: top-k, top-p and min-p, batched per row", L04,
                    "4. Truncation: top-k, top-p, min-p",
                    _tests(SAMPLER,
                           "test_top_k_top_p_min_p_support_matches_reference_random",
                           "test_top_k_1_and_tiny_top_p_keep_only_the_argmax",
                           "test_top_p_at_midpoints_between_cumulative_masses",
                           "test_top_p_reached_exactly_needs_no_further_token",
                           "test_min_p_keeps_tokens_within_ratio_of_the_top_token",
                           "test_disabled_filters_keep_the_whole_vocabulary",
                           "test_top_k_sampling_matches_the_truncated_softmax")),
            Concept("seeds: a seeded request draws the same tokens in any batch", L04,
                    "6. Seeds and reproducibility",
                    _tests(SAMPLER, "test_seeded_requests_do_not_depend_on_the_batch")
                    + ("tests/test_engine.py::test_seeded_sampling_reproducible_across_batches",)),
        ),
        needs="nothing from earlier stages: logits in, tokens out",
        capstone="the seeded sampled requests draw with your sampler"),
    Stage(
        name="online_softmax", lesson=L05, minutes=45,
        title="paged attention over a block-table walk with an online softmax",
        targets=("minipaged.attention.online_softmax:online_softmax_attention",),
        concepts=(
            Concept("the block-table walk: logical block i lives in physical block table[i]",
                    L05, "2. The block-table walk",
                    ("tests/test_torch_ref.py::test_decodes_at_block_edges_match_the_reference",
                     "tests/test_torch_ref.py::test_prefills_and_chunks_over_a_cached_prefix_"
                     "match_the_reference")),
            Concept("the online softmax: rescale by exp(m_old - m_new) as the max grows", L05,
                    "3. Online softmax, with numbers",
                    ("tests/test_torch_ref.py::test_large_scores_do_not_overflow",
                     "tests/test_torch_ref.py::test_bf16_inputs_match_the_reference")),
        ),
        needs="the cache layout the block manager's tables index (block, offset)",
        capstone="the parity run's attention is yours, one sequence at a time"),
    Stage(
        name="triton_attention", lesson=L05, minutes=90,
        title="the Triton kernels: store K/V, a key tile of attention, the split-KV merge",
        targets=("minipaged.attention.triton_kernels:store_kv_kernel",
                 "minipaged.attention.triton_kernels:_attend_key_tile",
                 "minipaged.attention.triton_kernels:reduce_splits_kernel"),
        concepts=(
            Concept("store_kv: each new token's K/V into its slot, padding skipped", L05,
                    "1. The cache, the block table, and the reference gather",
                    ("tests/test_triton_kernels.py::test_store_kv_writes_every_slot_and_skips_"
                     "padding",
                     "tests/test_triton_kernels.py::test_backend_forward_equals_torch_ref_"
                     "backend[mixed]")),
            Concept("a key tile: the block-table walk inside a kernel", L05,
                    "2. The block-table walk",
                    tuple(f"tests/test_triton_kernels.py::test_decode_matches_reference[{p}]"
                          for p in ("1-stories260K-bs8-fp32", "4-stories260K-bs8-fp32",
                                    "1-gqa3-d40-bs32-fp32", "4-gqa8-d64-bs128-fp16"))),
            Concept("the online softmax per tile, with causal masks for prefill", L05,
                    "3. Online softmax, with numbers",
                    ("tests/test_triton_kernels.py::test_mixed_prefill_and_decode_matches_"
                     "reference[stories260K-bs8-fp32]",)),
            Concept("split-KV: parts of the keys merged by their share of the softmax mass",
                    L05, "5. Split-KV (flash-decoding) and the reduction",
                    ("tests/test_triton_kernels.py::test_prefill_with_splits_and_long_query"
                     "[16-16]",
                     "tests/test_triton_kernels.py::test_decode_padding_sequence_with_no_keys_"
                     "gives_zeros[4]",
                     "tests/test_triton_kernels.py::test_decode_more_splits_than_key_tiles")),
        ),
        needs="online_softmax: the same recurrence, now per tile of keys in Triton",
        capstone="the kernel run attends with your kernels (the Triton interpreter on a CPU)"),
    Stage(
        name="fork", lesson=L06, minutes=50,
        title="n > 1: one prefill forked into n samples that share its blocks",
        targets=("fork_sequence=minipaged.engine.sequence:Sequence.fork",
                 "fork_block_table=minipaged.engine.block_manager:BlockManager.fork",
                 "fork_running=minipaged.groups.scheduling:GroupScheduling.fork",
                 "minipaged.groups.sampling:split_groups"),
        concepts=(
            Concept("fork: the child shares every block of its parent (ref counts + 1)", L06,
                    "1. Parallel sampling: one prefill, then a fork",
                    _tests(BM, "test_fork_shares_blocks_and_copy_on_write_splits_the_partial_block",
                           "test_block_manager_state_machine")
                    + ("tests/test_sharing.py::test_prompt_prefilled_once_then_forked_with_copy_"
                       "on_write",)),
            Concept("n samples of one prefill: each is the request it would be alone", L06,
                    "1. Parallel sampling: one prefill, then a fork",
                    ("tests/test_sharing.py::test_each_sample_is_the_request_it_would_be_alone",
                     "tests/test_sharing.py::test_greedy_samples_equal_greedy",
                     "tests/test_sharing.py::test_request_reported_once_when_all_samples_"
                     "finished",
                     "tests/test_sharing.py::test_prompt_reserves_a_seat_per_sample")),
            Concept("samples and the prefix cache under memory pressure", L06,
                    "5. When memory runs out: recompute or swap?",
                    ("tests/test_sharing.py::test_n_samples_fork_against_n_requests_through_the_"
                     "prefix_cache",
                     "tests/test_preemption_modes.py::test_samples_and_beams_survive_preemption_"
                     "in_all_modes")),
        ),
        needs="block_manager: append_slots copies a shared block before a sample writes it",
        capstone="the parity run's n = 2 request forks with your code"),
    Stage(
        name="beam_search", lesson=L06, minutes=75,
        title="a beam step: Hugging Face's rules, then fork the chosen, free the dropped",
        targets=("minipaged.groups.beam_search:BeamSearchState.step",
                 "minipaged.groups.sampling:beam_step"),
        concepts=(
            Concept("Hugging Face's beam rules: 2k candidates, finished hypotheses, early "
                    "stopping", L06, "2. Beam search: fork the chosen, free the dropped",
                    ("tests/test_beam_search.py::test_token_exact_with_hf",
                     "tests/test_beam_search.py::test_width_one_is_greedy",
                     "tests/test_beam_search.py::test_ignore_eos_with_hf_on_the_real_model")),
            Concept("the blocks follow the beams: fork the chosen, free the dropped", L06,
                    "2. Beam search: fork the chosen, free the dropped",
                    ("tests/test_beam_search.py::test_beams_fork_free_and_copy_on_write_every_"
                     "step",
                     "tests/test_beam_search.py::test_abort_beam_search_frees_blocks",
                     "tests/test_preemption_modes.py::test_samples_and_beams_survive_preemption_"
                     "in_all_modes")),
        ),
        needs="fork: fork_running and fork_sequence give a chosen parent its children",
        capstone="the beam search of the capstone steps with your rules"),
    Stage(
        name="rejection_sampler", lesson=L10, minutes=90,
        title="speculative decoding's rule: accept min(1, p/q), else draw from max(0, p - q)",
        targets=("minipaged.sampling.rejection_sampler:rejection_sample",
                 "minipaged.sampling.rejection_sampler:_correction_weights",
                 "minipaged.sampling.rejection_sampler:_draws"),
        concepts=(
            Concept("accept with probability min(1, p/q): the output follows p exactly", L10,
                    "1. Why the output is exactly the target's",
                    _tests("test_rejection_sampler.py", "test_first_token_follows_target",
                           "test_second_token_follows_target_after_an_acceptance",
                           "test_bonus_token_follows_the_target_after_the_guesses",
                           "test_threshold_rejects_biased_rules",
                           "test_one_hot_rule_is_lossless_for_any_guess",
                           "test_ngram_guesses_follow_target",
                           "test_zero_residual_falls_back_to_target")),
            Concept("greedy rows, padding and rows without proposals", L10,
                    "1. Why the output is exactly the target's",
                    _tests("test_rejection_sampler.py", "test_greedy_accepts_while_argmax_agrees",
                           "test_greedy_ignores_draft_probs_and_randomness",
                           "test_mixed_greedy_and_sampled_rows", "test_padding_is_never_accepted",
                           "test_padding_is_never_accepted_by_sampled_rows",
                           "test_row_without_proposals_samples_from_position_zero",
                           "test_no_speculation_at_all", "test_shape_errors_name_the_argument")),
            Concept("seeded rows replay whatever the batch, in the engine too", L10,
                    "3. One step on the block table",
                    ("tests/test_rejection_sampler.py::test_seeded_rows_replay_whatever_the_batch",
                     "tests/test_spec_decode.py::test_seeded_sampling_is_reproducible")),
        ),
        needs="sampler: the same exponential race draws the corrected token",
        capstone="the speculative run verifies with your rule"),
    Stage(
        name="priority", lesson=L13, minutes=40,
        title="the priority policy: its sort key, and when a waiting request may preempt",
        targets=("minipaged.priority.scheduling:priority_key",
                 "minipaged.priority.scheduling:PriorityScheduling.can_displace"),
        concepts=(
            Concept("both queues in priority order: priority, then arrival, then creation",
                    L13, "5. Priorities",
                    _tests(PRIO, "test_priority_key_is_priority_then_arrival_then_creation",
                           "test_waiting_queue_is_kept_in_priority_order",
                           "test_preempted_request_goes_back_to_its_place_in_priority_order",
                           "test_without_priorities_the_policy_plans_exactly_like_fcfs")),
            Concept("preempt only a strictly less urgent request, only when room is missing",
                    L13, "5. Priorities",
                    _tests(PRIO, "test_high_priority_waiting_request_preempts_the_least_urgent_"
                           "latest_arrival", "test_equal_priority_never_preempts_a_running_request",
                           "test_seat_limit_preemption", "test_without_chunked_prefill_a_prompt_"
                           "over_the_budget_preempts_nobody", "test_later_high_priority_request_"
                           "finishes_before_earlier_low_priority_ones")),
            Concept("the engine under the policy: urgent first, every workload finishes, the "
                    "tokens unchanged", L13, "5. Priorities",
                    _tests(PRIO, "test_random_workloads_with_priorities_finish_and_keep_the_"
                           "queues_ordered", "test_engine_serves_a_late_urgent_request_first_"
                           "and_the_tokens_do_not_change")),
            Concept("the simulator plans like the real engine, step for step, under the policy",
                    L13, "2. The engine on a virtual clock",
                    ("tests/test_simulator.py::test_plans_match_the_real_engine_step_for_step"
                     "[priority]",)),
        ),
        needs="admission, scheduler: admit places what fits, _preempt_last frees the last one",
        capstone="the priorities run (when this stage is yours) schedules with your policy"),
)


def get_stage(name: str) -> Stage:
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise KeyError(f"no stage {name!r}; the stages are: " + ", ".join(s.name for s in STAGES))
