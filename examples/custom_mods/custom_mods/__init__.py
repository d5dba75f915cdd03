"""custom_mods: A Flower app with custom mods."""
