"""STAND-IN for freetoken/version.py. The wheelhouse builder rewrites both values per build."""

__version__ = "0.2.1"
# True in a wheel built "broken" (tests/fleet/standins/wheelhouse.py): after loading, /health
# reports an error and the process exits, like a release whose backend worker dies at start.
BROKEN = False
