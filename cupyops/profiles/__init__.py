"""Device tuning profiles of the row-wise planners (JSON, read by cupyops.profile)."""
