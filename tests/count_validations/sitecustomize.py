"""Loaded by every Python process of a test that puts this folder on PYTHONPATH: each call of
``ddppipe.settings.config.validate`` appends a line (the process's command line) to a file named
by its pid in $DDPPIPE_TEST_VALIDATIONS, and each call of ``ddppipe.settings.config.resolve``
a line (the run's name) to one in $DDPPIPE_TEST_RESOLVES. Lines, not a count at exit: the
ranks leave with ``os._exit``."""

import os
import sys


def _count_validations(folder: str) -> None:
    from ddppipe.settings import config

    validate = config.validate

    def counted(cfg):  # type: ignore[no-untyped-def]
        with open(os.path.join(folder, str(os.getpid())), "a") as f:
            f.write(" ".join(sys.argv) + "\n")
        return validate(cfg)

    config.validate = counted


def _count_resolves(folder: str) -> None:
    from ddppipe.settings import config

    resolve = config.resolve

    def counted(cfg, gpus):  # type: ignore[no-untyped-def]
        with open(os.path.join(folder, str(os.getpid())), "a") as f:
            f.write(f"{cfg.get('run')}\n")
        return resolve(cfg, gpus)

    config.resolve = counted


if os.environ.get("DDPPIPE_TEST_RESOLVES"):
    _count_resolves(os.environ["DDPPIPE_TEST_RESOLVES"])
if os.environ.get("DDPPIPE_TEST_VALIDATIONS"):
    _count_validations(os.environ["DDPPIPE_TEST_VALIDATIONS"])
