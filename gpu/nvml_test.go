//go:build cgo

package gpu

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
)

// readyMock makes every device of srv answer the reads OpenNVML makes as an
// idle, cool, error-free GPU would, and makes events unsupported. The dgx
// mocks leave telemetry calls unset, and an unset one panics.
func readyMock(srv *server.Server) *server.Server {
	srv.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED }
	for _, d := range srv.Devices {
		d := d.(*server.Device)
		d.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{}, nvml.SUCCESS }
		d.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 35, nvml.SUCCESS }
		d.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 72_000, nvml.SUCCESS }
		d.GetEnforcedPowerLimitFunc = func() (uint32, nvml.Return) { return 700_000, nvml.SUCCESS }
		d.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) { return nvml.ClocksEventReasonGpuIdle, nvml.SUCCESS }
		d.GetCurrentClocksThrottleReasonsFunc = func() (uint64, nvml.Return) { return nvml.ClocksThrottleReasonGpuIdle, nvml.SUCCESS }
		d.GetTotalEccErrorsFunc = func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) { return 0, nvml.SUCCESS }
		d.RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return { return nvml.ERROR_NOT_SUPPORTED }
	}
	return srv
}

func mockDev(srv *server.Server, i int) *server.Device { return srv.Devices[i].(*server.Device) }

// logTo returns a logger writing text lines to buf.
func logTo(buf *bytes.Buffer) *slog.Logger { return slog.New(slog.NewTextHandler(buf, nil)) }

func logLines(buf *bytes.Buffer) []string {
	return strings.Split(strings.TrimSuffix(buf.String(), "\n"), "\n")
}

func TestNVMLDGXH100(t *testing.T) {
	srv := readyMock(dgxh100.New())
	var buf bytes.Buffer
	n := OpenNVML(srv, NVMLConfig{Logger: logTo(&buf)})

	if !n.Enabled() {
		t.Fatalf("Enabled() = false; log: %s", buf.String())
	}
	if got := n.Driver(); got != "550.54.15" {
		t.Errorf("Driver() = %q, want 550.54.15", got)
	}
	if l := logLines(&buf); len(l) != 1 || !strings.Contains(l[0], `msg="nvml on"`) || !strings.Contains(l[0], "gpus=8") {
		t.Errorf("log = %q, want one nvml on line with gpus=8", l)
	}
	gpus := n.GPUs()
	if len(gpus) != 8 {
		t.Fatalf("GPUs() has %d GPUs, want 8", len(gpus))
	}
	for i, g := range gpus {
		d := mockDev(srv, i)
		if g.Index != i || g.UUID != d.UUID || g.Name != "NVIDIA H100 80GB HBM3" || g.MemoryTotal != 81920<<20 {
			t.Errorf("GPU %d = {Index %d, UUID %q, Name %q, MemoryTotal %d}, want {%d, %q, NVIDIA H100 80GB HBM3, %d}",
				i, g.Index, g.UUID, g.Name, g.MemoryTotal, i, d.UUID, 81920<<20)
		}
		if g.Health != Healthy || g.Reasons != nil || g.Err != "" || g.At.IsZero() {
			t.Errorf("GPU %d: Health %v, Reasons %q, Err %q, At %v; want healthy, no reasons or error, a time", i, g.Health, g.Reasons, g.Err, g.At)
		}
	}

	for _, tc := range []struct {
		id     string
		want   int // -1: not found
		wantOK bool
	}{
		{"0", 0, true},
		{"7", 7, true},
		{" 3 ", 3, true},
		{mockDev(srv, 5).UUID, 5, true},
		{strings.ToUpper(mockDev(srv, 6).UUID), 6, true},
		{"8", -1, false},
		{"-1", -1, false},
		{"GPU-00000000-0000-0000-0000-000000000000", -1, false},
		{"", -1, false},
	} {
		g, ok := n.Lookup(tc.id)
		if ok != tc.wantOK || (ok && g.Index != tc.want) {
			t.Errorf("Lookup(%q) = GPU %d, %t; want GPU %d, %t", tc.id, g.Index, ok, tc.want, tc.wantOK)
		}
	}
}

func TestNVMLGPUsIsACopy(t *testing.T) {
	srv := readyMock(dgxh100.New())
	mockDev(srv, 0).GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) {
		return nvml.ClocksThrottleReasonHwSlowdown, nvml.SUCCESS
	}
	n := OpenNVML(srv, NVMLConfig{})
	g := n.GPUs()[0]
	g.Throttle[0] = "changed"
	g.Reasons[0] = "changed"
	g.UUID = "changed"
	if again := n.GPUs()[0]; again.Throttle[0] != "hw_slowdown" || again.Reasons[0] == "changed" || again.UUID == "changed" {
		t.Errorf("changing a GPU from GPUs() changed the NVML's: %+v", again)
	}
}

