"""The `cupyops` command line (click)."""
