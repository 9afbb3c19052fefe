"""OpenEngine v1 protocol stubs (generated; see build.py)."""
