"""value."""
