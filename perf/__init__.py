"""fp8rl subpackage."""
