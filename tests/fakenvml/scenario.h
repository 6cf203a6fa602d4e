/*
 * The scenario model: what a scenario file declares (devices, time-scripted values, faults,
 * XID events, processes) and the queries the NVML entry points make of it. Nothing here
 * locks; the caller (fakenvml.c) holds its mutex around every use.
 */
#ifndef FAKENVML_SCENARIO_H
#define FAKENVML_SCENARIO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nvml_abi.h"

#define FAKE_MAX_DEVICES 64
/* MIG devices (compute instances) per parent at most; max_mig_devices may not exceed it. */
#define FAKE_MAX_MIG_DEVICES 16
/* CPUs that a cpu_affinity list may name: 0 .. FAKE_MAX_CPUS - 1, 64 to a word. */
#define FAKE_MAX_CPUS 4096
#define FAKE_CPU_WORDS (FAKE_MAX_CPUS / 64)
/* A `fault` or `process` line that names a parent rather than one of its MIG devices. */
#define FAKE_NO_MIG UINT32_MAX

/* Every numeric key; the table in scenario.c gives each its name, kind and default. */
enum key {
    K_COMPUTE_CAPABILITY_MAJOR,
    K_COMPUTE_CAPABILITY_MINOR,
    K_ARCHITECTURE,
    K_MEMORY_TOTAL_BYTES,
    K_MEMORY_RESERVED_BYTES,
    K_MEMORY_USED_BYTES,
    K_MAX_SM_CLOCK_MHZ,
    K_MAX_MEM_CLOCK_MHZ,
    K_MAX_GRAPHICS_CLOCK_MHZ,
    K_MAX_VIDEO_CLOCK_MHZ,
    K_SM_CLOCK_MHZ,
    K_MEM_CLOCK_MHZ,
    K_GRAPHICS_CLOCK_MHZ,
    K_VIDEO_CLOCK_MHZ,
    K_POWER_MW,
    K_POWER_AVERAGE_MW,
    K_POWER_LIMIT_MW,
    K_GPU_TEMP_C,
    K_MEM_TEMP_C,
    K_SLOWDOWN_TEMP_C,
    K_SHUTDOWN_TEMP_C,
    K_GPU_UTIL_PCT,
    K_MEM_UTIL_PCT,
    K_PCIE_GEN,
    K_PCIE_WIDTH,
    K_MAX_PCIE_GEN,
    K_MAX_PCIE_WIDTH,
    K_PCIE_TX_KBPS,
    K_PCIE_RX_KBPS,
    K_FAN_PCT,
    K_PSTATE,
    K_REASONS,
    K_ECC_CORRECTED,
    K_ECC_UNCORRECTED,
    K_REMAPPED_CORRECTED,
    K_REMAPPED_UNCORRECTED,
    K_REMAPPED_PENDING,
    K_REMAPPED_FAILURE,
    K_GPM_SUPPORTED,
    K_GPM_DRAM_BW_UTIL_PCT,
    K_GPM_SM_OCCUPANCY_PCT,
    K_GPM_TENSOR_UTIL_PCT,
    K_GPM_SM_UTIL_PCT,
    K_GPM_GRAPHICS_UTIL_PCT,
    /* Static keys: device lines only. */
    K_ENERGY_MJ,
    K_PCI_DEVICE_ID,
    K_PCI_SUBSYSTEM_ID,
    K_SUPPORTED_REASONS,
    K_SUPPORTED_EVENT_TYPES,
    K_MIG_MODE,
    K_MAX_MIG_DEVICES,
    K_NUMA_NODE,
    K_COUNT
};

/* Every device entry point, by name: `fault` lines name them, and each one checks its faults. */
#define FAKE_DEVICE_FUNCTIONS(X)                  \
    X(nvmlDeviceGetHandleByIndex_v2)              \
    X(nvmlDeviceGetHandleByUUID)                  \
    X(nvmlDeviceGetIndex)                         \
    X(nvmlDeviceGetUUID)                          \
    X(nvmlDeviceGetName)                          \
    X(nvmlDeviceGetSerial)                        \
    X(nvmlDeviceGetPciInfo_v3)                    \
    X(nvmlDeviceGetVbiosVersion)                  \
    X(nvmlDeviceGetBoardPartNumber)               \
    X(nvmlDeviceGetCudaComputeCapability)         \
    X(nvmlDeviceGetArchitecture)                  \
    X(nvmlDeviceGetClockInfo)                     \
    X(nvmlDeviceGetMaxClockInfo)                  \
    X(nvmlDeviceGetPowerUsage)                    \
    X(nvmlDeviceGetEnforcedPowerLimit)            \
    X(nvmlDeviceGetPowerManagementLimit)          \
    X(nvmlDeviceGetTotalEnergyConsumption)        \
    X(nvmlDeviceGetTemperature)                   \
    X(nvmlDeviceGetTemperatureV)                  \
    X(nvmlDeviceGetTemperatureThreshold)          \
    X(nvmlDeviceGetUtilizationRates)              \
    X(nvmlDeviceGetMemoryInfo)                    \
    X(nvmlDeviceGetMemoryInfo_v2)                 \
    X(nvmlDeviceGetCurrPcieLinkGeneration)        \
    X(nvmlDeviceGetMaxPcieLinkGeneration)         \
    X(nvmlDeviceGetCurrPcieLinkWidth)             \
    X(nvmlDeviceGetMaxPcieLinkWidth)              \
    X(nvmlDeviceGetPcieThroughput)                \
    X(nvmlDeviceGetFanSpeed)                      \
    X(nvmlDeviceGetPerformanceState)              \
    X(nvmlDeviceGetCurrentClocksEventReasons)     \
    X(nvmlDeviceGetCurrentClocksThrottleReasons)  \
    X(nvmlDeviceGetSupportedClocksEventReasons)   \
    X(nvmlDeviceGetSupportedClocksThrottleReasons) \
    X(nvmlDeviceGetFieldValues)                   \
    X(nvmlDeviceGetViolationStatus)               \
    X(nvmlDeviceGetTotalEccErrors)                \
    X(nvmlDeviceGetRemappedRows)                  \
    X(nvmlDeviceGetComputeRunningProcesses_v3)    \
    X(nvmlDeviceGetSupportedEventTypes)           \
    X(nvmlDeviceRegisterEvents)                   \
    X(nvmlDeviceGetMigMode)                       \
    X(nvmlDeviceGetMaxMigDeviceCount)             \
    X(nvmlDeviceGetMigDeviceHandleByIndex)        \
    X(nvmlDeviceIsMigDeviceHandle)                \
    X(nvmlDeviceGetDeviceHandleFromMigDeviceHandle) \
    X(nvmlDeviceGetGpuInstanceId)                 \
    X(nvmlDeviceGetComputeInstanceId)             \
    X(nvmlDeviceGetCpuAffinity)                   \
    X(nvmlDeviceGetCpuAffinityWithinScope)        \
    X(nvmlDeviceGetNumaNodeId)                    \
    X(nvmlGpmQueryDeviceSupport)                  \
    X(nvmlGpmSampleGet)                           \
    X(nvmlGpmMigSampleGet)                        \
    X(nvmlGpmMetricsGet)