func TestNVMLReadings(t *testing.T) {
	const target = 2
	lost := func() (nvml.Memory, nvml.Return) { return nvml.Memory{}, nvml.ERROR_GPU_IS_LOST }
	tests := []struct {
		name       string
		set        func(srv *server.Server, d *server.Device)
		check      func(t *testing.T, g GPU)
		wantHealth Health
		wantReason string // a substring of one of Reasons
		wantErr    string // a substring of Err; "" wants none
	}{
		{
			name: "busy at the power cap",
			set: func(_ *server.Server, d *server.Device) {
				d.GetMemoryInfoFunc = func() (nvml.Memory, nvml.Return) {
					return nvml.Memory{Total: d.MemoryInfo.Total, Used: 130 << 30, Free: d.MemoryInfo.Total - 130<<30}, nvml.SUCCESS
				}
				d.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{Gpu: 97, Memory: 61}, nvml.SUCCESS }
				d.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 71, nvml.SUCCESS }
				d.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 698_500, nvml.SUCCESS }
				d.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) { return nvml.ClocksEventReasonSwPowerCap, nvml.SUCCESS }
			},
			check: func(t *testing.T, g GPU) {
				if g.MemoryUsed != 130<<30 || g.MemoryTotal != 144384<<20 || g.UtilGPU != 97 || g.UtilMemory != 61 ||
					g.TemperatureC != 71 || g.PowerW != 698.5 || g.PowerLimitW != 700 || !slices.Equal(g.Throttle, []string{"sw_power_cap"}) {
					t.Errorf("readings = %+v", g)
				}
			},
			wantHealth: Healthy,
		},
		{
			name: "idle and application clocks are not throttling",
			set: func(_ *server.Server, d *server.Device) {
				d.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) {
					return nvml.ClocksEventReasonGpuIdle | nvml.ClocksEventReasonApplicationsClocksSetting, nvml.SUCCESS
				}
			},
			check: func(t *testing.T, g GPU) {
				if g.Throttle != nil {
					t.Errorf("Throttle = %q, want none", g.Throttle)
				}
			},
			wantHealth: Healthy,
		},
		{
			name: "hw slowdown",
			set: func(_ *server.Server, d *server.Device) {
				d.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) {
					return nvml.ClocksEventReasonSwPowerCap | nvml.ClocksThrottleReasonHwSlowdown, nvml.SUCCESS
				}
			},
			check: func(t *testing.T, g GPU) {
				if !slices.Equal(g.Throttle, []string{"sw_power_cap", "hw_slowdown"}) {
					t.Errorf("Throttle = %q", g.Throttle)
				}
			},
			wantHealth: Degraded,
			wantReason: "throttled: hw_slowdown",
		},
		{
			name: "throttle reasons where the driver lacks clock events",
			set: func(srv *server.Server, d *server.Device) {
				srv.LookupSymbolFunc = func(s string) error {
					if s == clockEventSymbol {
						return errors.New("undefined symbol")
					}
					return nil
				}
				d.GetCurrentClocksEventReasonsFunc = nil // panics if called
				d.GetCurrentClocksThrottleReasonsFunc = func() (uint64, nvml.Return) {
					return nvml.ClocksThrottleReasonHwThermalSlowdown, nvml.SUCCESS
				}
			},
			wantHealth: Degraded,
			wantReason: "throttled: hw_thermal",
		},
		{
			name: "hot",
			set: func(_ *server.Server, d *server.Device) {
				d.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 85, nvml.SUCCESS }
			},
			wantHealth: Degraded,
			wantReason: "temperature 85C",
		},
		{
			name: "uncorrected ECC",
			set: func(_ *server.Server, d *server.Device) {
				d.GetTotalEccErrorsFunc = func(typ nvml.MemoryErrorType, _ nvml.EccCounterType) (uint64, nvml.Return) {
					if typ == nvml.MEMORY_ERROR_TYPE_UNCORRECTED {
						return 2, nvml.SUCCESS
					}
					return 40, nvml.SUCCESS
				}
			},
			check: func(t *testing.T, g GPU) {
				if g.ECCCorrected != 40 || g.ECCUncorrected != 2 {
					t.Errorf("ECC = %d corrected, %d uncorrected; want 40, 2", g.ECCCorrected, g.ECCUncorrected)
				}
			},
			wantHealth: Failed,
			wantReason: "2 uncorrectable ECC errors",
		},
		{
			name: "ECC not supported",
			set: func(_ *server.Server, d *server.Device) {
				d.GetTotalEccErrorsFunc = func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) {
					return 0, nvml.ERROR_NOT_SUPPORTED
				}
				d.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
			},
			check: func(t *testing.T, g GPU) {
				if g.ECCCorrected != 0 || g.ECCUncorrected != 0 || g.PowerW != 0 || g.TemperatureC != 35 {
					t.Errorf("readings = %+v, want zero ECC and power, the rest read", g)
				}
			},
			wantHealth: Healthy,
		},
		{
			name: "lost",
			set: func(_ *server.Server, d *server.Device) {
				d.GetMemoryInfoFunc = lost
				d.GetUtilizationRatesFunc = nil // a lost GPU is not read further
			},
			check: func(t *testing.T, g GPU) {
				if g.UUID == "" || g.Name == "" {
					t.Errorf("UUID %q, Name %q; want them kept", g.UUID, g.Name)
				}
			},
			wantHealth: Failed,
			wantReason: "gpu lost",
			wantErr:    "memory: ERROR_GPU_IS_LOST",
		},
		{
			name: "other read error",
			set: func(_ *server.Server, d *server.Device) {
				d.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 0, nvml.ERROR_UNKNOWN }
				d.GetEnforcedPowerLimitFunc = func() (uint32, nvml.Return) { return 0, nvml.ERROR_NO_PERMISSION }
			},
			check: func(t *testing.T, g GPU) {
				if g.TemperatureC != 35 || g.MemoryTotal == 0 {
					t.Errorf("readings = %+v, want the rest read", g)
				}
			},
			wantHealth: Healthy,
			wantErr:    "power: ERROR_UNKNOWN; power limit: ERROR_NO_PERMISSION",
		},
		{
			name: "no handle",
			set: func(srv *server.Server, _ *server.Device) {
				byIndex := srv.DeviceGetHandleByIndexFunc
				srv.DeviceGetHandleByIndexFunc = func(i int) (nvml.Device, nvml.Return) {
					if i == target {
						return nil, nvml.ERROR_UNKNOWN
					}
					return byIndex(i)
				}
			},
			check: func(t *testing.T, g GPU) {
				if g.Index != target || g.UUID != "" {
					t.Errorf("Index %d, UUID %q; want %d, none", g.Index, g.UUID, target)
				}
			},
			wantHealth: Failed,
			wantReason: "gpu unreadable",
			wantErr:    "handle: ERROR_UNKNOWN",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			srv := readyMock(dgxh200.New())
			tc.set(srv, mockDev(srv, target))
			n := OpenNVML(srv, NVMLConfig{})
			gpus := n.GPUs()
			if len(gpus) != 8 {
				t.Fatalf("GPUs() has %d GPUs, want 8", len(gpus))
			}
			g := gpus[target]
			if g.Health != tc.wantHealth {
				t.Errorf("Health = %v, want %v (reasons %q)", g.Health, tc.wantHealth, g.Reasons)
			}
			if tc.wantReason == "" && g.Reasons != nil {
				t.Errorf("Reasons = %q, want none", g.Reasons)
			}
			if tc.wantReason != "" && !slices.ContainsFunc(g.Reasons, func(r string) bool { return strings.Contains(r, tc.wantReason) }) {
				t.Errorf("Reasons = %q, want one containing %q", g.Reasons, tc.wantReason)
			}
			if (tc.wantErr == "") != (g.Err == "") || !strings.Contains(g.Err, tc.wantErr) {
				t.Errorf("Err = %q, want %q", g.Err, tc.wantErr)
			}
			if tc.check != nil {
				tc.check(t, g)
			}
			for _, other := range gpus {
				if other.Index != target && (other.Health != Healthy || other.Err != "") {
					t.Errorf("GPU %d: Health %v, Err %q; want healthy", other.Index, other.Health, other.Err)
				}
			}
		})
	}
}

