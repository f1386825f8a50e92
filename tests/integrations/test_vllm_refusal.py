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


def test_a_worker_that_could_not_load_its_bytes_fails_the_round_on_every_trainer_rank():
    """After a round whose bytes all arrived, every worker's state comes back over the sync group; one whose
    loading failed (torn) makes send_weights raise on every trainer rank, naming it, as a transfer-time error
    (rank 0 also marks its client torn); otherwise the states are kept in ``worker_states``."""
    from oarlock.checkpoint import CheckpointError, PlanError
    from oarlock.integrations.vllm import LLMClient, OarlockTrainerWeightTransferEngine

    def states(torn_reason):
        return [None, None] + [{"rank": r, "torn": bool(torn_reason) and r == 3, "torn_reason":
                                torn_reason if r == 3 else "", "report": {"bytes_received": 8}} for r in (2, 3)]

    for is_sender in (True, False):
        engine = object.__new__(OarlockTrainerWeightTransferEngine)  # no vLLM needed for this step
        engine._trainers, engine.is_sender = 2, is_sender
        engine.client = LLMClient(llm=None) if is_sender else None
        engine._landed(states(""), "report")
        assert [s["rank"] for s in engine.worker_states] == [2, 3] and engine.last_report == "report"
        with pytest.raises(CheckpointError) as got:
            engine._landed(states("RuntimeError: loader failed"), "report")
        assert not isinstance(got.value, PlanError) and got.value.phase == "transfer"
        assert "could not load them" in str(got.value) and "vLLM worker 3: RuntimeError: loader failed" in \
            str(got.value)
        if is_sender:
            assert engine.client.torn and "vLLM worker 3" in engine.client.torn_reason
