"""Backends park and restore a job's device state on this node."""
