"""Store fixtures live in tests/conftest.py (shared with the search and CLI tests)."""