func TestNVMLCorrectedECCRising(t *testing.T) {
	srv := readyMock(dgxh100.New())
	var corrected atomic.Uint64
	corrected.Store(5)
	mockDev(srv, 4).GetTotalEccErrorsFunc = func(typ nvml.MemoryErrorType, _ nvml.EccCounterType) (uint64, nvml.Return) {
		if typ == nvml.MEMORY_ERROR_TYPE_CORRECTED {
			return corrected.Load(), nvml.SUCCESS
		}
		return 0, nvml.SUCCESS
	}
	n := OpenNVML(srv, NVMLConfig{})
	health := func() GPU {
		t.Helper()
		g, ok := n.Lookup("4")
		if !ok {
			t.Fatal("Lookup(4) found nothing")
		}
		return g
	}
	if g := health(); g.Health != Healthy || g.ECCCorrected != 5 {
		t.Fatalf("at start: Health %v, ECCCorrected %d; want healthy, 5: errors before start are not a rise", g.Health, g.ECCCorrected)
	}
	corrected.Store(7)
	n.Refresh()
	if g := health(); g.Health != Degraded || !slices.Equal(g.Reasons, []string{"correctable ECC errors rising: 2 more"}) {
		t.Errorf("after a rise: Health %v, Reasons %q; want degraded, rising by 2", g.Health, g.Reasons)
	}
	n.Refresh()
	if g := health(); g.Health != Healthy || g.ECCCorrected != 7 {
		t.Errorf("once steady: Health %v, ECCCorrected %d; want healthy, 7", g.Health, g.ECCCorrected)
	}
}

