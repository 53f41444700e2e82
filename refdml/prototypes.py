"""Placeholder: this module is being written in this change."""
