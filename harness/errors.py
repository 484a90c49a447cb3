class UsageError(Exception):
    """Bad input from the user: the CLI prints the one-line message and exits 2, no traceback."""