func TestHealthAssess(t *testing.T) {
	const hotC = 85
	type test struct {
		name        string
		g           GPU
		s           readSignals
		xids        []uint64
		want        Health
		wantReasons []string
	}
	tests := []test{
		{name: "idle", g: GPU{TemperatureC: 30}, want: Healthy},
		{name: "power cap alone", g: GPU{Throttle: []string{"sw_power_cap"}, TemperatureC: 70}, want: Healthy},
		{name: "sync boost", g: GPU{Throttle: []string{"sync_boost"}}, want: Healthy},
		{name: "just below hot", g: GPU{TemperatureC: 84}, want: Healthy},
		{name: "hot", g: GPU{TemperatureC: 85}, want: Degraded, wantReasons: []string{"temperature 85C at or above 85C"}},
		{name: "sw thermal", g: GPU{Throttle: []string{"sw_power_cap", "sw_thermal"}}, want: Degraded, wantReasons: []string{"throttled: sw_thermal"}},
		{
			name: "hw throttles", g: GPU{Throttle: []string{"hw_slowdown", "hw_thermal", "hw_power_brake"}}, want: Degraded,
			wantReasons: []string{"throttled: hw_slowdown", "throttled: hw_thermal", "throttled: hw_power_brake"},
		},
		{name: "corrected rising", s: readSignals{correctedUp: 3}, want: Degraded, wantReasons: []string{"correctable ECC errors rising: 3 more"}},
		{name: "corrected, steady", g: GPU{ECCCorrected: 100}, want: Healthy},
		{name: "application XID", xids: []uint64{13, 43}, want: Degraded, wantReasons: []string{"XID 13", "XID 43"}},
		{name: "uncorrected", g: GPU{ECCUncorrected: 1}, want: Failed, wantReasons: []string{"1 uncorrectable ECC errors"}},
		{name: "lost", s: readSignals{lost: nvml.ERROR_GPU_IS_LOST}, want: Failed, wantReasons: []string{"gpu lost: ERROR_GPU_IS_LOST"}},
		{name: "reset required", s: readSignals{lost: nvml.ERROR_RESET_REQUIRED}, want: Failed, wantReasons: []string{"gpu lost: ERROR_RESET_REQUIRED"}},
		{name: "no handle", s: readSignals{noHandle: nvml.ERROR_UNKNOWN}, want: Failed, wantReasons: []string{"gpu unreadable: ERROR_UNKNOWN"}},
		{
			name: "critical XID outranks the rest", g: GPU{Throttle: []string{"hw_slowdown"}}, xids: []uint64{13, 79}, want: Failed,
			wantReasons: []string{"critical XID 79", "XID 13", "throttled: hw_slowdown"},
		},
	}
	for _, x := range []uint64{48, 63, 64, 74, 79, 92, 94, 95} {
		c := "critical XID " + strconv.FormatUint(x, 10)
		tests = append(tests, test{name: c, xids: []uint64{x}, want: Failed, wantReasons: []string{c}})
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, reasons := assessGPU(&tc.g, tc.s, tc.xids, hotC)
			if got != tc.want || !slices.Equal(reasons, tc.wantReasons) {
				t.Errorf("assess = %v %q, want %v %q", got, reasons, tc.want, tc.wantReasons)
			}
		})
	}
}

func TestHealthString(t *testing.T) {
	for h, want := range map[Health]string{Healthy: "healthy", Degraded: "degraded", Failed: "failed", 7: "Health(7)"} {
		if got := h.String(); got != want {
			t.Errorf("Health(%d).String() = %q, want %q", int(h), got, want)
		}
	}
}

func TestNVMLXIDsBounded(t *testing.T) {
	n := OpenNVML(readyMock(dgxh100.New()), NVMLConfig{})
	n.recordXID(1, 79)
	for range 20 {
		n.recordXID(1, 13)
	}
	n.recordXID(99, 79) // not a GPU: ignored
	n.Refresh()
	g, _ := n.Lookup("1")
	if len(g.XIDs) != maxXIDs || g.XIDs[maxXIDs-1] != 13 || g.xidTotal != 21 {
		t.Errorf("XIDs = %v (total %d), want the last %d, all 13, of 21", g.XIDs, g.xidTotal, maxXIDs)
	}
	if g.Health != Failed || !slices.Equal(g.Reasons, []string{"critical XID 79", "XID 13"}) {
		t.Errorf("Health %v, Reasons %q; want failed for XID 79 after it left XIDs, each code once", g.Health, g.Reasons)
	}
}

