"""Single-process DSpark engine (torch; never ray)."""
