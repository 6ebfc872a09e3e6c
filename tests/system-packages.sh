#!/usr/bin/env bash
# The system programs the test suite runs for real (`make test` calls this first):
#   redis-server              the Redis cache tier, the fleet log, fault tests
#   chromium, chromedriver    the dashboard test (headless browser)
#   promtool                  the Prometheus config and alert-rule tests
# Installs what is missing with apt-get when it can (root, or passwordless sudo); otherwise
# stops with one message naming what is missing and the command that installs it.
set -euo pipefail
declare -A package_of=(
  [redis-server]=redis-server
  [chromium]=chromium
  [chromedriver]=chromium-driver
  [promtool]=prometheus
)
missing=()
for program in "${!package_of[@]}"; do
  command -v "$program" >/dev/null 2>&1 || missing+=("${package_of[$program]}")
done
((${#missing[@]} == 0)) && exit 0
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
install="apt-get install -y --no-install-recommends ${missing[*]}"
if command -v apt-get >/dev/null 2>&1; then
  sudo=()
  if ((EUID != 0)); then
    if sudo -n true 2>/dev/null; then sudo=(sudo -n); else sudo=(false); fi
  fi
  if [[ ${sudo[*]-} != false ]]; then
    echo "installing system packages for the tests: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    exit 0
  fi
fi
echo "make test needs system packages that are missing: ${missing[*]}" >&2
echo "install them (as root) with: $install" >&2
exit 1
