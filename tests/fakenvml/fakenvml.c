/*
 * A fake libnvidia-ml.so.1: the NVML entry points a telemetry agent uses, answering from a
 * scenario file instead of a GPU. See README.md.
 *
 * Every exported function is wrapped in #ifndef OMIT_<name> so that a build can leave it out,
 * as an older driver would. Because of that any helper below may end up unused, hence HELPER.
 *
 * Locking: one mutex guards all state. The enter_* helpers return NVML_SUCCESS with the mutex
 * held (the caller finishes with leave()) or an error with the mutex already released.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nvml_abi.h"
#include "scenario.h"

#define NVML_API __attribute__((visibility("default")))
#define HELPER static __attribute__((unused))

struct nvmlDevice_st {
    unsigned int index;
};

struct nvmlEventSet_st {
    struct nvmlEventSet_st *next;
    unsigned long long registered[FAKE_MAX_DEVICES]; /* event types per device */
    size_t next_xid[FAKE_MAX_DEVICES];               /* first XID not yet delivered */
};

struct nvmlGpmSample_st {
    struct nvmlGpmSample_st *next;
    bool taken;
    unsigned int device;
    unsigned int gpu_instance_id; /* NVML_VALUE_NOT_AVAILABLE_UINT: the whole GPU */
    double t;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int g_refcount;
static struct scenario *g_scenario;
static double g_epoch; /* real seconds at scenario time 0 */
static double g_time_scale;
/* Handles stay valid addresses for the life of the process, even across a shutdown. */
static struct nvmlDevice_st g_handles[FAKE_MAX_DEVICES];
static struct nvmlDevice_st g_mig_handles[FAKE_MAX_DEVICES][FAKE_MAX_MIG_DEVICES];
static struct nvmlEventSet_st *g_event_sets;
static struct nvmlGpmSample_st *g_samples;

struct call {
    unsigned int index;             /* the device, or the parent of a MIG device */
    const struct device *device;
    const struct mig_device *mig;   /* NULL: the call names the device itself */
    unsigned int mig_index;
    double t;
};

/* What a device function does with a MIG device handle. */
enum mig_rule {
    MIG_NOT_SUPPORTED, /* parents only: a MIG handle gets NVML_ERROR_NOT_SUPPORTED */
    MIG_INVALID,       /* parents only: a MIG handle gets NVML_ERROR_INVALID_ARGUMENT */
    MIG_ALLOWED,       /* either kind of handle */
    MIG_ONLY,          /* MIG handles only: a parent gets NVML_ERROR_INVALID_ARGUMENT */
};

HELPER double real_seconds(void)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

HELPER unsigned long long real_microseconds(void)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return (unsigned long long)now.tv_sec * 1000000ULL +
           (unsigned long long)now.tv_nsec / 1000ULL;
}

HELPER double scenario_now(void)
{
    double t = (real_seconds() - g_epoch) * g_time_scale;
    return t > 0 ? t : 0;
}

HELPER nvmlReturn_t leave(nvmlReturn_t result)
{
    pthread_mutex_unlock(&g_lock);
    return result;
}

/* With the mutex held: a scenario's `hang` window blocks the call (the mutex released while
 * it sleeps, so that every other caller blocks too, each on its own) until the window ends. */
HELPER void hang_while_scripted(void)
{
    while (g_refcount > 0 && scenario_now() >= g_scenario->hang_start &&
           scenario_now() < g_scenario->hang_end) {
        pthread_mutex_unlock(&g_lock);
        struct timespec pause = {.tv_sec = 0, .tv_nsec = 50 * 1000 * 1000};
        nanosleep(&pause, NULL);
        pthread_mutex_lock(&g_lock);
    }
}

HELPER nvmlReturn_t enter(void)
{
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0) {
        return leave(NVML_ERROR_UNINITIALIZED);
    }
    hang_while_scripted();
    if (g_refcount == 0) {
        return leave(NVML_ERROR_UNINITIALIZED);
    }
    return NVML_SUCCESS;
}

/* With the mutex held: faults in force for this device (mig FAKE_NO_MIG) or this MIG device of
 * it, and this function. */
HELPER nvmlReturn_t check_device(unsigned int index, unsigned int mig, enum fn fn,
                                 struct call *call)
{
    call->index = index;
    call->device = &g_scenario->devices[index];
    call->mig = mig == FAKE_NO_MIG ? NULL : &call->device->migs[mig];
    call->mig_index = mig;
    call->t = scenario_now();
    nvmlReturn_t fault = call->mig == NULL ? device_fault(call->device, fn, call->t)
                                           : mig_fault(call->device, call->mig, fn, call->t);
    return fault == NVML_SUCCESS ? NVML_SUCCESS : leave(fault);
}

HELPER bool handle_index(nvmlDevice_t device, unsigned int *index)
{
    uintptr_t address = (uintptr_t)device;
    uintptr_t base = (uintptr_t)g_handles;
    if (address < base || address >= base + sizeof g_handles ||
        (address - base) % sizeof g_handles[0] != 0) {
        return false;
    }
    *index = (unsigned int)((address - base) / sizeof g_handles[0]);
    return *index < g_scenario->device_count;
}

/* A MIG device handle of the current scenario: its parent's index and its MIG index. */
HELPER bool mig_handle_index(nvmlDevice_t device, unsigned int *index, unsigned int *mig)
{
    uintptr_t address = (uintptr_t)device;
    uintptr_t base = (uintptr_t)g_mig_handles;
    if (address < base || address >= base + sizeof g_mig_handles ||
        (address - base) % sizeof g_mig_handles[0][0] != 0) {
        return false;
    }
    unsigned int slot = (unsigned int)((address - base) / sizeof g_mig_handles[0][0]);
    *index = slot / FAKE_MAX_MIG_DEVICES;
    *mig = slot % FAKE_MAX_MIG_DEVICES;
    return *index < g_scenario->device_count && *mig < g_scenario->devices[*index].n_migs;
}

