"""A share of the limit that pressure alerts watch for: gpumem.on_pressure's and GPUMEM_WARN_AT's,
read and checked (gpumem.monitoring.pressure watches)."""
from __future__ import annotations

import numbers

SHARE_FORMS = "a share of the limit in (0, 1], such as 0.85"


def check_share(share: object) -> float:
    """`share` as a float in (0, 1]; TypeError or ValueError naming it otherwise."""
    if isinstance(share, bool) or not isinstance(share, numbers.Real):
        raise TypeError(f"gpumem: pressure share {share!r:.40} ({type(share).__name__}) is not a number; "
                        f"give {SHARE_FORMS}")
    value = float(share)
    if not 0.0 < value <= 1.0:  # NaN fails too
        raise ValueError(f"gpumem: bad pressure share {share!r:.40}: give {SHARE_FORMS}")
    return value


def share_of_text(text: str) -> float:
    """GPUMEM_WARN_AT's share; ValueError for anything but a number in (0, 1]."""
    if len(text) > 32:
        raise ValueError("too long for a share")
    return check_share(float(text.strip()))
