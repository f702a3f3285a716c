"""Hypothesis profiles of the fuzz suite, chosen by ``MESHKIT_PROFILE``.

``meshkit-fuzz-ci`` (default): 300 examples per property. ``meshkit-fuzz-full``
(``MESHKIT_PROFILE=full``): 10,000. The profiles are registered here and applied
per test (``@settings(fuzz_settings())``), so other suites keep their own.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,
    "print_blob": True,
    "suppress_health_check": [
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
}
settings.register_profile("meshkit-fuzz-ci", max_examples=300, **_COMMON)  # type: ignore[arg-type]
settings.register_profile("meshkit-fuzz-full", max_examples=10_000, **_COMMON)  # type: ignore[arg-type]


def profile_name() -> str:
    full = os.environ.get("MESHKIT_PROFILE", "").strip().lower() == "full"
    return "meshkit-fuzz-full" if full else "meshkit-fuzz-ci"
