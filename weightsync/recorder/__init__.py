"""The flight recorder, its analyzer and timeline (private)."""
