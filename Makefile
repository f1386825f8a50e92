# The two set-up-and-go commands of README.md.
.PHONY: setup setup-tests demo test
VENV := .venv

# .venv with oarlock and what the demo needs (scripts/setup.sh)
setup:
	@bash scripts/setup.sh

# the test services on top: test extras, chromium/graphviz, the DeepSpeed/Megatron, vLLM and Paddle venvs
setup-tests: setup
	@bash scripts/setup_tests.sh

# The main job: fine-tune SmolLM2-135M in layout A (DP2, ZeRO-1), resume in layout B (TP3), export to HF, then
# serve the export in vLLM and reinforce it with GRPO, the weights synced into the engine every step. .vllm-venv
# is built while the file phases run (a first run saves the two minutes of its install); the RL phase waits for
# the exit status the set-up writes.
VLLM_SETUP := $(CURDIR)/.cache/setup-logs/vllm-demo
demo: setup
	@mkdir -p $(dir $(VLLM_SETUP)) && rm -f $(VLLM_SETUP).rc
	@(bash scripts/vllm_env.sh > $(VLLM_SETUP).log 2>&1; echo $$? > $(VLLM_SETUP).tmp; mv $(VLLM_SETUP).tmp $(VLLM_SETUP).rc) & \
	OARLOCK_VLLM_SETUP_RC=$(VLLM_SETUP).rc OARLOCK_VLLM_SETUP_LOG=$(VLLM_SETUP).log \
	OARLOCK_CACHE=$${OARLOCK_CACHE:-$(CURDIR)/.cache} OARLOCK_VLLM_PYTHON=$(CURDIR)/.vllm-venv/bin/python \
		$(VENV)/bin/oarlock demo $(ARGS); rc=$$?; wait; exit $$rc

test: setup-tests
	$(VENV)/bin/python -m pytest -n 2 $(PYTEST_ARGS)
