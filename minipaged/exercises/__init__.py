"""Build it yourself: rebuild the engine's central pieces, graded by the project's own tests.

Lessons 02-06, 10 and 13 each end with one exercise (tiny-llm's graders are the model). Each
exercise is a *skeleton* module in this folder: the real signatures and docstrings of the
functions to write, bodies that raise NotImplementedError. The registry below says which real
symbols they replace and which of the project's tests grade them.

    minipaged exercise list                   the exercises, their lessons and what to write
    minipaged exercise start NAME             copies the skeleton to exercises/NAME.py (your file)
    minipaged exercise check NAME [--file F]  runs the graders with your functions swapped in
    minipaged exercise check NAME --solution  the same with the project's own code
    minipaged exercise solution NAME          prints the solution

The solutions are the project's code itself, so they cannot drift: `--solution` grades the
skeleton with every function body replaced by the real one's source (grading.solution_source).

    grading.py   load a learner's file, swap it in for the real symbols, write the solution
    plugin.py    the pytest plugin `check` runs the graders with (`-p minipaged.exercises.plugin`)
    cli.py       `minipaged exercise ...`
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Exercise:
    name: str  # also the skeleton's module name, and the learner's file exercises/<name>.py
    lessons: tuple[str, ...]  # the notebooks that explain the piece and end with this exercise
    summary: str
    # The real symbols the learner's functions replace, as "module:qualname"; a learner's
    # function has the qualname's last part as its name (a method is written as a plain
    # function taking `self`).
    targets: tuple[str, ...]
    # The graders: pytest node ids relative to the repository root. Every one of them fails
    # on the untouched skeleton and passes on the solution (tests/test_exercises.py).
    tests: tuple[str, ...]

    @property
    def functions(self) -> tuple[str, ...]:
        """The names the learner's file must define."""
        return tuple(t.split(":")[1].split(".")[-1] for t in self.targets)

    @property
    def skeleton_path(self) -> Path:
        return Path(__file__).with_name(f"{self.name}.py")


_BM = "tests/test_block_manager.py::"
_SCHED = "tests/test_scheduler.py::"
_SAMPLER = "tests/test_sampler.py::"
_REJECTION = "tests/test_rejection_sampler.py::"  # all but the CUDA test (a skip grades nothing)
_PRIORITY = "tests/test_priority_scheduling.py::"  # the scheduler's and the engine's, not the API's

EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        name="block_manager",
        lessons=("02_block_manager", "06_sharing_and_preemption"),
        summary="grow a block table, fork it, copy-on-write a shared block, free it",
        targets=tuple(f"minipaged.engine.block_manager:BlockManager.{m}"
                      for m in ("_needs_cow", "append_slots", "fork", "free")),
        tests=(
            _BM + "test_block_manager_state_machine",
            _BM + "test_freed_blocks_stay_cached_and_are_reused",
            _BM + "test_lru_eviction_order",
            _BM + "test_fork_shares_blocks_and_copy_on_write_splits_the_partial_block",
            _BM + "test_can_append_counts_the_copy_on_write_block",
            _BM + "test_usage_numbers",
            _BM + "test_allocate_twice_and_double_free_raise",
            "tests/test_preemption_modes.py::test_swap_round_trip_is_bit_exact_and_keeps_sharing",
            "tests/test_sharing.py::test_prompt_prefilled_once_then_forked_with_copy_on_write",
            "tests/test_sharing.py::test_each_sample_is_the_request_it_would_be_alone",
        )),
    Exercise(
        name="scheduler",
        lessons=("03_continuous_batching",),
        summary="the token-budget loop over running sequences, preempting when the cache is full",
        targets=("minipaged.engine.scheduler:Scheduler._schedule_running",),
        tests=(
            "tests/test_scheduler.py",
            "tests/test_parity.py::test_stories260k_under_preemption_and_chunked_prefill",
            "tests/test_preemption_modes.py::test_greedy_outputs_identical_in_all_three_modes",
        )),
    Exercise(
        name="top_k_top_p",
        lessons=("04_sampling",),
        summary="the top-k / top-p / min-p mask, batched over rows with different parameters",
        targets=("minipaged.sampling.sampler:apply_top_k_top_p_min_p",),
        tests=(
            _SAMPLER + "test_top_k_top_p_min_p_support_matches_reference_random",
            _SAMPLER + "test_top_k_1_and_tiny_top_p_keep_only_the_argmax",
            _SAMPLER + "test_top_p_at_midpoints_between_cumulative_masses",
            _SAMPLER + "test_top_p_reached_exactly_needs_no_further_token",
            _SAMPLER + "test_min_p_keeps_tokens_within_ratio_of_the_top_token",
            _SAMPLER + "test_disabled_filters_keep_the_whole_vocabulary",
            _SAMPLER + "test_top_k_sampling_matches_the_truncated_softmax",
        )),
    Exercise(
        name="rejection_sampler",
        lessons=("10_speculative_decoding",),
        summary="speculative decoding's rule: accept min(1, p/q), else draw from max(0, p - q)",
        targets=("minipaged.sampling.rejection_sampler:rejection_sample",
                 "minipaged.sampling.rejection_sampler:_correction_weights"),
        tests=tuple(_REJECTION + t for t in (
            "test_first_token_follows_target",
            "test_second_token_follows_target_after_an_acceptance",
            "test_bonus_token_follows_the_target_after_the_guesses",
            "test_threshold_rejects_biased_rules",
            "test_one_hot_rule_is_lossless_for_any_guess",
            "test_ngram_guesses_follow_target",
            "test_zero_residual_falls_back_to_target",
            "test_greedy_accepts_while_argmax_agrees",
            "test_greedy_ignores_draft_probs_and_randomness",
            "test_mixed_greedy_and_sampled_rows",
            "test_padding_is_never_accepted",
            "test_padding_is_never_accepted_by_sampled_rows",
            "test_row_without_proposals_samples_from_position_zero",
            "test_no_speculation_at_all",
            "test_shape_errors_name_the_argument",
            "test_seeded_rows_replay_whatever_the_batch",
        )) + ("tests/test_spec_decode.py::test_seeded_sampling_is_reproducible",)),
    Exercise(
        name="priority",
        lessons=("13_serving_under_load",),
        summary="the priority policy: its sort key and when a waiting request may preempt",
        targets=("minipaged.priority.scheduling:priority_key",
                 "minipaged.priority.scheduling:PriorityScheduling.can_displace"),
        tests=tuple(_PRIORITY + t for t in (
            "test_priority_key_is_priority_then_arrival_then_creation",
            "test_waiting_queue_is_kept_in_priority_order",
            "test_later_high_priority_request_finishes_before_earlier_low_priority_ones",
            "test_high_priority_waiting_request_preempts_the_least_urgent_latest_arrival",
            "test_equal_priority_never_preempts_a_running_request",
            "test_seat_limit_preemption",
            "test_preempted_request_goes_back_to_its_place_in_priority_order",
            "test_without_chunked_prefill_a_prompt_over_the_budget_preempts_nobody",
            "test_without_priorities_the_policy_plans_exactly_like_fcfs",
            "test_random_workloads_with_priorities_finish_and_keep_the_queues_ordered",
            "test_engine_serves_a_late_urgent_request_first_and_the_tokens_do_not_change",
        )) + ("tests/test_simulator.py::test_plans_match_the_real_engine_step_for_step[priority]",)),
    Exercise(
        name="online_softmax",
        lessons=("05_paged_attention_kernel",),
        summary="paged attention over one block-table walk with an online softmax",
        targets=("minipaged.attention.online_softmax:online_softmax_attention",),
        tests=("tests/test_torch_ref.py",)),
)


def get_exercise(name: str) -> Exercise:
    for ex in EXERCISES:
        if ex.name == name:
            return ex
    raise KeyError(f"no exercise {name!r}; the exercises are: "
                   + ", ".join(ex.name for ex in EXERCISES))
