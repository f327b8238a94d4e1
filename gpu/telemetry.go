package gpu

import (
	"log/slog"
	"strconv"
	"time"
)

// Health is a GPU's fitness for admission.
type Health int

const (
	Healthy  Health = iota
	Degraded        // throttled (thermal/power/HW slowdown), hot, or correctable errors rising: the backend's KV target is lowered
	Failed          // critical XID, uncorrectable ECC errors, GPU lost or unreadable: the backend is drained
)

// String returns "healthy", "degraded" or "failed".
func (h Health) String() string {
	switch h {
	case Healthy:
		return "healthy"
	case Degraded:
		return "degraded"
	case Failed:
		return "failed"
	}
	return "Health(" + strconv.Itoa(int(h)) + ")"
}

// GPU is one GPU's telemetry at one instant.
type GPU struct {
	Index          int
	UUID           string
	Name           string
	MemoryTotal    uint64 // bytes
	MemoryUsed     uint64 // bytes
	UtilGPU        uint32 // percent
	UtilMemory     uint32 // percent
	TemperatureC   uint32
	PowerW         float64
	PowerLimitW    float64
	Throttle       []string // active throttle/clock-event reasons, e.g. "sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"; idle and clock-setting reasons are ignored
	ECCCorrected   uint64   // volatile, total; 0 when the driver does not offer ECC
	ECCUncorrected uint64
	XIDs           []uint64 // XID codes seen since start, most recent last, at most the last 16
	Health         Health
	Reasons        []string // why Health is not Healthy, human-readable
	Err            string   // the read errors of the latest refresh, "" if none
	At             time.Time

	xidTotal uint64 // XID events seen since start, not bounded like XIDs
}

// NVMLConfig tunes the collector. Zero values take defaults.
type NVMLConfig struct {
	Interval time.Duration // poll period, default 2s
	HotC     uint32        // temperature at or above which a GPU is Degraded, default 85
	Logger   *slog.Logger  // default discards
	// CallWait bounds how long OpenNVML waits for the first read and Run's
	// stop for the calls in flight, where a driver call hangs (a sick GPU
	// can block one for minutes) [10s].
	CallWait time.Duration
}
