# The two set-up-and-go commands of README.md.
.PHONY: setup setup-tests demo test
VENV := .venv

# .venv with oarlock and what the demo needs (scripts/setup.sh)
setup:
	@bash scripts/setup.sh

# the test services on top: test extras, chromium/graphviz, the DeepSpeed/Megatron, vLLM and Paddle venvs
setup-tests: setup
	@bash scripts/setup_tests.sh

# The main job: fine-tune SmolLM2-135M in layout A (DP2, ZeRO-1), resume in layout B (TP3), export to HF.
demo: setup
	OARLOCK_CACHE=$${OARLOCK_CACHE:-$(CURDIR)/.cache} $(VENV)/bin/oarlock demo $(ARGS)

test: setup-tests
	$(VENV)/bin/python -m pytest -n 2 $(PYTEST_ARGS)
