"""``zgraph.distribute(process_group=...)``: a step sharded over, and communicating within, some of the ranks."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks


def test_two_groups_train_their_own_models_like_eager():
    run_ranks(4, "group_cases.two_groups_train_their_own_models", timeout=600)


def test_another_stage_on_a_split_model_is_refused_and_backward_still_matches_eager():
    run_ranks(2, "group_cases.another_stage_is_refused_and_the_backward_still_runs", timeout=600)


def test_zgraph_groups_on_gloo_run_one_collective_at_a_time():
    run_ranks(2, "group_cases.zgraph_groups_run_one_collective_at_a_time", timeout=300)


@pytest.mark.parametrize("user_group", [True, False], ids=["user-started", "zgraph-started"])
def test_at_exit_zgraph_destroys_its_groups_and_a_default_group_only_if_it_started_it(user_group):
    run_ranks(2, "group_cases.exit_hook_destroys_zgraph_groups_only", init_group=user_group, timeout=300)
