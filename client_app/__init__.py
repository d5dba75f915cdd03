"""The ClientApp: a hospital's side of every run, beside its own data."""
