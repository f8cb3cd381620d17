"""Network definitions, each checkpoint-compatible with its public weight files."""
