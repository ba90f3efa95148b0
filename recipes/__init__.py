"""msModelSlim-schema YAML recipes shipped with npuport (data, not code)."""
