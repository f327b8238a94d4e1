//go:build cgo

package deploy

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/gpu"
)

// TestGPUMetricsExposed checks the kvgate_gpu_* names the dashboard and
// rules use against kvgate's NVML collector (the one kvgate serve
// registers) over go-nvml's DGX H100 mock: without GPUs here, that is where
// they come from.
func TestGPUMetricsExposed(t *testing.T) {
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
	}
	nv := gpu.OpenNVML(srv, gpu.NVMLConfig{})
	if !nv.Enabled() {
		t.Fatal("NVML over the mock is not enabled")
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(nv.Collector())
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	fams := map[string]string{}
	labelNames := map[string][]string{}
	for _, mf := range mfs {
		fams[mf.GetName()] = strings.ToLower(mf.GetType().String())
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if !slices.Contains(labelNames[mf.GetName()], l.GetName()) {
					labelNames[mf.GetName()] = append(labelNames[mf.GetName()], l.GetName())
				}
			}
		}
	}
	used := usedMetrics(t)
	var names []string
	for n := range used {
		if strings.HasPrefix(n, "kvgate_gpu_") {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	if len(names) == 0 {
		t.Fatal("no panel or rule uses a GPU metric")
	}
	for _, n := range names {
		if !exposed(fams, n) {
			t.Errorf("%s (used by %s): not exposed by kvgate's NVML collector (%s)", n, strings.Join(used[n], ", "), fmt.Sprint(mapsKeysS(fams)))
		}
	}
	checked := checkLabels(t, queries(t), func(m string) ([]string, bool) {
		if !strings.HasPrefix(m, "kvgate_gpu_") {
			return nil, false
		}
		ls, ok := labelNames[m]
		return ls, ok
	})
	if checked == 0 {
		t.Error("no query's labels checked against the NVML collector")
	}
}

func mapsKeysS(m map[string]string) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
