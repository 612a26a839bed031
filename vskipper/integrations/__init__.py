"""Integrations with serving engines. Nothing here is imported by the core package."""
