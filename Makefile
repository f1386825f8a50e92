# The two set-up-and-go commands of README.md.
.PHONY: setup setup-tests setup-vllm demo test
VENV := .venv

# .venv with oarlock and what the demo needs (scripts/setup.sh)
setup:
	@bash scripts/setup.sh

# the test services on top: test extras, chromium/graphviz, the DeepSpeed/Megatron, vLLM and Paddle venvs
setup-tests: setup
	@bash scripts/setup_tests.sh

# .vllm-venv: vLLM for CPU, the RL phase's rollout engine (scripts/vllm_env.sh; its own venv, see docs/vllm.md)
setup-vllm:
	@bash scripts/vllm_env.sh

# The main job: fine-tune SmolLM2-135M in layout A (DP2, ZeRO-1), resume in layout B (TP3), export to HF, then
# serve the export in vLLM and reinforce it with GRPO, the weights synced into the engine every step.
demo: setup setup-vllm
	OARLOCK_CACHE=$${OARLOCK_CACHE:-$(CURDIR)/.cache} OARLOCK_VLLM_PYTHON=$(CURDIR)/.vllm-venv/bin/python \
		$(VENV)/bin/oarlock demo $(ARGS)

test: setup-tests
	$(VENV)/bin/python -m pytest -n 2 $(PYTEST_ARGS)