func TestNVMLDisabled(t *testing.T) {
	tests := []struct {
		name    string
		lib     *mock.Interface
		wantLog string
	}{
		{
			name:    "library not found",
			lib:     &mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }},
			wantLog: "reason=ERROR_LIBRARY_NOT_FOUND",
		},
		{
			name:    "driver not loaded",
			lib:     &mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_DRIVER_NOT_LOADED }},
			wantLog: "reason=ERROR_DRIVER_NOT_LOADED",
		},
		{
			name: "no device count",
			lib: &mock.Interface{
				InitFunc:           func() nvml.Return { return nvml.SUCCESS },
				DeviceGetCountFunc: func() (int, nvml.Return) { return 0, nvml.ERROR_UNKNOWN },
				ShutdownFunc:       func() nvml.Return { return nvml.SUCCESS },
			},
			wantLog: `reason="device count: ERROR_UNKNOWN"`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var buf bytes.Buffer
				n := OpenNVML(tc.lib, NVMLConfig{Logger: logTo(&buf)})
				if n.Enabled() || n.GPUs() != nil || n.Driver() != "" {
					t.Errorf("Enabled %t, GPUs %v, Driver %q; want disabled", n.Enabled(), n.GPUs(), n.Driver())
				}
				if _, ok := n.Lookup("0"); ok {
					t.Error("Lookup(0) found a GPU")
				}
				n.Refresh()
				if got := testutil.CollectAndCount(n.Collector()); got != 0 {
					t.Errorf("collector has %d metrics, want none", got)
				}
				l := logLines(&buf)
				if len(l) != 1 || !strings.Contains(l[0], "level=INFO") || !strings.Contains(l[0], `msg="nvml off"`) || !strings.Contains(l[0], tc.wantLog) {
					t.Errorf("log = %q, want one info line: nvml off, %s", l, tc.wantLog)
				}

				ctx, cancel := context.WithCancel(t.Context())
				done := make(chan error, 1)
				go func() { done <- n.Run(ctx) }()
				synctest.Wait()
				select {
				case err := <-done:
					t.Fatalf("Run returned %v before cancel", err)
				default:
				}
				cancel()
				synctest.Wait()
				select {
				case err := <-done:
					if !errors.Is(err, context.Canceled) {
						t.Errorf("Run = %v, want context.Canceled", err)
					}
				default:
					t.Fatal("Run did not return after cancel")
				}
			})
		})
	}
}

// TestOpenNVMLWithoutDriver opens the real library. On a machine without
// the NVIDIA driver, as in CI, NVML is off with one log line; on a GPU
// machine it checks the GPUs read and that Run shuts NVML down.
func TestOpenNVMLWithoutDriver(t *testing.T) {
	var buf bytes.Buffer
	n := OpenNVML(nil, NVMLConfig{Logger: logTo(&buf)})
	l := logLines(&buf)
	if !n.Enabled() {
		if n.GPUs() != nil || len(l) != 1 || !strings.Contains(l[0], `msg="nvml off"`) {
			t.Errorf("GPUs %v, log %q; want none, one nvml off line", n.GPUs(), l)
		}
		return
	}
	t.Logf("NVML is present: driver %s", n.Driver())
	for _, g := range n.GPUs() {
		t.Logf("GPU %d %s %s: %d/%d MiB, %d%%, %dC, %.0f/%.0f W, throttle %q, ECC %d/%d, %v %q, err %q",
			g.Index, g.UUID, g.Name, g.MemoryUsed>>20, g.MemoryTotal>>20, g.UtilGPU, g.TemperatureC, g.PowerW, g.PowerLimitW,
			g.Throttle, g.ECCCorrected, g.ECCUncorrected, g.Health, g.Reasons, g.Err)
		if g.UUID == "" || g.MemoryTotal == 0 || g.Err != "" {
			t.Errorf("GPU %d read badly: %+v", g.Index, g)
		}
	}
	if !strings.Contains(l[0], `msg="nvml on"`) {
		t.Errorf("log = %q, want nvml on first", l)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := n.Run(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v, want context.Canceled", err)
	}
}

func TestNVMLXIDEvents(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := readyMock(dgxh100.New())
		events := make(chan nvml.EventData)
		set := &mock.EventSet{
			WaitFunc: func(ms uint32) (nvml.EventData, nvml.Return) {
				select {
				case e := <-events:
					return e, nvml.SUCCESS
				case <-time.After(time.Duration(ms) * time.Millisecond):
					return nvml.EventData{}, nvml.ERROR_TIMEOUT
				}
			},
			FreeFunc: func() nvml.Return { return nvml.SUCCESS },
		}
		srv.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) { return set, nvml.SUCCESS }
		for i := range srv.Devices {
			mockDev(srv, i).RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return { return nvml.SUCCESS }
		}
		mockDev(srv, 7).RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return { return nvml.ERROR_NOT_SUPPORTED }
		var buf bytes.Buffer
		n := OpenNVML(srv, NVMLConfig{Logger: logTo(&buf)})

		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- n.Run(ctx) }()
		events <- nvml.EventData{Device: srv.Devices[3], EventType: nvml.EventTypeXidCriticalError, EventData: 79}
		events <- nvml.EventData{Device: srv.Devices[5], EventType: nvml.EventTypeXidCriticalError, EventData: 13}
		// The driver may hand back another value for the same GPU: matched by UUID.
		other := &mock.Device{GetUUIDFunc: func() (string, nvml.Return) { return mockDev(srv, 6).UUID, nvml.SUCCESS }}
		events <- nvml.EventData{Device: other, EventType: nvml.EventTypeXidCriticalError, EventData: 48}
		events <- nvml.EventData{Device: srv.Devices[0], EventType: nvml.EventTypePState, EventData: 79} // not an XID
		synctest.Wait()

		check := func(when string) {
			t.Helper()
			for _, g := range n.GPUs() {
				want, wantXIDs, wantReasons := Healthy, []uint64(nil), []string(nil)
				switch g.Index {
				case 3:
					want, wantXIDs, wantReasons = Failed, []uint64{79}, []string{"critical XID 79"}
				case 5:
					want, wantXIDs, wantReasons = Degraded, []uint64{13}, []string{"XID 13"}
				case 6:
					want, wantXIDs, wantReasons = Failed, []uint64{48}, []string{"critical XID 48"}
				}
				if g.Health != want || !slices.Equal(g.XIDs, wantXIDs) || !slices.Equal(g.Reasons, wantReasons) {
					t.Errorf("%s: GPU %d: Health %v, XIDs %v, Reasons %q; want %v, %v, %q",
						when, g.Index, g.Health, g.XIDs, g.Reasons, want, wantXIDs, wantReasons)
				}
			}
		}
		check("after the events")
		n.Refresh()
		check("after a refresh")
		if !strings.Contains(buf.String(), `msg="gpu xid" component=nvml gpu=3`) {
			t.Errorf("log has no xid line for GPU 3:\n%s", buf.String())
		}

		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run = %v, want context.Canceled", err)
		}
		for i := range 7 {
			if calls := mockDev(srv, i).RegisterEventsCalls(); len(calls) != 1 || calls[0].V != nvml.EventTypeXidCriticalError || calls[0].EventSet != set {
				t.Errorf("GPU %d RegisterEvents calls = %+v, want one for XID critical errors", i, calls)
			}
		}
		if len(set.FreeCalls()) != 1 || len(srv.ShutdownCalls()) != 1 {
			t.Errorf("Free called %d times, Shutdown %d; want once each", len(set.FreeCalls()), len(srv.ShutdownCalls()))
		}
		reads := len(mockDev(srv, 0).GetMemoryInfoCalls())
		n.Refresh() // after shutdown: must not call the library
		if again := len(mockDev(srv, 0).GetMemoryInfoCalls()); again != reads {
			t.Errorf("Refresh after Run read the GPU: %d memory reads, had %d", again, reads)
		}
		if err := n.Run(t.Context()); err == nil {
			t.Error("second Run returned nil, want an error")
		}
	})
}

