"""Integrations with the frameworks post-training runs on: RL phase hooks and their framework
adapters (``phases``, ``adapters``), Ray actors (``ray``, the ``[ray]`` extra) and a Tinker-style
training service (``service``).

They stand on the client only (never the daemon), so a job imports them without the daemon's parts.
"""
