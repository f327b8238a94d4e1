package vllmsim

import (
	"math"
	"strings"
	"testing"
)

// TestCalibration replays the published H100 experiments and holds every
// figure within ±15%, the bar the simulator is built to.
func TestCalibration(t *testing.T) {
	p, err := LookupProfile(CalibrationProfile)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := Calibrate(p, 1)
	if err != nil {
		t.Fatal(err)
	}
	var sb strings.Builder
	ok := WriteCalibration(&sb, rows, 0.15)
	t.Logf("\n%s", sb.String())
	if !ok {
		t.Errorf("calibration out of tolerance")
	}
	for _, r := range rows {
		if math.IsNaN(r.Simulated) || r.Simulated <= 0 {
			t.Errorf("%s %s: simulated %v", r.Experiment, r.Metric, r.Simulated)
		}
	}
}