/* Faults come first: a lost parent makes its MIG handles lost whatever the function. */
HELPER nvmlReturn_t enter_handle(nvmlDevice_t device, enum fn fn, enum mig_rule rule,
                                 struct call *call)
{
    unsigned int index, mig = FAKE_NO_MIG;
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (!handle_index(device, &index) && !mig_handle_index(device, &index, &mig)) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    result = check_device(index, mig, fn, call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (call->mig != NULL && rule == MIG_NOT_SUPPORTED) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    if ((call->mig != NULL && rule == MIG_INVALID) || (call->mig == NULL && rule == MIG_ONLY)) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    return NVML_SUCCESS;
}

HELPER nvmlReturn_t enter_device(nvmlDevice_t device, enum fn fn, struct call *call)
{
    return enter_handle(device, fn, MIG_NOT_SUPPORTED, call);
}


HELPER nvmlReturn_t copy_string(const char *value, char *buffer, unsigned int length)
{
    if (buffer == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    size_t size = strlen(value) + 1;
    if (size > length) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(buffer, value, size);
    return NVML_SUCCESS;
}

HELPER unsigned int value_u32(const struct call *call, enum key key)
{
    return (unsigned int)device_value(call->device, key, call->t);
}

HELPER unsigned long long value_u64(const struct call *call, enum key key)
{
    return (unsigned long long)device_value(call->device, key, call->t);
}

/* Whether the device of the call (the parent, for a MIG device) is in MIG mode. */
HELPER bool in_mig_mode(const struct call *call)
{
    return value_u32(call, K_MIG_MODE) != 0;
}

/* Clock event reasons whose time each perf policy counts; 0: the counter stays at 0. */
HELPER uint64_t policy_reasons(nvmlPerfPolicyType_t policy)
{
    switch (policy) {
    case NVML_PERF_POLICY_POWER:
        return nvmlClocksEventReasonSwPowerCap | nvmlClocksEventReasonHwPowerBrakeSlowdown;
    case NVML_PERF_POLICY_THERMAL:
        return nvmlClocksEventReasonSwThermalSlowdown | nvmlClocksEventReasonHwThermalSlowdown |
               nvmlClocksEventReasonHwSlowdown;
    case NVML_PERF_POLICY_SYNC_BOOST:
        return nvmlClocksEventReasonSyncBoost;
    case NVML_PERF_POLICY_BOARD_LIMIT:
        return nvmlClocksThrottleReasonBoardLimit;
    case NVML_PERF_POLICY_LOW_UTILIZATION:
        return nvmlClocksEventReasonGpuIdle;
    case NVML_PERF_POLICY_RELIABILITY:
        return nvmlClocksThrottleReasonReliability;
    default:
        return 0;
    }
}

HELPER unsigned long long violation_ns(const struct call *call, uint64_t reasons)
{
    if (reasons == 0) {
        return 0;
    }
    return (unsigned long long)(device_reason_seconds(call->device, reasons, call->t) * 1e9);
}

HELPER void fill_field(const struct call *call, nvmlFieldValue_t *field)
{
    field->timestamp = (long long)real_microseconds();
    field->latencyUsec = 0;
    field->value.ullVal = 0;
    field->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
    field->nvmlReturn = device_field_fault(call->device, field->fieldId, call->t);
    if (field->nvmlReturn != NVML_SUCCESS) {
        return;
    }
    switch (field->fieldId) {
    case NVML_FI_DEV_PERF_POLICY_POWER:
    case NVML_FI_DEV_PERF_POLICY_THERMAL:
    case NVML_FI_DEV_PERF_POLICY_SYNC_BOOST:
    case NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT:
    case NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION:
    case NVML_FI_DEV_PERF_POLICY_RELIABILITY:
    case NVML_FI_DEV_PERF_POLICY_TOTAL_APP_CLOCKS:
    case NVML_FI_DEV_PERF_POLICY_TOTAL_BASE_CLOCKS: {
        /* Field ids 74..79 follow the policy enum 0..5; 80, 81 are policies 10, 11. */
        unsigned int offset = field->fieldId - NVML_FI_DEV_PERF_POLICY_POWER;
        nvmlPerfPolicyType_t policy = (nvmlPerfPolicyType_t)(offset < 6 ? offset : offset + 4);
        field->value.ullVal = violation_ns(call, policy_reasons(policy));
        return;
    }
    case NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN:
        field->value.ullVal = violation_ns(call, nvmlClocksEventReasonSwThermalSlowdown);
        return;
    case NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN:
        field->value.ullVal = violation_ns(call, nvmlClocksEventReasonHwThermalSlowdown);
        return;
    case NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN:
        field->value.ullVal = violation_ns(call, nvmlClocksEventReasonHwPowerBrakeSlowdown);
        return;
    case NVML_FI_DEV_ECC_SBE_VOL_TOTAL:
    case NVML_FI_DEV_ECC_SBE_AGG_TOTAL:
        field->value.ullVal = value_u64(call, K_ECC_CORRECTED);
        return;
    case NVML_FI_DEV_ECC_DBE_VOL_TOTAL:
    case NVML_FI_DEV_ECC_DBE_AGG_TOTAL:
        field->value.ullVal = value_u64(call, K_ECC_UNCORRECTED);
        return;
    case NVML_FI_DEV_MEMORY_TEMP:
        field->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        field->value.uiVal = value_u32(call, K_MEM_TEMP_C);
        return;
    case NVML_FI_DEV_POWER_AVERAGE:
        field->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        field->value.uiVal = value_u32(call, K_POWER_AVERAGE_MW);
        return;
    case NVML_FI_DEV_POWER_INSTANT:
        field->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        field->value.uiVal = value_u32(call, K_POWER_MW);
        return;
    case NVML_FI_DEV_ENERGY:
        field->value.ullVal = (unsigned long long)device_energy_mj(call->device, call->t);
        return;
    default:
        field->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        return;
    }
}

HELPER struct nvmlEventSet_st *find_event_set(nvmlEventSet_t set)
{
    for (struct nvmlEventSet_st *live = g_event_sets; live != NULL; live = live->next) {
        if (live == set) {
            return live;
        }
    }
    return NULL;
}

HELPER struct nvmlGpmSample_st *find_sample(nvmlGpmSample_t sample)
{
    for (struct nvmlGpmSample_st *live = g_samples; live != NULL; live = live->next) {
        if (live == sample) {
            return live;
        }
    }
    return NULL;
}

/* The device whose next undelivered, registered XID is the earliest one due at t, or -1;
 * *due gets the earliest pending XID time of any registered device (INFINITY if none). */
HELPER int next_xid_device(const struct nvmlEventSet_st *set, double t, double *due)
{
    int found = -1;
    *due = INFINITY;
    for (unsigned int d = 0; d < g_scenario->device_count; d++) {
        const struct device *device = &g_scenario->devices[d];
        if ((set->registered[d] & nvmlEventTypeXidCriticalError) == 0 ||
            set->next_xid[d] >= device->n_xids) {
            continue;
        }
        double when = device->xids[set->next_xid[d]].t;
        if (when < *due) {
            *due = when;
            found = when <= t ? (int)d : -1;
        }
    }
    return found;
}

HELPER void free_all_state(void)
{
    while (g_event_sets != NULL) {
        struct nvmlEventSet_st *next = g_event_sets->next;
        free(g_event_sets);
        g_event_sets = next;
    }
    while (g_samples != NULL) {
        struct nvmlGpmSample_st *next = g_samples->next;
        free(g_samples);
        g_samples = next;
    }
    scenario_free(g_scenario);
    g_scenario = NULL;
}

HELPER bool env_seconds(const char *name, double *out)
{
    const char *text = getenv(name);
    if (text == NULL || *text == '\0') {
        return true;
    }
    char *end;
    double value = strtod(text, &end);
    if (end == text || *end != '\0' || !isfinite(value)) {
        fprintf(stderr, "fakenvml: %s='%s' is not a number\n", name, text);
        return false;
    }
    *out = value;
    return true;
}

HELPER nvmlReturn_t init(void)
{
    pthread_mutex_lock(&g_lock);
    if (g_refcount > 0) {
        g_refcount++;
        return leave(NVML_SUCCESS);
    }
    const char *path = getenv("FAKENVML_SCENARIO");
    if (path == NULL || *path == '\0') {
        fprintf(stderr, "fakenvml: FAKENVML_SCENARIO is not set; it names the scenario file\n");
        return leave(NVML_ERROR_DRIVER_NOT_LOADED);
    }
    struct scenario *scenario = scenario_load(path);
    if (scenario == NULL) {
        return leave(NVML_ERROR_UNKNOWN);
    }
    double epoch = real_seconds();
    double time_scale = scenario->time_scale;
    if (!env_seconds("FAKENVML_EPOCH", &epoch) ||
        !env_seconds("FAKENVML_TIME_SCALE", &time_scale)) {
        scenario_free(scenario);
        return leave(NVML_ERROR_UNKNOWN);
    }
    if (time_scale <= 0) {
        fprintf(stderr, "fakenvml: FAKENVML_TIME_SCALE must be > 0\n");
        scenario_free(scenario);
        return leave(NVML_ERROR_UNKNOWN);
    }
    for (unsigned int i = 0; i < FAKE_MAX_DEVICES; i++) {
        g_handles[i].index = i;
    }
    g_scenario = scenario;
    g_epoch = epoch;
    g_time_scale = time_scale;
    g_refcount = 1;
    return leave(NVML_SUCCESS);
}

/* ---- Initialisation and system queries ---- */

#ifndef OMIT_nvmlInit_v2
NVML_API nvmlReturn_t nvmlInit_v2(void) { return init(); }
#endif

#ifndef OMIT_nvmlInitWithFlags
NVML_API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags; /* NO_GPUS / NO_ATTACH change nothing for a fake */
    return init();
}
#endif

#ifndef OMIT_nvmlShutdown
NVML_API nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (--g_refcount == 0) {
        free_all_state();
    }
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlErrorString
NVML_API const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED:
        return "The requested vgpu operation is not available on target device, because ECC is "
               "enabled";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Ran out of critical resources, other than memory";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "The requested functionality has been deprecated";
    case NVML_ERROR_NOT_READY: return "The system is not ready for the request";
    case NVML_ERROR_GPU_NOT_FOUND: return "No GPUs were found";
    case NVML_ERROR_INVALID_STATE: return "Resource not in correct state to perform requested operation";
    case NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: return "Reset type not supported";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    }
    return "Unknown Error";
}
#endif

