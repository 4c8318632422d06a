"""The simulated GPU: device memory as shared files, for laptops, CI and the demo.

``layout`` is the on-disk format the daemon writes; ``region`` is the client's view of it.
The daemon's side (arenas, parking, restoring) is the ``sim`` backend.
"""

# The simulated host<->device link's default bandwidth, in bytes per second (one direction; a swap
# uses both at once). 2 GB/s because the sim must honour it on a small machine at every size, from its
# first switch on: a park into pages the tmpfs allocates afresh (no warm buffer in the pool yet) runs
# at about 2-3 GB/s on a 2-core machine (``timesliced bench copy``: 2.8-3.6 GB/s on one, 1.5-2.2 on a
# slower one, against a warm-copy ceiling of 7-11 GB/s as the machine is loaded). Once the pool is
# warm, lone moves of any size follow models up to about the ceiling of one copy in the sim's chunks
# (6-7 GB/s here), and swaps up to about the ceiling of two such copies at once (3.2-4.1 GB/s each
# here: both directions share the machine's memory), or half the one-copy ceiling for swaps under
# ``SWAP_THREAD_MIN``, which copy their two directions one after the other (``timesliced bench
# copy``). A real PCIe link is faster (about 25 GB/s for PCIe 4.0 x16), so a switch on the sim costs
# more than on a GPU: a benchmark on the sim shows the daemon's switch costs with a modest link,
# never page faults.
DEFAULT_BANDWIDTH = 2e9

# How many bytes of restored jobs' parked files the simulated GPU keeps, mapped, for the next parks to
# write into (``timesliced.backends.sim_buffers``): a park into them copies at the machine's warm copy
# rate instead of the rate the tmpfs allocates new pages at. 1 GiB: a switch of jobs up to that size
# is warm after its first round, while a small machine keeps most of its memory; the pool counts as
# room for parked state, so it never makes a park refused. ``--sim-pool`` sizes it, 0 turns it off.
DEFAULT_POOL = 1 << 30

# Bytes the simulated GPU copies at a time (its moves check their pace and whether they were abandoned
# between chunks). What one copy of this size reaches is the most any simulated move can follow: on a
# machine whose last-level cache the C library sizes large, copies this small take ordinary stores
# while one copy of hundreds of MiB streams past the cache (non-temporal stores, glibc's
# ``x86_non_temporal_threshold``) and runs faster (here 6.8 against 10.9 GB/s; a 480 MiB L3 puts the
# threshold between 128 and 192 MiB). ``timesliced bench copy`` shows both.
COPY_CHUNK = 32 << 20

# A swap's park copies a chunk in a helper thread, beside the restore's chunk, only from this size on:
# handing a chunk to another thread and back costs two wake-ups (100-150 us on a 2-core machine), more
# than copying 2 MiB a second time in the same thread. So a swap of chunks below it copies its two
# directions one after the other, and follows at most half the rate of one copy.
SWAP_THREAD_MIN = 2 << 20
