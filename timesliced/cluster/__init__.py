"""Multi-node: peer transport, discovery and the cluster cores."""