#ifndef OMIT_nvmlSystemGetDriverVersion
NVML_API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    const char *current = scenario_now() >= g_scenario->upgrade_t ? g_scenario->upgraded_version
                                                                   : g_scenario->driver_version;
    return leave(copy_string(current, version, length));
}
#endif

#ifndef OMIT_nvmlSystemGetNVMLVersion
NVML_API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    return leave(copy_string(g_scenario->nvml_version, version, length));
}
#endif

HELPER nvmlReturn_t cuda_driver_version(int *version)
{
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (version == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    *version = g_scenario->cuda_driver_version;
    return leave(NVML_SUCCESS);
}

#ifndef OMIT_nvmlSystemGetCudaDriverVersion
NVML_API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version)
{
    return cuda_driver_version(version);
}
#endif

#ifndef OMIT_nvmlSystemGetCudaDriverVersion_v2
NVML_API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version)
{
    return cuda_driver_version(version);
}
#endif

/* ---- Device discovery and identity ---- */

#ifndef OMIT_nvmlDeviceGetCount_v2
NVML_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (count == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    *count = g_scenario->device_count;
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetHandleByIndex_v2
NVML_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    struct call call;
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (index >= g_scenario->device_count || device == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    result = check_device(index, FAKE_NO_MIG, FN_nvmlDeviceGetHandleByIndex_v2, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    *device = &g_handles[index];
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetHandleByUUID
NVML_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    struct call call;
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (uuid == NULL || device == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    for (unsigned int index = 0; index < g_scenario->device_count; index++) {
        const struct device *d = &g_scenario->devices[index];
        unsigned int mig = FAKE_NO_MIG;
        if (strcmp(d->uuid, uuid) != 0) {
            mig = 0;
            while (mig < d->n_migs && strcmp(d->migs[mig].uuid, uuid) != 0) {
                mig++;
            }
            if (mig == d->n_migs) {
                continue;
            }
        }
        result = check_device(index, mig, FN_nvmlDeviceGetHandleByUUID, &call);
        if (result != NVML_SUCCESS) {
            return result;
        }
        *device = mig == FAKE_NO_MIG ? &g_handles[index] : &g_mig_handles[index][mig];
        return leave(NVML_SUCCESS);
    }
    return leave(NVML_ERROR_NOT_FOUND);
}
#endif

#ifndef OMIT_nvmlDeviceGetIndex
NVML_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    struct call call;
    nvmlReturn_t result = enter_handle(device, FN_nvmlDeviceGetIndex, MIG_INVALID, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (index == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    *index = call.index;
    return leave(NVML_SUCCESS);
}
#endif

#define DEVICE_STRING_GETTER(name, member)                                               \
    NVML_API nvmlReturn_t name(nvmlDevice_t device, char *buffer, unsigned int length)   \
    {                                                                                    \
        struct call call;                                                                \
        nvmlReturn_t result = enter_device(device, FN_##name, &call);                    \
        if (result != NVML_SUCCESS) {                                                    \
            return result;                                                               \
        }                                                                                \
        return leave(copy_string(call.device->member, buffer, length));                  \
    }

#ifndef OMIT_nvmlDeviceGetUUID
NVML_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    struct call call;
    nvmlReturn_t result = enter_handle(device, FN_nvmlDeviceGetUUID, MIG_ALLOWED, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    return leave(copy_string(call.mig != NULL ? call.mig->uuid : call.device->uuid, uuid,
                             length));
}
#endif

#ifndef OMIT_nvmlDeviceGetName
NVML_API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    struct call call;
    char mig_name[NVML_DEVICE_NAME_V2_BUFFER_SIZE + 8];
    nvmlReturn_t result = enter_handle(device, FN_nvmlDeviceGetName, MIG_ALLOWED, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (call.mig == NULL) {
        return leave(copy_string(call.device->name, name, length));
    }
    snprintf(mig_name, sizeof mig_name, "%s MIG", call.device->name);
    return leave(copy_string(mig_name, name, length));
}
#endif
#ifndef OMIT_nvmlDeviceGetSerial
DEVICE_STRING_GETTER(nvmlDeviceGetSerial, serial)
#endif
#ifndef OMIT_nvmlDeviceGetVbiosVersion
DEVICE_STRING_GETTER(nvmlDeviceGetVbiosVersion, vbios_version)
#endif
#ifndef OMIT_nvmlDeviceGetBoardPartNumber
DEVICE_STRING_GETTER(nvmlDeviceGetBoardPartNumber, board_part_number)
#endif

#ifndef OMIT_nvmlDeviceGetPciInfo_v3
NVML_API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlDeviceGetPciInfo_v3, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (pci == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    const struct device *d = call.device;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X",
             d->pci_domain & 0xFFFFU, d->pci_bus, d->pci_device, d->pci_function);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", d->pci_domain, d->pci_bus,
             d->pci_device, d->pci_function);
    pci->domain = d->pci_domain;
    pci->bus = d->pci_bus;
    pci->device = d->pci_device;
    pci->pciDeviceId = value_u32(&call, K_PCI_DEVICE_ID);
    pci->pciSubSystemId = value_u32(&call, K_PCI_SUBSYSTEM_ID);
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetCudaComputeCapability
NVML_API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major,
                                                         int *minor)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlDeviceGetCudaComputeCapability, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (major == NULL || minor == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    *major = (int)value_u32(&call, K_COMPUTE_CAPABILITY_MAJOR);
    *minor = (int)value_u32(&call, K_COMPUTE_CAPABILITY_MINOR);
    return leave(NVML_SUCCESS);
}
#endif

/* ---- Plain numeric getters ---- */

#define HANDLE_GETTER(name, rule, type, expression)                                       \
    NVML_API nvmlReturn_t name(nvmlDevice_t device, type *out)                           \
    {                                                                                    \
        struct call call;                                                                \
        nvmlReturn_t result = enter_handle(device, FN_##name, rule, &call);              \
        if (result != NVML_SUCCESS) {                                                    \
            return result;                                                               \
        }                                                                                \
        if (out == NULL) {                                                               \
            return leave(NVML_ERROR_INVALID_ARGUMENT);                                   \
        }                                                                                \
        *out = (type)(expression);                                                       \
        return leave(NVML_SUCCESS);                                                      \
    }
#define DEVICE_GETTER(name, type, expression) \
    HANDLE_GETTER(name, MIG_NOT_SUPPORTED, type, expression)

#ifndef OMIT_nvmlDeviceGetArchitecture
DEVICE_GETTER(nvmlDeviceGetArchitecture, nvmlDeviceArchitecture_t,
              value_u32(&call, K_ARCHITECTURE))
#endif
#ifndef OMIT_nvmlDeviceGetPowerUsage
DEVICE_GETTER(nvmlDeviceGetPowerUsage, unsigned int, value_u32(&call, K_POWER_AVERAGE_MW))
#endif
#ifndef OMIT_nvmlDeviceGetEnforcedPowerLimit
DEVICE_GETTER(nvmlDeviceGetEnforcedPowerLimit, unsigned int, value_u32(&call, K_POWER_LIMIT_MW))
#endif
#ifndef OMIT_nvmlDeviceGetPowerManagementLimit
DEVICE_GETTER(nvmlDeviceGetPowerManagementLimit, unsigned int,
              value_u32(&call, K_POWER_LIMIT_MW))
#endif
#ifndef OMIT_nvmlDeviceGetTotalEnergyConsumption
DEVICE_GETTER(nvmlDeviceGetTotalEnergyConsumption, unsigned long long,
              device_energy_mj(call.device, call.t))
#endif
#ifndef OMIT_nvmlDeviceGetCurrPcieLinkGeneration
DEVICE_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, unsigned int, value_u32(&call, K_PCIE_GEN))
#endif
#ifndef OMIT_nvmlDeviceGetMaxPcieLinkGeneration
DEVICE_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, unsigned int,
              value_u32(&call, K_MAX_PCIE_GEN))
#endif
#ifndef OMIT_nvmlDeviceGetCurrPcieLinkWidth
DEVICE_GETTER(nvmlDeviceGetCurrPcieLinkWidth, unsigned int, value_u32(&call, K_PCIE_WIDTH))
#endif
#ifndef OMIT_nvmlDeviceGetMaxPcieLinkWidth
DEVICE_GETTER(nvmlDeviceGetMaxPcieLinkWidth, unsigned int, value_u32(&call, K_MAX_PCIE_WIDTH))
#endif
#ifndef OMIT_nvmlDeviceGetFanSpeed
DEVICE_GETTER(nvmlDeviceGetFanSpeed, unsigned int, value_u32(&call, K_FAN_PCT))
#endif
#ifndef OMIT_nvmlDeviceGetPerformanceState
DEVICE_GETTER(nvmlDeviceGetPerformanceState, nvmlPstates_t, value_u32(&call, K_PSTATE))
#endif
#ifndef OMIT_nvmlDeviceGetCurrentClocksEventReasons
DEVICE_GETTER(nvmlDeviceGetCurrentClocksEventReasons, unsigned long long,
              value_u64(&call, K_REASONS))
#endif
#ifndef OMIT_nvmlDeviceGetCurrentClocksThrottleReasons
DEVICE_GETTER(nvmlDeviceGetCurrentClocksThrottleReasons, unsigned long long,
              value_u64(&call, K_REASONS))
#endif
#ifndef OMIT_nvmlDeviceGetSupportedClocksEventReasons
DEVICE_GETTER(nvmlDeviceGetSupportedClocksEventReasons, unsigned long long,
              value_u64(&call, K_SUPPORTED_REASONS))
#endif
#ifndef OMIT_nvmlDeviceGetSupportedClocksThrottleReasons
DEVICE_GETTER(nvmlDeviceGetSupportedClocksThrottleReasons, unsigned long long,
              value_u64(&call, K_SUPPORTED_REASONS))
#endif
#ifndef OMIT_nvmlDeviceGetSupportedEventTypes
DEVICE_GETTER(nvmlDeviceGetSupportedEventTypes, unsigned long long,
              value_u64(&call, K_SUPPORTED_EVENT_TYPES))
#endif

/* ---- Getters with a selector argument ---- */

HELPER nvmlReturn_t clock_key(nvmlClockType_t type, bool max, enum key *key)
{
    switch (type) {
    case NVML_CLOCK_GRAPHICS:
        *key = max ? K_MAX_GRAPHICS_CLOCK_MHZ : K_GRAPHICS_CLOCK_MHZ;
        return NVML_SUCCESS;
    case NVML_CLOCK_SM:
        *key = max ? K_MAX_SM_CLOCK_MHZ : K_SM_CLOCK_MHZ;
        return NVML_SUCCESS;
    case NVML_CLOCK_MEM:
        *key = max ? K_MAX_MEM_CLOCK_MHZ : K_MEM_CLOCK_MHZ;
        return NVML_SUCCESS;
    case NVML_CLOCK_VIDEO:
        *key = max ? K_MAX_VIDEO_CLOCK_MHZ : K_VIDEO_CLOCK_MHZ;
        return NVML_SUCCESS;
    default:
        return NVML_ERROR_INVALID_ARGUMENT;
    }
}

HELPER nvmlReturn_t clock_info(nvmlDevice_t device, nvmlClockType_t type, unsigned int *clock,
                               enum fn fn, bool max)
{
    struct call call;
    enum key key;
    nvmlReturn_t result = enter_device(device, fn, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (clock == NULL || clock_key(type, max, &key) != NVML_SUCCESS) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    *clock = value_u32(&call, key);
    return leave(NVML_SUCCESS);
}

#ifndef OMIT_nvmlDeviceGetClockInfo
NVML_API nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, nvmlClockType_t type,
                                             unsigned int *clock)
{
    return clock_info(device, type, clock, FN_nvmlDeviceGetClockInfo, false);
}
#endif

#ifndef OMIT_nvmlDeviceGetMaxClockInfo
NVML_API nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, nvmlClockType_t type,
                                                unsigned int *clock)
{
    return clock_info(device, type, clock, FN_nvmlDeviceGetMaxClockInfo, true);
}
#endif

#ifndef OMIT_nvmlDeviceGetTemperature
NVML_API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device,
                                               nvmlTemperatureSensors_t sensor,
                                               unsigned int *temperature)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlDeviceGetTemperature, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (temperature == NULL || sensor != NVML_TEMPERATURE_GPU) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    *temperature = value_u32(&call, K_GPU_TEMP_C);
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetTemperatureV
NVML_API nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device,
                                                nvmlTemperature_t *temperature)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlDeviceGetTemperatureV, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (temperature == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (temperature->version != nvmlTemperature_v1) {
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    if (temperature->sensorType != NVML_TEMPERATURE_GPU) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    temperature->temperature = (int)value_u32(&call, K_GPU_TEMP_C);
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetTemperatureThreshold
NVML_API nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device,
                                                        nvmlTemperatureThresholds_t threshold,
                                                        unsigned int *temperature)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlDeviceGetTemperatureThreshold, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (temperature == NULL || (unsigned int)threshold >= NVML_TEMPERATURE_THRESHOLD_COUNT) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    switch (threshold) {
    case NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
        *temperature = value_u32(&call, K_SHUTDOWN_TEMP_C);
        return leave(NVML_SUCCESS);
    case NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
        *temperature = value_u32(&call, K_SLOWDOWN_TEMP_C);
        return leave(NVML_SUCCESS);
    default:
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
}
#endif

#ifndef OMIT_nvmlDeviceGetUtilizationRates
NVML_API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                    nvmlUtilization_t *utilization)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlDeviceGetUtilizationRates, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (utilization == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (in_mig_mode(&call)) {
        return leave(NVML_ERROR_NOT_SUPPORTED); /* as NVML: no utilization in MIG mode */
    }
    utilization->gpu = value_u32(&call, K_GPU_UTIL_PCT);
    utilization->memory = value_u32(&call, K_MEM_UTIL_PCT);
    return leave(NVML_SUCCESS);
}
#endif

