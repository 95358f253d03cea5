"""The one place gdp_jax filters Pallas' Triton-backend deprecation warning (see README, "Warnings")."""
from __future__ import annotations

import contextlib
import warnings


@contextlib.contextmanager
def triton_backend_warning_filtered():
    """Around our own pallas_calls only, never globally: jax >= 0.11 flags the Triton backend as
    deprecated, and it is the backend our kernels target."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*[Tt]riton.*", category=DeprecationWarning)
        yield
