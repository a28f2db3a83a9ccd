"""Launchers: the `epd` command, `up`, `serve` and `bench`; they sit above every service."""