/* Memory as NVML reports it: v2 separates the reserved memory that v1 counts as used. A MIG
 * device has its own total, nothing reserved, and its running processes' memory in use. */
HELPER void memory_now(const struct call *call, unsigned long long *total,
                       unsigned long long *reserved, unsigned long long *used,
                       unsigned long long *free_bytes)
{
    if (call->mig != NULL) {
        const struct schedule *schedule = &call->mig->schedule;
        *total = call->mig->memory_total_bytes;
        *reserved = 0;
        *used = 0;
        for (size_t i = 0; i < schedule->n_processes; i++) {
            if (process_running(&schedule->processes[i], call->t)) {
                *used += schedule->processes[i].used_bytes;
            }
        }
    } else {
        *total = value_u64(call, K_MEMORY_TOTAL_BYTES);
        *reserved = value_u64(call, K_MEMORY_RESERVED_BYTES);
        *used = value_u64(call, K_MEMORY_USED_BYTES);
    }
    *free_bytes = *reserved + *used < *total ? *total - *reserved - *used : 0;
}

#ifndef OMIT_nvmlDeviceGetMemoryInfo
NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    struct call call;
    unsigned long long total, reserved, used, free_bytes;
    nvmlReturn_t result = enter_handle(device, FN_nvmlDeviceGetMemoryInfo, MIG_ALLOWED, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (memory == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    memory_now(&call, &total, &reserved, &used, &free_bytes);
    memory->total = total;
    memory->used = used + reserved;
    memory->free = free_bytes;
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetMemoryInfo_v2
NVML_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    struct call call;
    unsigned long long total, reserved, used, free_bytes;
    nvmlReturn_t result =
        enter_handle(device, FN_nvmlDeviceGetMemoryInfo_v2, MIG_ALLOWED, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (memory == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (memory->version != nvmlMemory_v2) {
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    memory_now(&call, &total, &reserved, &used, &free_bytes);
    memory->total = total;
    memory->reserved = reserved;
    memory->used = used;
    memory->free = free_bytes;
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetPcieThroughput
NVML_API nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device,
                                                  nvmlPcieUtilCounter_t counter,
                                                  unsigned int *value)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlDeviceGetPcieThroughput, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (value == NULL ||
        (counter != NVML_PCIE_UTIL_TX_BYTES && counter != NVML_PCIE_UTIL_RX_BYTES)) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    *value = value_u32(&call, counter == NVML_PCIE_UTIL_TX_BYTES ? K_PCIE_TX_KBPS
                                                                  : K_PCIE_RX_KBPS);
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetTotalEccErrors
NVML_API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device,
                                                  nvmlMemoryErrorType_t errorType,
                                                  nvmlEccCounterType_t counterType,
                                                  unsigned long long *count)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlDeviceGetTotalEccErrors, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (count == NULL || (unsigned int)errorType >= NVML_MEMORY_ERROR_TYPE_COUNT ||
        (unsigned int)counterType >= NVML_ECC_COUNTER_TYPE_COUNT) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    *count = value_u64(&call, errorType == NVML_MEMORY_ERROR_TYPE_CORRECTED ? K_ECC_CORRECTED
                                                                           : K_ECC_UNCORRECTED);
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetRemappedRows
NVML_API nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                                unsigned int *uncRows, unsigned int *isPending,
                                                unsigned int *failureOccurred)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlDeviceGetRemappedRows, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (corrRows == NULL || uncRows == NULL || isPending == NULL || failureOccurred == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    *corrRows = value_u32(&call, K_REMAPPED_CORRECTED);
    *uncRows = value_u32(&call, K_REMAPPED_UNCORRECTED);
    *isPending = value_u32(&call, K_REMAPPED_PENDING);
    *failureOccurred = value_u32(&call, K_REMAPPED_FAILURE);
    return leave(NVML_SUCCESS);
}
#endif

/* ---- Counters ---- */

#ifndef OMIT_nvmlDeviceGetFieldValues
NVML_API nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                               nvmlFieldValue_t *values)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlDeviceGetFieldValues, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (valuesCount < 0 || (valuesCount > 0 && values == NULL)) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    for (int i = 0; i < valuesCount; i++) {
        fill_field(&call, &values[i]);
    }
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetViolationStatus
NVML_API nvmlReturn_t nvmlDeviceGetViolationStatus(nvmlDevice_t device,
                                                   nvmlPerfPolicyType_t perfPolicyType,
                                                   nvmlViolationTime_t *violTime)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlDeviceGetViolationStatus, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    unsigned int policy = (unsigned int)perfPolicyType;
    bool known = policy <= NVML_PERF_POLICY_RELIABILITY ||
                 policy == NVML_PERF_POLICY_TOTAL_APP_CLOCKS ||
                 policy == NVML_PERF_POLICY_TOTAL_BASE_CLOCKS;
    if (violTime == NULL || !known) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    violTime->referenceTime = real_microseconds();
    violTime->violationTime = violation_ns(&call, policy_reasons(perfPolicyType));
    return leave(NVML_SUCCESS);
}
#endif

