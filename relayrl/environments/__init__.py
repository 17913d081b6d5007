"""environments."""
