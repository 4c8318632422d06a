"""The simulated GPU: device memory as shared files, for laptops, CI and the demo.

``layout`` is the on-disk format the daemon writes; ``region`` is the client's view of it.
The daemon's side (arenas, parking, restoring) is the ``sim`` backend.
"""