/* ---- Processes ---- */

/* Appends the processes of one schedule running at t to out[count...] (when out is not NULL);
 * returns the new count. */
HELPER unsigned int add_running(const struct schedule *schedule, unsigned int gpu_instance_id,
                                unsigned int compute_instance_id, double t,
                                nvmlProcessInfo_t *out, unsigned int count)
{
    for (size_t i = 0; i < schedule->n_processes; i++) {
        const struct process *p = &schedule->processes[i];
        if (!process_running(p, t)) {
            continue;
        }
        if (out != NULL) {
            out[count] = (nvmlProcessInfo_t){
                .pid = p->pid,
                .usedGpuMemory = p->used_bytes,
                .gpuInstanceId = gpu_instance_id,
                .computeInstanceId = compute_instance_id,
            };
        }
        count++;
    }
    return count;
}

/* A MIG device's processes; a parent's own, then those of each of its MIG devices in order. */
HELPER unsigned int running_processes(const struct call *call, nvmlProcessInfo_t *out)
{
    const struct mig_device *mig = call->mig;
    if (mig != NULL) {
        return add_running(&mig->schedule, mig->gpu_instance_id, mig->compute_instance_id,
                           call->t, out, 0);
    }
    unsigned int count = add_running(&call->device->schedule, NVML_VALUE_NOT_AVAILABLE_UINT,
                                     NVML_VALUE_NOT_AVAILABLE_UINT, call->t, out, 0);
    for (unsigned int i = 0; i < call->device->n_migs; i++) {
        mig = &call->device->migs[i];
        count = add_running(&mig->schedule, mig->gpu_instance_id, mig->compute_instance_id,
                            call->t, out, count);
    }
    return count;
}

