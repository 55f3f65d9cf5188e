#!/bin/bash
# Mutation testing of the rules that are easiest to break silently (docs/TESTING.md).
#   tests/mutation.sh [SCRATCH_DIR]      needs: pip install -e '.[mutation]'
#   MUTATE="worker_proc/sampler.py" tests/mutation.sh    mutates only the modules named
# mutmut 3 names a mutant by its file's path, and the tests import pagedserve.<pkg>, so the
# run happens in a scratch copy where the folders sit under pagedserve/ (as installed).
# Only the fast (not slow) pure tests run; each mutant runs only the tests that reach it.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
scratch=${1:-$(mktemp -d /tmp/pagedserve-mutation.XXXXXX)}
mkdir -p "$scratch/pagedserve"
cd "$repo"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$scratch"
cd "$scratch"
for pkg in protocol runtime client scheduler_proc worker_proc frontend_proc kernels offline deploy tools bench; do
  rm -rf "pagedserve/$pkg" && mv "$pkg" pagedserve/
done
cp api/__init__.py pagedserve/__init__.py
modules=${MUTATE:-worker_proc/sampler.py scheduler_proc/output_processor.py scheduler_proc/admission.py
                  scheduler_proc/block_manager.py scheduler_proc/prefix_cache.py}
only_mutate=$(printf '"pagedserve/%s", ' $modules)
cat >> pyproject.toml <<TOML

[tool.mutmut]
source_paths = ["pagedserve"]
only_mutate = [${only_mutate%, }]
pytest_add_cli_args = ["-m", "not slow", "-p", "no:cacheprovider", "-q"]
pytest_add_cli_args_test_selection = [
  "tests/unit/test_scheduler_admission.py", "tests/unit/test_scheduler_requests.py", "tests/unit/test_scheduler_policy.py",
  "tests/unit/test_scheduler_sim.py", "tests/unit/test_block_manager.py", "tests/unit/test_prefix_cache.py",
  "tests/unit/test_scheduler_ahead.py", "tests/unit/test_scheduler_draining.py", "tests/unit/test_decode_lane.py",
  "tests/unit/test_output_processor.py", "tests/unit/test_sampler_exact_rules.py", "tests/unit/test_worker_sampler.py",
  "tests/unit/test_worker_sampling_params.py", "tests/unit/test_sliding_window_blocks.py", "tests/unit/test_hybrid_kv_blocks.py",
  "tests/unit/test_router_cache_aware.py", "tests/unit/test_scheduler_lora.py", "tests/unit/test_scheduler_deadlines.py",
  "tests/unit/test_pooling_scheduler.py", "tests/unit/test_scheduler_speculation.py",
  "tests/unit/test_scheduler_speculation_cost.py", "tests/unit/test_structured_output_scheduler.py"]
TOML
# tests/conftest.py drops the repository root (here mutants/, where mutmut runs) from sys.path so
# the installed package runs: the mutated package is reached through a folder of its own instead.
mkdir -p import_root && ln -sfn ../mutants/pagedserve import_root/pagedserve
OMP_NUM_THREADS=1 PYTHONPATH="$scratch/import_root" mutmut run --max-children "${MUTMUT_CHILDREN:-2}"
PYTHONPATH="$scratch/import_root" mutmut results
echo "scratch copy: $scratch (mutmut show NAME there shows a mutant)"
