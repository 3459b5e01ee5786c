"""CudaMapping: a CUDA pool arena imported into this process through the driver API by ctypes
(libcuda.so.1, loaded on first use; nothing else of CUDA is needed), as
client/internal/cuda_mapping.cc does in C++.

ARENA_KIND_CUDA_VMM: cuMemImportFromShareableHandle(fd) + cuMemAddressReserve + cuMemMap +
cuMemSetAccess (read-write on the daemon's device). ARENA_KIND_CUDA_IPC: cuIpcOpenMemHandle.
device_ptr is a device address, valid in kernels and cuMemcpy* on that device only.

UNTESTED on the machines this was written on (no GPU): bench/gpu_check.sh runs
tests/client/python/test_cuda_mapping.py where one is present.

Thread-safety: import and close from one thread; copies may run from any thread that has the
primary context current (each copy makes it current). Ownership: close() unmaps and releases.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

import grpc

from kvpool.errors import KvPoolError

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_IPC_HANDLE_SIZE = 64

CUresult = ctypes.c_int
CUdevice = ctypes.c_int
CUcontext = ctypes.c_void_p
CUdeviceptr = ctypes.c_ulonglong
CUmemGenericAllocationHandle = ctypes.c_ulonglong


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * CU_IPC_HANDLE_SIZE)]


# Exported symbol -> (argument types). Versioned names as <cuda.h> maps calls to them today.
_SIGNATURES = {
    "cuGetErrorName": [CUresult, ctypes.POINTER(ctypes.c_char_p)],
    "cuGetErrorString": [CUresult, ctypes.POINTER(ctypes.c_char_p)],
    "cuInit": [ctypes.c_uint],
    "cuDeviceGet": [ctypes.POINTER(CUdevice), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(CUcontext), CUdevice],
    "cuDevicePrimaryCtxRelease_v2": [CUdevice],
    "cuCtxSetCurrent": [CUcontext],
    "cuMemImportFromShareableHandle": [
        ctypes.POINTER(CUmemGenericAllocationHandle), ctypes.c_void_p, ctypes.c_int,
    ],
    "cuMemAddressReserve": [
        ctypes.POINTER(CUdeviceptr), ctypes.c_size_t, ctypes.c_size_t, CUdeviceptr,
        ctypes.c_ulonglong,
    ],
    "cuMemAddressFree": [CUdeviceptr, ctypes.c_size_t],
    "cuMemMap": [
        CUdeviceptr, ctypes.c_size_t, ctypes.c_size_t, CUmemGenericAllocationHandle,
        ctypes.c_ulonglong,
    ],
    "cuMemUnmap": [CUdeviceptr, ctypes.c_size_t],
    "cuMemSetAccess": [CUdeviceptr, ctypes.c_size_t, ctypes.POINTER(CUmemAccessDesc), ctypes.c_size_t],
    "cuMemRelease": [CUmemGenericAllocationHandle],
    "cuIpcOpenMemHandle_v2": [ctypes.POINTER(CUdeviceptr), CUipcMemHandle, ctypes.c_uint],
    "cuIpcCloseMemHandle": [CUdeviceptr],
    "cuMemcpyHtoD_v2": [CUdeviceptr, ctypes.c_void_p, ctypes.c_size_t],
    "cuMemcpyDtoH_v2": [ctypes.c_void_p, CUdeviceptr, ctypes.c_size_t],
}

_lock = threading.Lock()
_driver: Optional[object] = None
_driver_error: Optional[KvPoolError] = None


class _Driver:
    def __init__(self, library: ctypes.CDLL):
        for name, argtypes in _SIGNATURES.items():
            try:
                fn = getattr(library, name)
            except AttributeError:
                raise KvPoolError(
                    grpc.StatusCode.INTERNAL, f"the CUDA driver lacks {name} (driver too old?)"
                ) from None
            fn.argtypes = argtypes
            fn.restype = CUresult
            setattr(self, name, fn)

    def check(self, result: int, what: str) -> None:
        if result == CUDA_SUCCESS:
            return
        name = ctypes.c_char_p()
        text = ctypes.c_char_p()
        self.cuGetErrorName(result, ctypes.byref(name))
        self.cuGetErrorString(result, ctypes.byref(text))
        message = (
            f"{what}: {(text.value or b'unknown error').decode()} "
            f"({(name.value or b'?').decode()})"
        )
        code = (
            grpc.StatusCode.RESOURCE_EXHAUSTED
            if result == CUDA_ERROR_OUT_OF_MEMORY
            else grpc.StatusCode.INTERNAL
        )
        raise KvPoolError(code, message)


def driver() -> _Driver:
    """The process-wide driver table, loaded on first use. Raises UNAVAILABLE without a driver."""
    global _driver, _driver_error
    with _lock:
        if _driver is None and _driver_error is None:
            try:
                _driver = _Driver(ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_LOCAL))
            except OSError as e:
                _driver_error = KvPoolError(
                    grpc.StatusCode.UNAVAILABLE, f"no CUDA driver: dlopen(libcuda.so.1): {e}"
                )
            except KvPoolError as e:
                _driver_error = e
        if _driver_error is not None:
            raise _driver_error
        return _driver


class CudaMapping:
    """One imported arena. See the module docstring."""

    def __init__(self, d: _Driver, ordinal: int):
        self._d = d
        self.device_ordinal = ordinal
        self.device_ptr = 0
        self.nbytes = 0
        self._device = CUdevice(0)
        self._context = CUcontext()
        self._context_retained = False
        self._handle = 0
        self._mapped = False
        self._ipc = False

    def _enter(self) -> None:
        d = self._d
        d.check(d.cuInit(0), "cuInit")
        d.check(d.cuDeviceGet(ctypes.byref(self._device), self.device_ordinal),
                f"cuDeviceGet({self.device_ordinal})")
        d.check(d.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), self._device),
                "cuDevicePrimaryCtxRetain")
        self._context_retained = True
        self.make_current()

    def make_current(self) -> None:
        self._d.check(self._d.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    @staticmethod
    def import_vmm(fd: int, mapped_bytes: int, ordinal: int) -> "CudaMapping":
        m = CudaMapping(driver(), ordinal)
        try:
            m._enter()
            d = m._d
            handle = CUmemGenericAllocationHandle(0)
            d.check(d.cuMemImportFromShareableHandle(
                ctypes.byref(handle), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                "cuMemImportFromShareableHandle")
            m._handle = handle.value
            ptr = CUdeviceptr(0)
            d.check(d.cuMemAddressReserve(ctypes.byref(ptr), mapped_bytes, 0, 0, 0),
                    f"cuMemAddressReserve({mapped_bytes} bytes)")
            m.device_ptr, m.nbytes = ptr.value, mapped_bytes
            d.check(d.cuMemMap(ptr, mapped_bytes, 0, handle, 0), "cuMemMap")
            m._mapped = True
            access = CUmemAccessDesc(
                CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal), CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            )
            d.check(d.cuMemSetAccess(ptr, mapped_bytes, ctypes.byref(access), 1), "cuMemSetAccess")
            return m
        except BaseException:
            m.close()
            raise

    @staticmethod
    def open_ipc(handle: bytes, ordinal: int) -> "CudaMapping":
        if len(handle) != CU_IPC_HANDLE_SIZE:
            raise KvPoolError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cuda_ipc_handle holds {len(handle)} bytes, a CUipcMemHandle is {CU_IPC_HANDLE_SIZE}",
            )
        m = CudaMapping(driver(), ordinal)
        try:
            m._enter()
            ipc = CUipcMemHandle()
            ctypes.memmove(ipc.reserved, handle, CU_IPC_HANDLE_SIZE)
            ptr = CUdeviceptr(0)
            m._d.check(m._d.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), ipc,
                                                  CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                       "cuIpcOpenMemHandle")
            m.device_ptr, m._ipc = ptr.value, True
            return m
        except BaseException:
            m.close()
            raise

    def copy_from_host(self, device_ptr: int, data: memoryview) -> None:
        self.make_current()
        buf = (ctypes.c_char * data.nbytes).from_buffer_copy(data)
        self._d.check(self._d.cuMemcpyHtoD_v2(device_ptr, buf, data.nbytes), "cuMemcpyHtoD")

    def copy_to_host(self, device_ptr: int, nbytes: int) -> bytes:
        self.make_current()
        buf = (ctypes.c_char * nbytes)()
        self._d.check(self._d.cuMemcpyDtoH_v2(buf, device_ptr, nbytes), "cuMemcpyDtoH")
        return bytes(buf)

    def close(self) -> None:
        """Unmaps and releases whatever the import achieved (errors are ignored: best effort)."""
        d = self._d
        if self._context_retained:
            d.cuCtxSetCurrent(self._context)
        if self._ipc and self.device_ptr:
            d.cuIpcCloseMemHandle(self.device_ptr)
        else:
            if self._mapped:
                d.cuMemUnmap(self.device_ptr, self.nbytes)
            if self.device_ptr:
                d.cuMemAddressFree(self.device_ptr, self.nbytes)
            if self._handle:
                d.cuMemRelease(self._handle)
        if self._context_retained:
            d.cuDevicePrimaryCtxRelease_v2(self._device)
        self.device_ptr = 0
        self._mapped = False
        self._handle = 0
        self._context_retained = False
