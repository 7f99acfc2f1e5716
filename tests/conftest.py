from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# deadline=None: the first call into the extension or torch has a one-off cost.
settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile(
    "ci", max_examples=200, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
