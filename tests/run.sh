#!/usr/bin/env bash
# Sets up a virtual environment and runs the whole test suite: lint, types, tests.
# Usage: bash tests/run.sh [pytest arguments]. Needs python3 (>= 3.11) and the PostgreSQL server
# at 127.0.0.1:5432 (database "test", trust auth) that the archive tests run against.
#   bash tests/run.sh                  everything (CI, the README's test command)
#   bash tests/run.sh -m "not slow"    the quick tier: all but the end-to-end, soak and load tests
#   bash tests/run.sh tests/test_x.py  one module; add -n 0 to run it in this process
# Tests run on parallel workers (pytest-xdist): twice the cores, at most 8; SUSTAIN_TEST_WORKERS
# sets the number.
set -euo pipefail
cd "$(dirname "$0")/.."

# System tools the tests run for real: promtool and the Prometheus server (rules, dashboards, the
# end-to-end scrape), shellcheck (the container entrypoint), initdb/pg_ctl (a private PostgreSQL
# instance that a test stops and starts; PostgreSQL's own package provides them), openssl (test
# certificates for the exporter's TLS), systemd-analyze (the unit file), chromium (the run plots and
# the planner's report, opened headless as a person would: tests/test_report.py), victoria-metrics
# (the long-term store Prometheus remote-writes to: tests/test_victoriametrics.py).
missing=()
command -v promtool >/dev/null || missing+=(prometheus)
command -v shellcheck >/dev/null || missing+=(shellcheck)
command -v openssl >/dev/null || missing+=(openssl)
command -v systemd-analyze >/dev/null || missing+=(systemd)
command -v chromium >/dev/null || missing+=(chromium)
command -v victoria-metrics >/dev/null || missing+=(victoria-metrics)
# pgbouncer (transaction pooling in front of the fleet database: tests/test_pgbouncer.py) is in
# /usr/sbin, which a user's PATH may lack.
command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "tests/run.sh: install ${missing[*]} (Debian packages) first" >&2
    exit 1
  fi
fi

python3 -m venv .venv
# torch is pinned to the CPU build here; the project itself accepts any torch >= 2.3.
.venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e '.[dev]'

.venv/bin/ruff check .
.venv/bin/mypy
status=0
cores="$(nproc)"
workers="${SUSTAIN_TEST_WORKERS:-$((cores * 2 > 8 ? 8 : cores * 2))}"
.venv/bin/python -m pytest -n "$workers" --dist loadgroup "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "tests/run.sh: pytest collected no tests; that is a failure" >&2
fi
exit "$status"