enum fn {
#define FAKE_FN_ENUM(name) FN_##name,
    FAKE_DEVICE_FUNCTIONS(FAKE_FN_ENUM)
#undef FAKE_FN_ENUM
    FN_COUNT
};

/* A function-specific fault without a field targets the whole call. */
#define FAKE_NO_FIELD UINT32_MAX

struct step {
    double t;
    double value;
};

/* A step function of scenario time: `base` until the first step, then each step's value. */
struct series {
    double base;
    bool set; /* given on a device line or by an `at` line */
    struct step *steps;
    size_t n, cap;
};

struct fault {
    nvmlReturn_t code;
    bool lost;         /* every call on the device */
    enum fn fn;        /* otherwise this function ... */
    uint32_t field_id; /* ... or, for nvmlDeviceGetFieldValues, this field only */
    double start, end; /* start <= t < end */
};

struct xid {
    double t;
    unsigned long long xid;
};

struct process {
    unsigned int pid;
    unsigned long long used_bytes;
    double start, end;
};

/* What `fault` and `process` lines script for a parent or for one of its MIG devices. */
struct schedule {
    struct fault *faults;
    size_t n_faults, cap_faults;
    struct process *processes;
    size_t n_processes, cap_processes;
};

/* A MIG device (a compute instance), declared by a `mig` line on a parent in MIG mode. */
struct mig_device {
    unsigned int gpu_instance_id;
    unsigned int compute_instance_id;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    unsigned long long memory_total_bytes;
    struct schedule schedule;
};

struct device {
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char serial[NVML_DEVICE_SERIAL_BUFFER_SIZE];
    char vbios_version[NVML_DEVICE_VBIOS_VERSION_BUFFER_SIZE];
    char board_part_number[NVML_DEVICE_PART_NUMBER_BUFFER_SIZE];
    unsigned int pci_domain, pci_bus, pci_device, pci_function;
    bool cpu_affinity_set; /* false: nvmlDeviceGetCpuAffinity answers NOT_SUPPORTED */
    uint64_t cpu_affinity[FAKE_CPU_WORDS]; /* CPU i is bit i % 64 of word i / 64 */
    struct series series[K_COUNT];
    struct schedule schedule;
    struct xid *xids; /* sorted by time, file order among equal times */
    size_t n_xids, cap_xids;
    struct mig_device migs[FAKE_MAX_MIG_DEVICES]; /* in file order: MIG index 0, 1, ... */
    unsigned int n_migs;
};

struct scenario {
    double time_scale;
    char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    /* "upgrade TIME VERSION": from scenario time upgrade_t on, the driver reports this version. */
    double upgrade_t; /* INFINITY: no upgrade */
    char upgraded_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    char nvml_version[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE];
    /* "hang START END": every call made while hang_start <= t < hang_end blocks until hang_end
     * (INFINITY: never hangs). */
    double hang_start, hang_end;
    int cuda_driver_version;
    unsigned int device_count;
    struct device devices[FAKE_MAX_DEVICES];
};

/* Parses the file; on error prints "fakenvml: FILE:LINE: message" to stderr and returns NULL. */
struct scenario *scenario_load(const char *path);
void scenario_free(struct scenario *scenario);

const char *fn_name(enum fn fn);

/* The value of a key at scenario time t (graphics_clock_mhz follows sm_clock_mhz and
 * power_average_mw follows power_mw while they are never set). */
double device_value(const struct device *device, enum key key, double t);
/* Integral of power_mw over [0, t] plus energy_mj: millijoules. */
double device_energy_mj(const struct device *device, double t);
/* Scenario seconds in [0, t] during which (reasons & mask) != 0. */
double device_reason_seconds(const struct device *device, uint64_t mask, double t);
/* The fault code in force for this call at t, or NVML_SUCCESS. */
nvmlReturn_t device_fault(const struct device *device, enum fn fn, double t);
/* The same for a call on a MIG device: its parent's `lost` faults, then its own faults. */
nvmlReturn_t mig_fault(const struct device *parent, const struct mig_device *mig, enum fn fn,
                       double t);
/* Whether the process runs at t. */
bool process_running(const struct process *process, double t);
nvmlReturn_t device_field_fault(const struct device *device, uint32_t field_id, double t);

#endif
