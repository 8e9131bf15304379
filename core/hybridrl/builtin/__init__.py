"""Default plugins shipped with the core; they register through the same hooks as any plugin."""
