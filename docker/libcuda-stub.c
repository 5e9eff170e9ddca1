/* libcuda.so.1 for hosts without a CUDA driver (Neuron and CPU nodes), for NIXL's LIBFABRIC plugin.
 *
 * nixl-cu12 1.5.1's libplugin_LIBFABRIC.so links libcuda.so.1 and calls three of its functions
 * (objdump -T: cuCtxSetCurrent, cuDeviceGetPCIBusId, cuPointerGetAttributes), only for GPU memory, which
 * neuronfleet never registers (its KV caches are host memory: "DRAM"). Each answers an error, as a driver
 * without devices would (CUDA_ERROR_NO_DEVICE, 100).
 *
 *   gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 docker/libcuda-stub.c
 */

enum { CUDA_ERROR_NO_DEVICE = 100 };

int cuCtxSetCurrent(void *context) { (void)context; return CUDA_ERROR_NO_DEVICE; }

int cuDeviceGetPCIBusId(char *bus_id, int length, int device)
{
    (void)bus_id; (void)length; (void)device;
    return CUDA_ERROR_NO_DEVICE;
}

int cuPointerGetAttributes(unsigned int count, void *attributes, void **data, unsigned long long pointer)
{
    (void)count; (void)attributes; (void)data; (void)pointer;
    return CUDA_ERROR_NO_DEVICE;
}
