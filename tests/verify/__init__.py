"""The testinfra verify suite: pytest tests/verify --inventory INVENTORY (see conftest.py)."""
