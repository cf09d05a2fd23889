#!/usr/bin/env bash
# System packages the tests need beyond Python: filled in by the SLURM and Apptainer work.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
for script in "$here"/install_slurm.sh "$here"/install_apptainer.sh; do
  if [ -f "$script" ]; then
    bash "$script"
  fi
done

# Headless Chromium and its driver: tests/test_scaling.py opens the report in a real browser
# (selenium drives /usr/bin/chromedriver; nothing is downloaded at test time).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium chromium-driver
fi
