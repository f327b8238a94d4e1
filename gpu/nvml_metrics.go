package gpu

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// nvmlCollector exposes an NVML's latest snapshot; it reads nothing from
// the driver at scrape time.
type nvmlCollector struct {
	n *NVML

	memUsed, memTotal, util, temp, power, powerLimit, throttled, ecc, xid, health *prometheus.Desc
}

// Collector returns a prometheus.Collector exposing per-GPU metrics,
// labelled with the GPU's NVML index (gpu) and UUID (uuid), computed from
// GPUs at scrape time: kvgate_gpu_memory_used_bytes,
// kvgate_gpu_memory_total_bytes, kvgate_gpu_utilization_ratio (0..1),
// kvgate_gpu_temperature_celsius, kvgate_gpu_power_watts,
// kvgate_gpu_power_limit_watts, kvgate_gpu_throttled (1 if any throttle
// reason is active), kvgate_gpu_ecc_errors_total{type="corrected" or
// "uncorrected"}, kvgate_gpu_xid_errors_total and kvgate_gpu_health (0
// healthy, 1 degraded, 2 failed). A disabled NVML exposes nothing. Each
// call returns a new collector; register one.
func (n *NVML) Collector() prometheus.Collector {
	labels := []string{"gpu", "uuid"}
	desc := func(name, help string, extra ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, append(labels, extra...), nil)
	}
	return &nvmlCollector{
		n:          n,
		memUsed:    desc("kvgate_gpu_memory_used_bytes", "GPU memory in use, as NVML reports it."),
		memTotal:   desc("kvgate_gpu_memory_total_bytes", "GPU memory installed, as NVML reports it."),
		util:       desc("kvgate_gpu_utilization_ratio", "Fraction of the last sample period in which a kernel ran on the GPU."),
		temp:       desc("kvgate_gpu_temperature_celsius", "GPU core temperature."),
		power:      desc("kvgate_gpu_power_watts", "GPU power draw."),
		powerLimit: desc("kvgate_gpu_power_limit_watts", "GPU power limit the driver enforces."),
		throttled:  desc("kvgate_gpu_throttled", "1 if any clock throttle reason is active, including the software power cap."),
		ecc:        desc("kvgate_gpu_ecc_errors_total", "Volatile ECC errors since the driver loaded, by type.", "type"),
		xid:        desc("kvgate_gpu_xid_errors_total", "XID critical-error events seen since kvgate started."),
		health:     desc("kvgate_gpu_health", "GPU health for admission: 0 healthy, 1 degraded, 2 failed."),
	}
}

func (c *nvmlCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.memUsed, c.memTotal, c.util, c.temp, c.power, c.powerLimit, c.throttled, c.ecc, c.xid, c.health} {
		ch <- d
	}
}

func (c *nvmlCollector) Collect(ch chan<- prometheus.Metric) {
	for _, g := range c.n.GPUs() {
		idx := strconv.Itoa(g.Index)
		gauge := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, idx, g.UUID)
		}
		gauge(c.memUsed, float64(g.MemoryUsed))
		gauge(c.memTotal, float64(g.MemoryTotal))
		gauge(c.util, float64(g.UtilGPU)/100)
		gauge(c.temp, float64(g.TemperatureC))
		gauge(c.power, g.PowerW)
		gauge(c.powerLimit, g.PowerLimitW)
		throttled := 0.0
		if len(g.Throttle) > 0 {
			throttled = 1
		}
		gauge(c.throttled, throttled)
		gauge(c.health, float64(g.Health))
		ch <- prometheus.MustNewConstMetric(c.ecc, prometheus.CounterValue, float64(g.ECCCorrected), idx, g.UUID, "corrected")
		ch <- prometheus.MustNewConstMetric(c.ecc, prometheus.CounterValue, float64(g.ECCUncorrected), idx, g.UUID, "uncorrected")
		ch <- prometheus.MustNewConstMetric(c.xid, prometheus.CounterValue, float64(g.xidTotal), idx, g.UUID)
	}
}
