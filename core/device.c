/* core/device.c — the device registry: which backend table serves each device (the CPU's always,
 * 'cuda' once the CUDA library or the simulation registers one), device checks for op arguments,
 * failures kept by asynchronous backends, and host<->device transfers of whole tensors. */
#include <stdio.h>
#include "internal.h"

const uly_backend *uly_backends[ULY_DEVICE_COUNT] = {[ULY_DEVICE_CPU] = &uly_backend_cpu};

const char *uly_device_name(int device) {
    return device == ULY_DEVICE_CPU ? "cpu" : device == ULY_DEVICE_CUDA ? "cuda" : "unknown-device";
}

int uly_device_register(int device, const void *backend) {
    if (device != ULY_DEVICE_CUDA)
        return uly_set_error("device register: only the 'cuda' device takes a backend (got device %d)", device);
    const uly_backend *be = backend;
    if (!be) { /* unregister */
        if (uly_backends[device] && uly_device_pool_in_use(device))
            return uly_set_error("device register: device 'cuda' still holds tensors; free them before removing its backend");
        if (uly_backends[device]) uly_device_empty_cache(device);
        uly_backends[device] = NULL;
        return 0;
    }
    if (be->abi != ULY_BACKEND_ABI || be->size != (int64_t)sizeof(uly_backend))
        return uly_set_error("device register: backend '%s' was built for backend ABI %d (%lld bytes) but this "
                             "libulysses has ABI %d (%lld bytes); rebuild both libraries together",
                             be->name ? be->name : "?", be->abi, (long long)be->size, ULY_BACKEND_ABI,
                             (long long)sizeof(uly_backend));
    if (uly_backends[device] == be) return 0;
    if (uly_backends[device] && uly_device_pool_in_use(device))
        return uly_set_error("device register: device 'cuda' (backend '%s') still holds tensors; free them before "
                             "switching to backend '%s'", uly_backends[device]->name, be->name);
    if (uly_backends[device]) uly_device_empty_cache(device);
    uly_backends[device] = be;
    uly_device_set_memory_limit(device, 0);
    return 0;
}

int uly_device_simulate(void) { return uly_device_register(ULY_DEVICE_CUDA, &uly_backend_sim); }

int uly_device_available(int device) {
    return device >= 0 && device < ULY_DEVICE_COUNT && uly_backends[device] != NULL;
}

const char *uly_device_backend(int device) {
    return uly_device_available(device) ? uly_backends[device]->name : NULL;
}

int uly_device_check(const char *op, int device) {
    if (device == ULY_DEVICE_CPU || !uly_backends[device]) return 0;
    const char *why = uly_backends[device]->take_error();
    if (!why) return 0;
    return uly_set_error("%s on %s: %s", op, uly_device_name(device), why);
}

int uly_device_synchronize(int device) {
    if (!uly_device_available(device)) return uly_set_error("synchronize: device '%s' has no backend", uly_device_name(device));
    int failed = uly_backends[device]->synchronize() != 0;
    if (uly_device_check("synchronize", device)) return -1;   /* the kept failure names what failed */
    return failed ? uly_set_error("synchronize on %s failed", uly_device_name(device)) : 0;
}

int uly_check_same_device(const char *op, const char *an, const uly_tensor *a, const char *bn, const uly_tensor *b) {
    if (!a || !b || uly_dev(a) == uly_dev(b)) return 0;
    return uly_set_error("%s: '%s' is on %s but '%s' is on %s; move one with :to('%s') (or :to('%s'))", op, bn,
                         uly_device_name(uly_dev(b)), an, uly_device_name(uly_dev(a)), uly_device_name(uly_dev(a)),
                         uly_device_name(uly_dev(b)));
}

uly_view uly_view_of(const uly_tensor *t) {
    uly_view v;
    v.p = uly_ptr(t);
    v.dtype = t->dtype;
    v.ndim = t->ndim;
    for (int d = 0; d < t->ndim; d++) { v.shape[d] = t->shape[d]; v.stride[d] = t->stride[d]; }
    return v;
}
