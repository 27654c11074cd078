# The two commands of the README. Each sets up .venv first (idempotent).
VENV ?= .venv

.PHONY: replay test lint setup

setup:
	@scripts/bootstrap.sh

# Main job: replay the bundled seed corpus on unfixed and fixed vLLM.
# kvfuzz exits 1 when it reports findings (expected here: `unfixed` has the
# bug); bad input or usage (exit 2) and kvfuzz's own failure (exit 3) fail
# this target with kvfuzz's exit code.
replay: setup
	@$(VENV)/bin/kvfuzz replay corpora/seeds; rc=$$?; \
	    if [ $$rc -ne 0 ] && [ $$rc -ne 1 ]; then exit $$rc; fi

# Tests (unit, oracle, real-vLLM integration), lint, the type checker
# (mypy, strict on differential/ and fuzz/: [tool.mypy] in pyproject.toml) and
# the floors of the code as import contracts ([tool.importlinter]).
test: setup
	@$(VENV)/bin/ruff check differential fuzz tests benchmarks
	@$(VENV)/bin/mypy
	@$(VENV)/bin/lint-imports --no-logo --no-cache
	@KVFUZZ_REQUIRE_VLLM=1 KVFUZZ_REQUIRE_RELEASES=1 $(VENV)/bin/python -m pytest -n 2 --dist worksteal || { rc=$$?; \
	    if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5): nothing to fail"; \
	    else exit $$rc; fi; }
