"""kvlab.audit: is a server's prompt cache shared, and with whom? Gu et al.'s timing audit
(kvlab.audit.procedure), its exact one-sided KS test (kvlab.audit.ks) and the probes (kvlab.audit.probe).

Example:
    >>> from kvlab.audit import audit
    >>> audit("http://127.0.0.1:8080", "ka", "kb", profile="fast").verdicts()
    {'same-key': 'shared', 'cross-tenant': 'not detected'}
"""

from .ks import KS, critical_d, ks_less
from .procedure import LEVELS, PROFILES, Level, Profile, Report, audit, smallest_shared

__all__ = ["KS", "LEVELS", "PROFILES", "Level", "Profile", "Report", "audit", "critical_d", "ks_less",
           "smallest_shared"]
