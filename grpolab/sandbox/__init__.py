"""Running untrusted code: another uid, resource limits, no network (sandbox.py)."""
