"""Commands: `python -m scripts.NAME` from the repository root (README, "Where things are")."""
