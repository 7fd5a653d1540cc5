"""The Kubernetes contract suite: the API behaviour gpush's adapter relies on, checked on the
test API server in CI and on a real cluster when an admin asks (see conftest.py)."""
