# The two set-up-and-go commands of README.md.
.PHONY: setup demo test
VENV := .venv

setup:
	@bash scripts/setup.sh

# The main job: fine-tune SmolLM2-135M in layout A (DP2, ZeRO-1), resume in layout B (TP3), export to HF.
demo: setup
	OARLOCK_CACHE=$${OARLOCK_CACHE:-$(CURDIR)/.cache} $(VENV)/bin/oarlock demo $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest -n 2 $(PYTEST_ARGS)
