"""In-process offload: the workload parks and unparks its own device memory, by tag, when the daemon says so.

The executors (each a :class:`Parkable`):

- :mod:`.regions`: :class:`Offloader`, raw device regions (:class:`Region`) whose
  addresses survive a park;
- :mod:`.torch_state`: :class:`TorchOffload`, torch modules, optimizers and tensors;
- :mod:`.combined`: :class:`CombinedOffload` and :func:`execute`, one directive over
  several executors.

The device under :class:`Offloader`:

- :mod:`.device_memory`: the :class:`DeviceMemory` seam and its pure helpers;
- :mod:`.address_space`: the reservation and mapping rules both implementations keep;
- :mod:`.cuda_device_memory`: :class:`CudaDeviceMemory`, the CUDA driver API through
  cuda-python (imported only when one is built);
- :mod:`.host_device_memory`: :class:`HostDeviceMemory`, the CPU stand-in.

Nothing here imports torch or cuda-python until it is used.
"""

from .combined import CombinedOffload, execute
from .cuda_device_memory import CudaDeviceMemory
from .device_memory import DeviceMemory, HostBuffer
from .host_device_memory import HostDeviceMemory
from .parkable import MoveStats, Parkable
from .regions import Offloader, Region
from .torch_state import TorchOffload

__all__ = [
    "CombinedOffload",
    "CudaDeviceMemory",
    "DeviceMemory",
    "HostBuffer",
    "HostDeviceMemory",
    "MoveStats",
    "Offloader",
    "Parkable",
    "Region",
    "TorchOffload",
    "execute",
]