func TestNVMLRunPolls(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := readyMock(dgxh200.New())
		var temp atomic.Uint32
		temp.Store(40)
		mockDev(srv, 1).GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return temp.Load(), nvml.SUCCESS }
		const interval = 5 * time.Second
		n := OpenNVML(srv, NVMLConfig{Interval: interval, HotC: 80})

		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- n.Run(ctx) }()
		temp.Store(81)
		synctest.Wait()
		if g, _ := n.Lookup("1"); g.TemperatureC != 40 {
			t.Errorf("before the first tick: %dC, want 40", g.TemperatureC)
		}
		time.Sleep(interval) // the bubble's clock: returns once the ticker is due
		synctest.Wait()
		if g, _ := n.Lookup("1"); g.TemperatureC != 81 || g.Health != Degraded {
			t.Errorf("after a tick: %dC %v, want 81C degraded at HotC 80", g.TemperatureC, g.Health)
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run = %v, want context.Canceled", err)
		}
	})
}

func TestNVMLConcurrentUse(t *testing.T) {
	n := OpenNVML(readyMock(dgxh100.New()), NVMLConfig{})
	reg := prometheus.NewRegistry()
	reg.MustRegister(n.Collector())
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 50 {
				n.Refresh()
				n.recordXID(2, 13)
			}
		})
		wg.Go(func() {
			for range 50 {
				for _, g := range n.GPUs() {
					_ = append(g.Reasons, "x")
				}
				n.Lookup("2")
				if _, err := reg.Gather(); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if g, _ := n.Lookup("2"); g.xidTotal != 200 {
		t.Errorf("xidTotal = %d, want 200", g.xidTotal)
	}
}

func TestNVMLCollector(t *testing.T) {
	srv := readyMock(dgxh100.New())
	d1 := mockDev(srv, 1)
	d1.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{Gpu: 50, Memory: 20}, nvml.SUCCESS }
	d1.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) { return nvml.ClocksThrottleReasonHwSlowdown, nvml.SUCCESS }
	d1.GetTotalEccErrorsFunc = func(typ nvml.MemoryErrorType, _ nvml.EccCounterType) (uint64, nvml.Return) {
		if typ == nvml.MEMORY_ERROR_TYPE_CORRECTED {
			return 3, nvml.SUCCESS
		}
		return 0, nvml.SUCCESS
	}
	mockDev(srv, 2).GetTotalEccErrorsFunc = func(typ nvml.MemoryErrorType, _ nvml.EccCounterType) (uint64, nvml.Return) {
		if typ == nvml.MEMORY_ERROR_TYPE_UNCORRECTED {
			return 1, nvml.SUCCESS
		}
		return 0, nvml.SUCCESS
	}
	n := OpenNVML(srv, NVMLConfig{})
	n.recordXID(2, 95)

	c := n.Collector()
	if problems, err := testutil.CollectAndLint(c); err != nil || len(problems) > 0 {
		t.Errorf("lint: %v %+v", err, problems)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	type key struct{ name, gpu, typ string }
	got := map[key]float64{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			k := key{name: f.GetName()}
			var uuid string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "gpu":
					k.gpu = l.GetValue()
				case "uuid":
					uuid = l.GetValue()
				case "type":
					k.typ = l.GetValue()
				}
			}
			if g, ok := n.Lookup(k.gpu); !ok || g.UUID != uuid {
				t.Errorf("%s{gpu=%q} has uuid %q, want the GPU's", k.name, k.gpu, uuid)
			}
			got[k] = metricValue(f.GetType(), m)
		}
	}
	for _, tc := range []struct {
		k    key
		want float64
	}{
		{key{"kvgate_gpu_memory_total_bytes", "0", ""}, 81920 << 20},
		{key{"kvgate_gpu_memory_used_bytes", "0", ""}, 0},
		{key{"kvgate_gpu_utilization_ratio", "1", ""}, 0.5},
		{key{"kvgate_gpu_temperature_celsius", "1", ""}, 35},
		{key{"kvgate_gpu_power_watts", "1", ""}, 72},
		{key{"kvgate_gpu_power_limit_watts", "1", ""}, 700},
		{key{"kvgate_gpu_throttled", "0", ""}, 0},
		{key{"kvgate_gpu_throttled", "1", ""}, 1},
		{key{"kvgate_gpu_ecc_errors_total", "1", "corrected"}, 3},
		{key{"kvgate_gpu_ecc_errors_total", "1", "uncorrected"}, 0},
		{key{"kvgate_gpu_ecc_errors_total", "2", "uncorrected"}, 1},
		{key{"kvgate_gpu_xid_errors_total", "2", ""}, 1},
		{key{"kvgate_gpu_xid_errors_total", "3", ""}, 0},
		{key{"kvgate_gpu_health", "0", ""}, 0},
		{key{"kvgate_gpu_health", "1", ""}, 1},
		{key{"kvgate_gpu_health", "2", ""}, 2},
	} {
		if v, ok := got[tc.k]; !ok || v != tc.want {
			t.Errorf("%s{gpu=%q,type=%q} = %v (present %t), want %v", tc.k.name, tc.k.gpu, tc.k.typ, v, ok, tc.want)
		}
	}
	for name, want := range map[string]int{"kvgate_gpu_health": 8, "kvgate_gpu_ecc_errors_total": 16, "kvgate_gpu_xid_errors_total": 8} {
		if got, err := testutil.GatherAndCount(reg, name); err != nil || got != want {
			t.Errorf("%s has %d series (%v), want %d", name, got, err, want)
		}
	}
}

