"""The lab: how this repository runs and accounts for its grids (not part of jattn)."""
