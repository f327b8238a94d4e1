//go:build cgo

package bench

import (
	"context"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/kvgate/kvgate/gpu"
)

// mockH100s is go-nvml's DGX H100 mock with the telemetry reads answered:
// 60% busy, 300 W and 50 °C each.
func mockH100s() *server.Server {
	srv := dgxh100.New()
	srv.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED }
	for _, d := range srv.Devices {
		d := d.(*server.Device)
		d.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{Gpu: 60, Memory: 30}, nvml.SUCCESS }
		d.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 50, nvml.SUCCESS }
		d.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 300_000, nvml.SUCCESS }
		d.GetEnforcedPowerLimitFunc = func() (uint32, nvml.Return) { return 700_000, nvml.SUCCESS }
		d.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) { return 0, nvml.SUCCESS }
		d.GetCurrentClocksThrottleReasonsFunc = func() (uint64, nvml.Return) { return 0, nvml.SUCCESS }
		d.GetTotalEccErrorsFunc = func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) { return 0, nvml.SUCCESS }
		d.RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return { return nvml.ERROR_NOT_SUPPORTED }
	}
	return srv
}

func TestRunSamplesLocalGPUs(t *testing.T) {
	nv := gpu.OpenNVML(mockH100s(), gpu.NVMLConfig{})
	if !nv.Enabled() {
		t.Fatal("mock NVML did not open")
	}
	rep := smallRun(t, func(c *Config) { c.GPUs = nv })
	if len(rep.Provenance.GPUs) != 8 || !strings.Contains(rep.Provenance.GPUs[0], "H100") || rep.Provenance.Driver == "" {
		t.Errorf("provenance GPUs %v, driver %q", rep.Provenance.GPUs, rep.Provenance.Driver)
	}
	var got []Sample
	for _, s := range rep.TimeSeries {
		if s.Source == gpuSource {
			got = append(got, s)
		}
	}
	if len(got) < 2 {
		t.Fatalf("%d GPU samples, want one at the start and one at the end", len(got))
	}
	v := got[0].Values
	if _, ok := v["gpu_memory_used_bytes"]; !ok || !near(v["gpu_utilization"], 0.6) || v["gpu_power_watts"] != 8*300 || v["gpu_temperature_c"] != 50 {
		t.Errorf("GPU sample %v", v)
	}
	if _, err := Run(context.Background(), Config{}); err == nil {
		t.Error("empty config accepted")
	}
}