func metricValue(typ dto.MetricType, m *dto.Metric) float64 {
	if typ == dto.MetricType_COUNTER {
		return m.GetCounter().GetValue()
	}
	return m.GetGauge().GetValue()
}

// TestNVMLXIDsDegradeForAWhile: a non-critical XID (an application's
// fault, such as a process killed with work in flight) degrades its GPU
// for xidDegrades, then the GPU is Healthy again; a critical one keeps
// its GPU Failed.
func TestNVMLXIDsDegradeForAWhile(t *testing.T) {
	n := OpenNVML(readyMock(dgxh100.New()), NVMLConfig{})
	var mu sync.Mutex
	now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	n.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	n.recordXID(2, 45)
	n.recordXID(3, 79)
	health := func(id string) Health {
		g, ok := n.Lookup(id)
		if !ok {
			t.Fatalf("GPU %s not found", id)
		}
		return g.Health
	}
	if h2, h3 := health("2"), health("3"); h2 != Degraded || h3 != Failed {
		t.Fatalf("after XIDs 45 and 79: GPU 2 %v, GPU 3 %v; want Degraded, Failed", h2, h3)
	}
	advance := func(d time.Duration) { // and read again
		mu.Lock()
		now = now.Add(d)
		mu.Unlock()
		n.Refresh()
	}
	advance(xidDegrades - time.Second)
	if h := health("2"); h != Degraded {
		t.Errorf("GPU 2 just inside the window: %v, want Degraded", h)
	}
	n.recordXID(2, 45) // again: the window starts over
	advance(xidDegrades - time.Second)
	if h := health("2"); h != Degraded {
		t.Errorf("GPU 2 within the window of its latest XID: %v, want Degraded", h)
	}
	advance(2 * time.Second)
	if h2, h3 := health("2"), health("3"); h2 != Healthy || h3 != Failed {
		t.Errorf("past the window: GPU 2 %v, GPU 3 %v; want Healthy, Failed", h2, h3)
	}
	if g, _ := n.Lookup("2"); g.xidTotal != 2 || len(g.XIDs) != 2 {
		t.Errorf("GPU 2's XIDs %v (total %d): the record keeps them", g.XIDs, g.xidTotal)
	}
}

