"""The recipe template of a task image: the base image plus pinned pip packages."""

from __future__ import annotations

import re


def _name(requirement: str) -> str:
    """The normalized (PEP 503) name of a pinned requirement: ``Foo_Bar[x]==1`` -> foo-bar."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\[=]", requirement, maxsplit=1)[0]).lower()


def derived_recipe(base: str, reqs: list[str], base_sha256: str | None = None) -> str:
    """The Apptainer recipe of ``base`` (a path, relative to the build's folder) plus ``reqs``.

    %post pip-installs the requirements into the image's venv with the image's own packages
    as constraints, so torch, CUDA and NCCL stay the base image's; %labels record the list,
    each requirement's installed version and everything the layer added.
    """
    return f"""\
Bootstrap: localimage
From: {base}

# Written by ddppipe (rule build_task_image, `ddppipe build-task-image`) from the config's
# container.requirements: the ddppipe image above plus these pinned packages, installed into
# its venv. The image's own packages keep their versions (pip constraints). Paths are relative
# to this file's folder: build it from there.

%arguments
    CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt

%files
    {{{{ CA_BUNDLE }}}} /opt/ddppipe-build/ca-certificates.crt

{_post(reqs)}
%labels
    ddppipe.requirements {" ".join(reqs)}
    ddppipe.base.sha256 {base_sha256 or "unknown"}
"""


def _post(reqs: list[str]) -> str:
    """The recipe's %post: ``reqs`` pip-installed into the image's venv with its own packages
    as constraints, checked, each one's version and what the layer added appended to the
    labels, the build's folder removed."""
    listed = "\n".join(reqs)
    names = " ".join(_name(r) for r in reqs)
    return f"""\
%post
    set -eu
    # As in containers/ddppipe.def: no host pip configuration, the host's CA bundle for PyPI.
    export PIP_CONFIG_FILE=/dev/null
    export PIP_CERT=/opt/ddppipe-build/ca-certificates.crt
    export PIP_NO_CACHE_DIR=1
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    export PIP_ROOT_USER_ACTION=ignore
    export PIP_DEFAULT_TIMEOUT=180
    cd /opt/ddppipe-build
    cat > requirements.txt <<'EOF'
{listed}
EOF
    /opt/venv/bin/pip list --format=freeze > base.txt
    if ! /opt/venv/bin/pip install --constraint base.txt --requirement requirements.txt; then
        echo "ddppipe: container.requirements conflict with the image's own packages" \\
            "(base.txt: kept at these versions); choose versions compatible with them" >&2
        exit 1
    fi
    /opt/venv/bin/pip check
    /opt/venv/bin/pip list --format=freeze > after.txt
    /opt/venv/bin/python - {names} >> "$APPTAINER_LABELS" <<'EOF'
import importlib.metadata
import sys
from pathlib import Path

before = set(Path("base.txt").read_text().split())
added = sorted(set(Path("after.txt").read_text().split()) - before)
print("ddppipe.requirements.installed", " ".join(added))
for name in sys.argv[1:]:
    print(f"ddppipe.requirement.{{name}}.version", importlib.metadata.version(name))
EOF
    cd /
    rm -rf /opt/ddppipe-build /root/.cache
"""
