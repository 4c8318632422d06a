"""Checks on a real NVIDIA GPU: collected only with TIMESLICED_GPU_TESTS=1 (see check.sh and README.md)."""
