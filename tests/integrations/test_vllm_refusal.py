"""How the vLLM back end's refusals reach the trainer (issue 49): a worker that cannot take part refuses within
seconds and every trainer rank raises its reason, never after a rendezvous timeout. The vLLM runs are in
test_vllm_layouts.py (a worker refusing an init request after joining); here, without vLLM, the two paths that do
not involve the workers: an engine that fails its init request before any worker joins (rank 0 sees it, the other
ranks learn it through the trainer's default group), and rank 0 telling the others that the engine refused to
start a round (_vllm_refusal_scenarios.py, 2 gloo ranks)."""

import pytest


@pytest.mark.multiproc
def test_refusals_reach_every_trainer_rank(multirank):
    multirank("_vllm_refusal_scenarios", world=2, timeout_s=120).check()
