import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile(
    "ci",
    max_examples=150,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "deep", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture
def run_main(capsys):
    """``run_main(*argv)``: ``kvblocks *argv`` in this process, returning (status, stdout,
    stderr)."""
    from kvblocks.__main__ import main

    def run(*argv: str):
        rc = main(list(argv))
        out, err = capsys.readouterr()
        return rc, out, err

    return run
