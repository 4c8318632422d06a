"""The simulated GPU: device memory as shared files, for laptops, CI and the demo.

``layout`` is the on-disk format the daemon writes; ``region`` is the client's view of it.
The daemon's side (arenas, parking, restoring) is the ``sim`` backend.
"""

# The simulated host<->device link's default bandwidth, in bytes per second (one direction; a swap
# uses both at once). 2 GB/s because the sim must be able to honour it on a small machine: a park
# writes into pages the tmpfs allocates afresh, which a 2-core machine copies at about 3 GB/s
# (``timesliced bench copy``: 2.9-3.6 GB/s here, against a warm-copy ceiling of 10-12 GB/s), and a
# restore reads at 4-5 GB/s; 2 GB/s leaves a third in hand for a loaded machine. A real PCIe link is
# faster (about 25 GB/s for PCIe 4.0 x16), so a switch on the sim costs more than on a GPU: a
# benchmark on the sim shows the daemon's switch costs with a modest link, never page faults.
DEFAULT_BANDWIDTH = 2e9

# How many bytes of restored jobs' parked files the simulated GPU keeps, mapped, for the next parks to
# write into (``timesliced.backends.sim_buffers``): a park into them copies at the machine's warm copy
# rate instead of the rate the tmpfs allocates new pages at. 1 GiB: a switch of jobs up to that size
# is warm after its first round, while a small machine keeps most of its memory; the pool counts as
# room for parked state, so it never makes a park refused. ``--sim-pool`` sizes it, 0 turns it off.
DEFAULT_POOL = 1 << 30