#ifndef OMIT_nvmlDeviceGetComputeRunningProcesses_v3
NVML_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                              unsigned int *infoCount,
                                                              nvmlProcessInfo_t *infos)
{
    struct call call;
    nvmlReturn_t result = enter_handle(device, FN_nvmlDeviceGetComputeRunningProcesses_v3,
                                       MIG_ALLOWED, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (infoCount == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    unsigned int running = running_processes(&call, NULL);
    if (infos == NULL || *infoCount < running) {
        *infoCount = running;
        return leave(running == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE);
    }
    *infoCount = running_processes(&call, infos);
    return leave(NVML_SUCCESS);
}
#endif

/* ---- MIG ---- */

/* For the MIG queries on a parent: 0 means a GPU without MIG support. */
HELPER unsigned int max_mig_devices(const struct call *call)
{
    return value_u32(call, K_MAX_MIG_DEVICES);
}

/* The MIG queries of a parent: a MIG handle or a NULL output (outputs_given false) is
 * INVALID_ARGUMENT, a GPU without MIG support NOT_SUPPORTED. */
HELPER nvmlReturn_t enter_mig_query(nvmlDevice_t device, enum fn fn, bool outputs_given,
                                    struct call *call)
{
    nvmlReturn_t result = enter_handle(device, fn, MIG_INVALID, call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (!outputs_given) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (max_mig_devices(call) == 0) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    return NVML_SUCCESS;
}

#ifndef OMIT_nvmlDeviceGetMigMode
NVML_API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                           unsigned int *pendingMode)
{
    struct call call;
    nvmlReturn_t result = enter_mig_query(device, FN_nvmlDeviceGetMigMode,
                                          currentMode != NULL && pendingMode != NULL, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    *currentMode = *pendingMode = value_u32(&call, K_MIG_MODE);
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetMaxMigDeviceCount
NVML_API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    struct call call;
    nvmlReturn_t result =
        enter_mig_query(device, FN_nvmlDeviceGetMaxMigDeviceCount, count != NULL, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    *count = in_mig_mode(&call) ? max_mig_devices(&call) : 0;
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceGetMigDeviceHandleByIndex
NVML_API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                          nvmlDevice_t *migDevice)
{
    struct call call;
    nvmlReturn_t result = enter_mig_query(device, FN_nvmlDeviceGetMigDeviceHandleByIndex,
                                          migDevice != NULL, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (!in_mig_mode(&call) || index >= max_mig_devices(&call)) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (index >= call.device->n_migs) {
        return leave(NVML_ERROR_NOT_FOUND);
    }
    *migDevice = &g_mig_handles[call.index][index];
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceIsMigDeviceHandle
HANDLE_GETTER(nvmlDeviceIsMigDeviceHandle, MIG_ALLOWED, unsigned int, call.mig != NULL)
#endif
#ifndef OMIT_nvmlDeviceGetDeviceHandleFromMigDeviceHandle
HANDLE_GETTER(nvmlDeviceGetDeviceHandleFromMigDeviceHandle, MIG_ONLY, nvmlDevice_t,
              &g_handles[call.index])
#endif
#ifndef OMIT_nvmlDeviceGetGpuInstanceId
HANDLE_GETTER(nvmlDeviceGetGpuInstanceId, MIG_ONLY, unsigned int, call.mig->gpu_instance_id)
#endif
#ifndef OMIT_nvmlDeviceGetComputeInstanceId
HANDLE_GETTER(nvmlDeviceGetComputeInstanceId, MIG_ONLY, unsigned int,
              call.mig->compute_instance_id)
#endif

/* ---- CPU and NUMA affinity (a MIG device answers its parent's) ---- */

HELPER nvmlReturn_t cpu_affinity(nvmlDevice_t device, enum fn fn, unsigned int size,
                                 unsigned long *set, nvmlAffinityScope_t scope)
{
    struct call call;
    nvmlReturn_t result = enter_handle(device, fn, MIG_ALLOWED, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (set == NULL || size == 0 ||
        (scope != NVML_AFFINITY_SCOPE_NODE && scope != NVML_AFFINITY_SCOPE_SOCKET)) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (!call.device->cpu_affinity_set) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    for (unsigned int i = 0; i < size; i++) {
        set[i] = i < FAKE_CPU_WORDS ? (unsigned long)call.device->cpu_affinity[i] : 0;
    }
    return leave(NVML_SUCCESS);
}

#ifndef OMIT_nvmlDeviceGetCpuAffinity
NVML_API nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize,
                                               unsigned long *cpuSet)
{
    return cpu_affinity(device, FN_nvmlDeviceGetCpuAffinity, cpuSetSize, cpuSet,
                        NVML_AFFINITY_SCOPE_NODE);
}
#endif

#ifndef OMIT_nvmlDeviceGetCpuAffinityWithinScope
NVML_API nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device,
                                                          unsigned int cpuSetSize,
                                                          unsigned long *cpuSet,
                                                          nvmlAffinityScope_t scope)
{
    return cpu_affinity(device, FN_nvmlDeviceGetCpuAffinityWithinScope, cpuSetSize, cpuSet,
                        scope);
}
#endif

#ifndef OMIT_nvmlDeviceGetNumaNodeId
NVML_API nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, int *node)
{
    struct call call;
    nvmlReturn_t result = enter_handle(device, FN_nvmlDeviceGetNumaNodeId, MIG_ALLOWED, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (node == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (!call.device->series[K_NUMA_NODE].set) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    *node = (int)value_u32(&call, K_NUMA_NODE);
    return leave(NVML_SUCCESS);
}
#endif

/* ---- Events ---- */

#ifndef OMIT_nvmlEventSetCreate
NVML_API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (set == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    struct nvmlEventSet_st *created = calloc(1, sizeof *created);
    if (created == NULL) {
        return leave(NVML_ERROR_MEMORY);
    }
    created->next = g_event_sets;
    g_event_sets = created;
    *set = created;
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlDeviceRegisterEvents
NVML_API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                               nvmlEventSet_t set)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlDeviceRegisterEvents, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    struct nvmlEventSet_st *live = find_event_set(set);
    if (live == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if ((eventTypes & ~value_u64(&call, K_SUPPORTED_EVENT_TYPES)) != 0) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    if ((eventTypes & nvmlEventTypeXidCriticalError) != 0 &&
        (live->registered[call.index] & nvmlEventTypeXidCriticalError) == 0) {
        /* Like the driver, deliver only what happens from now on. */
        size_t first = 0;
        while (first < call.device->n_xids && call.device->xids[first].t < call.t) {
            first++;
        }
        live->next_xid[call.index] = first;
    }
    live->registered[call.index] |= eventTypes;
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlEventSetWait_v2
NVML_API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                          unsigned int timeoutms)
{
    double deadline = real_seconds() + timeoutms / 1000.0;
    for (;;) {
        double due;
        nvmlReturn_t result = enter();
        if (result != NVML_SUCCESS) {
            return result;
        }
        struct nvmlEventSet_st *live = find_event_set(set);
        if (live == NULL || data == NULL) {
            return leave(NVML_ERROR_INVALID_ARGUMENT);
        }
        double t = scenario_now();
        int d = next_xid_device(live, t, &due);
        if (d >= 0) {
            const struct xid *xid = &g_scenario->devices[d].xids[live->next_xid[d]++];
            *data = (nvmlEventData_t){
                .device = &g_handles[d],
                .eventType = nvmlEventTypeXidCriticalError,
                .eventData = xid->xid,
                .gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT,
                .computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT,
            };
            return leave(NVML_SUCCESS);
        }
        double until_due = (due - t) / g_time_scale;
        leave(NVML_SUCCESS);

        /* Sleep without the lock, briefly enough to notice a free or a shutdown. */
        double remaining = deadline - real_seconds();
        if (remaining <= 0) {
            return NVML_ERROR_TIMEOUT;
        }
        double nap = fmin(fmin(remaining, until_due), 0.02);
        struct timespec pause = {.tv_sec = 0, .tv_nsec = (long)(fmax(nap, 0.0005) * 1e9)};
        nanosleep(&pause, NULL);
    }
}
#endif

#ifndef OMIT_nvmlEventSetFree
NVML_API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    for (struct nvmlEventSet_st **link = &g_event_sets; *link != NULL; link = &(*link)->next) {
        if (*link == set) {
            *link = set->next;
            free(set);
            return leave(NVML_SUCCESS);
        }
    }
    return leave(NVML_ERROR_INVALID_ARGUMENT);
}
#endif

/* ---- GPU performance monitoring (GPM) ---- */

/* Not an NVML function, and never omitted: how many GPM samples nvmlGpmSampleAlloc handed out
 * that nvmlGpmSampleFree has not taken back yet, so that a test can see a leak. It answers
 * without an init (0 when none is live: the last nvmlShutdown frees them all). */
NVML_API unsigned int fakenvml_gpm_samples_outstanding(void)
{
    unsigned int count = 0;
    pthread_mutex_lock(&g_lock);
    for (const struct nvmlGpmSample_st *live = g_samples; live != NULL; live = live->next) {
        count++;
    }
    pthread_mutex_unlock(&g_lock);
    return count;
}

#ifndef OMIT_nvmlGpmQueryDeviceSupport
NVML_API nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device,
                                                nvmlGpmSupport_t *gpmSupport)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlGpmQueryDeviceSupport, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (gpmSupport == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (gpmSupport->version != NVML_GPM_SUPPORT_VERSION) {
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    gpmSupport->isSupportedDevice = value_u32(&call, K_GPM_SUPPORTED) != 0;
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlGpmSampleAlloc
NVML_API nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *gpmSample)
{
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (gpmSample == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    struct nvmlGpmSample_st *sample = calloc(1, sizeof *sample);
    if (sample == NULL) {
        return leave(NVML_ERROR_MEMORY);
    }
    sample->next = g_samples;
    g_samples = sample;
    *gpmSample = sample;
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlGpmSampleFree
NVML_API nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t gpmSample)
{
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    for (struct nvmlGpmSample_st **link = &g_samples; *link != NULL; link = &(*link)->next) {
        if (*link == gpmSample) {
            *link = gpmSample->next;
            free(gpmSample);
            return leave(NVML_SUCCESS);
        }
    }
    return leave(NVML_ERROR_INVALID_ARGUMENT);
}
#endif

#ifndef OMIT_nvmlGpmSampleGet
NVML_API nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t gpmSample)
{
    struct call call;
    nvmlReturn_t result = enter_device(device, FN_nvmlGpmSampleGet, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    struct nvmlGpmSample_st *sample = find_sample(gpmSample);
    if (sample == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (value_u32(&call, K_GPM_SUPPORTED) == 0) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    sample->taken = true;
    sample->device = call.index;
    sample->gpu_instance_id = NVML_VALUE_NOT_AVAILABLE_UINT;
    sample->t = call.t;
    return leave(NVML_SUCCESS);
}
#endif

#ifndef OMIT_nvmlGpmMigSampleGet
NVML_API nvmlReturn_t nvmlGpmMigSampleGet(nvmlDevice_t device, unsigned int gpuInstanceId,
                                          nvmlGpmSample_t gpmSample)
{
    struct call call;
    nvmlReturn_t result = enter_handle(device, FN_nvmlGpmMigSampleGet, MIG_INVALID, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    struct nvmlGpmSample_st *sample = find_sample(gpmSample);
    if (sample == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (value_u32(&call, K_GPM_SUPPORTED) == 0 || !in_mig_mode(&call)) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    unsigned int mig = 0;
    while (mig < call.device->n_migs &&
           call.device->migs[mig].gpu_instance_id != gpuInstanceId) {
        mig++;
    }
    if (mig == call.device->n_migs) {
        return leave(NVML_ERROR_NOT_FOUND);
    }
    sample->taken = true;
    sample->device = call.index;
    sample->gpu_instance_id = gpuInstanceId;
    sample->t = call.t;
    return leave(NVML_SUCCESS);
}
#endif

static char NAME_GRAPHICS_UTIL[] = "gr_util";
static char NAME_SM_UTIL[] = "sm_util";
static char NAME_SM_OCCUPANCY[] = "sm_occupancy";
static char NAME_TENSOR_UTIL[] = "any_tensor_util";
static char NAME_DRAM_BW_UTIL[] = "dram_bw_util";
static char LONG_GRAPHICS_UTIL[] = "Graphics engine utilization";
static char LONG_SM_UTIL[] = "SM utilization";
static char LONG_SM_OCCUPANCY[] = "SM occupancy";
static char LONG_TENSOR_UTIL[] = "Any tensor pipe utilization";
static char LONG_DRAM_BW_UTIL[] = "DRAM bandwidth utilization";
static char UNIT_PERCENT[] = "%";

HELPER void fill_metric(const struct device *device, double t, nvmlGpmMetric_t *metric)
{
    enum key key;
    metric->value = 0;
    metric->metricInfo.unit = UNIT_PERCENT;
    switch (metric->metricId) {
    case NVML_GPM_METRIC_GRAPHICS_UTIL:
        key = K_GPM_GRAPHICS_UTIL_PCT;
        metric->metricInfo.shortName = NAME_GRAPHICS_UTIL;
        metric->metricInfo.longName = LONG_GRAPHICS_UTIL;
        break;
    case NVML_GPM_METRIC_SM_UTIL:
        key = K_GPM_SM_UTIL_PCT;
        metric->metricInfo.shortName = NAME_SM_UTIL;
        metric->metricInfo.longName = LONG_SM_UTIL;
        break;
    case NVML_GPM_METRIC_SM_OCCUPANCY:
        key = K_GPM_SM_OCCUPANCY_PCT;
        metric->metricInfo.shortName = NAME_SM_OCCUPANCY;
        metric->metricInfo.longName = LONG_SM_OCCUPANCY;
        break;
    case NVML_GPM_METRIC_ANY_TENSOR_UTIL:
        key = K_GPM_TENSOR_UTIL_PCT;
        metric->metricInfo.shortName = NAME_TENSOR_UTIL;
        metric->metricInfo.longName = LONG_TENSOR_UTIL;
        break;
    case NVML_GPM_METRIC_DRAM_BW_UTIL:
        key = K_GPM_DRAM_BW_UTIL_PCT;
        metric->metricInfo.shortName = NAME_DRAM_BW_UTIL;
        metric->metricInfo.longName = LONG_DRAM_BW_UTIL;
        break;
    default:
        metric->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        metric->metricInfo.shortName = NULL;
        metric->metricInfo.longName = NULL;
        metric->metricInfo.unit = NULL;
        return;
    }
    metric->nvmlReturn = NVML_SUCCESS;
    metric->value = device_value(device, key, t);
}

#ifndef OMIT_nvmlGpmMetricsGet
NVML_API nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *metricsGet)
{
    struct call call;
    nvmlReturn_t result = enter();
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (metricsGet == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (metricsGet->version != NVML_GPM_METRICS_GET_VERSION) {
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    const struct nvmlGpmSample_st *first = find_sample(metricsGet->sample1);
    const struct nvmlGpmSample_st *second = find_sample(metricsGet->sample2);
    if (first == NULL || second == NULL || !first->taken || !second->taken ||
        first->device != second->device || first->gpu_instance_id != second->gpu_instance_id ||
        first->t > second->t ||
        second->device >= g_scenario->device_count ||
        metricsGet->numMetrics > NVML_GPM_METRIC_MAX) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    result = check_device(second->device, FAKE_NO_MIG, FN_nvmlGpmMetricsGet, &call);
    if (result != NVML_SUCCESS) {
        return result;
    }
    if (device_value(call.device, K_GPM_SUPPORTED, second->t) == 0) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    for (unsigned int i = 0; i < metricsGet->numMetrics; i++) {
        fill_metric(call.device, second->t, &metricsGet->metrics[i]);
    }
    return leave(NVML_SUCCESS);
}
#endif
