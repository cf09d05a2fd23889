#!/usr/bin/env bash
# System packages the tests need beyond Python: filled in by the SLURM and Apptainer work.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
for script in "$here"/install_slurm.sh "$here"/install_apptainer.sh; do
  if [ -f "$script" ]; then
    bash "$script"
  fi
done