// TestNVMLStaleReadingDegrades: while Run polls, a GPU whose reading has
// not been renewed for three intervals (a read hanging in the driver) is
// shown Degraded, with the reason, rather than as its last reading left
// it; a fresh read shows it as it is again.
func TestNVMLStaleReadingDegrades(t *testing.T) {
	n := OpenNVML(readyMock(dgxh100.New()), NVMLConfig{Interval: time.Second})
	var mu sync.Mutex
	now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	n.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	n.Refresh()
	n.ran.Store(true) // as Run does: readings are expected every interval from now
	advance(3 * time.Second)
	if g, _ := n.Lookup("1"); g.Health != Healthy {
		t.Fatalf("a reading three intervals old: %v %v, want healthy", g.Health, g.Reasons)
	}
	advance(time.Second)
	g, _ := n.Lookup("1")
	if g.Health != Degraded || len(g.Reasons) != 1 || !strings.Contains(g.Reasons[0], "telemetry stale: last read 4s ago") {
		t.Errorf("a reading four intervals old: %v %v, want degraded, its reading stale", g.Health, g.Reasons)
	}
	if gs := n.GPUs(); gs[1].Health != Degraded {
		t.Errorf("GPUs shows GPU 1 %v, want degraded as Lookup does", gs[1].Health)
	}
	n.Refresh()
	if g, _ := n.Lookup("1"); g.Health != Healthy {
		t.Errorf("after a fresh read: %v %v, want healthy", g.Health, g.Reasons)
	}
}

// TestNVMLLookupMIG: a backend on a MIG slice names it by its MIG UUID;
// Lookup finds the GPU it is a slice of, whose health is the slice's. An
// unknown MIG UUID is not found.
func TestNVMLLookupMIG(t *testing.T) {
	srv := readyMock(dgxh100.New())
	const mig = "MIG-4f1b2c3d-0000-4000-8000-00000000000a"
	asked := 0
	srv.DeviceGetHandleByUUIDFunc = func(uuid string) (nvml.Device, nvml.Return) {
		asked++
		if uuid != mig {
			return nil, nvml.ERROR_NOT_FOUND
		}
		return &mock.Device{GetDeviceHandleFromMigDeviceHandleFunc: func() (nvml.Device, nvml.Return) {
			return srv.Devices[2], nvml.SUCCESS
		}}, nvml.SUCCESS
	}
	n := OpenNVML(srv, NVMLConfig{})
	want, _ := n.Lookup("2")
	for range 2 {
		g, ok := n.Lookup("mig-" + strings.ToUpper(mig[4:])) // any case
		if !ok || g.Index != 2 || g.UUID != want.UUID {
			t.Fatalf("Lookup(%s) = GPU %d %s, %v; want GPU 2 %s", mig, g.Index, g.UUID, ok, want.UUID)
		}
	}
	if asked != 1 {
		t.Errorf("the driver was asked %d times for the MIG device's parent, want once", asked)
	}
	n.recordXID(2, 79)
	if g, _ := n.Lookup(mig); g.Health != Failed {
		t.Errorf("the slice of a GPU that failed: %v, want failed", g.Health)
	}
	if _, ok := n.Lookup("MIG-00000000-0000-4000-8000-000000000009"); ok {
		t.Error("an unknown MIG device was found")
	}
}

// lockedBuffer is a bytes.Buffer for loggers on several goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestNVMLHungReadHoldsNothing: a driver call that never returns (a sick
// GPU's) holds neither OpenNVML, nor Run's ticks, nor Run's stop: each
// waits at most CallWait, says so in the log, and Run stops without
// shutting the library down under the call. The read, once it returns,
// fills the GPUs.
func TestNVMLHungReadHoldsNothing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := readyMock(dgxh100.New())
		hang := make(chan struct{})
		var reads atomic.Int32
		mockDev(srv, 3).GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) {
			reads.Add(1)
			<-hang
			return 40, nvml.SUCCESS
		}
		var shutdowns atomic.Int32
		shutdown := srv.ShutdownFunc
		srv.ShutdownFunc = func() nvml.Return { shutdowns.Add(1); return shutdown() }
		var logs lockedBuffer
		n := OpenNVML(srv, NVMLConfig{Interval: time.Second, CallWait: 10 * time.Second, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		if !n.Enabled() || n.GPUs() != nil {
			t.Fatalf("OpenNVML with its first read hung: enabled %v, GPUs %v; want enabled, none read yet", n.Enabled(), n.GPUs())
		}
		if !strings.Contains(logs.String(), "first read of the GPUs has not returned") {
			t.Errorf("the log does not say the first read hangs:\n%s", logs.String())
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- n.Run(ctx) }()
		time.Sleep(5 * time.Second) // five ticks while the read hangs
		synctest.Wait()
		if r := reads.Load(); r != 1 {
			t.Errorf("%d reads of the hung GPU: a tick while a read hangs must start none", r)
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run = %v, want context.Canceled", err)
		}
		if shutdowns.Load() != 0 {
			t.Error("Run shut NVML down under a call in flight")
		}
		if !strings.Contains(logs.String(), "stopping without shutting NVML down") {
			t.Errorf("the log does not say Run left a call in flight:\n%s", logs.String())
		}
		close(hang)
		synctest.Wait()
		if gs := n.GPUs(); len(gs) != 8 {
			t.Errorf("after the read returned: %d GPUs, want 8", len(gs))
		}
	})
}
