"""Bodies of the CLI commands, as coroutines (the CLI module only parses flags)."""
