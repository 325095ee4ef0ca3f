#!/usr/bin/env bash
# Mutation testing of the pure core (frames, records, codecs, layout, push-sum, the privacy budget)
# with mutmut: each mutant is one small change to the code (a flipped comparison, a changed
# constant, a dropped call), run against the unit and property tests that cover it. Prints the
# score per module and every surviving mutant with its reason (scripts/mutation_survivors.toml).
# On demand, not in CI: about 25 minutes on 2 cores. The modules and tests are [tool.mutmut] in
# pyproject.toml.
#
#   scripts/mutation.sh                 # fresh run of everything, then the report
#   scripts/mutation.sh --keep          # reuse ./mutants (and its copy of the tests): finish a stopped run
#   scripts/mutation.sh --report        # only the report of the last run (add --json for JSON)
#   scripts/mutation.sh 'swarmgrad.net.wire*'   # some mutants only (mutmut's name patterns)
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/python ] || { echo "error: run scripts/setup.sh first" >&2; exit 2; }
if ! .venv/bin/python -c 'import mutmut' 2>/dev/null; then
    echo "mutation: installing mutmut into .venv" >&2
    .venv/bin/pip install --quiet --disable-pip-version-check -c requirements-pins.txt -e ".[mutation]"
fi

report_args=()
run_args=()
keep=0
for arg in "$@"; do
    case "$arg" in
        --report) report_only=1 ;;
        --json) report_args+=(--json) ;;
        --keep) keep=1 ;;
        *) run_args+=("$arg") ;;
    esac
done
if [ -z "${report_only:-}" ]; then
    [ "$keep" = 1 ] || rm -rf mutants
    # a mutant that sizes a buffer wrongly can ask for tens of GB: it fails with MemoryError
    # (a kill) instead of taking the machine down
    ulimit -v $((4 * 1024 * 1024))
    # mutmut's own progress line; --max-children: one worker per core
    SWARMGRAD_HYPOTHESIS_PROFILE=mutation .venv/bin/mutmut run --max-children "$(nproc)" "${run_args[@]}"
    echo >&2
fi
exec .venv/bin/python scripts/mutation_report.py "${report_args[@]}"
